"""DeepSpeed's engine as rows of the conformance matrix: ZeRO stage x ep_size x one feature at a time.

Each row trains a small model (Linear -> DeepSpeed's MoE layer -> Linear) through `deepspeed.initialize`
on W ranks for `steps` optimizer steps with torch's SGD handed to the engine (no JIT op; SGD, not Adam,
because Adam divides by the gradient's own size and would hide a uniformly scaled gradient), with the
row's settings (EngineSettings: ZeRO stage, ep_size, gradient accumulation, clipping, precision, layer
options), and compares every step with the REFERENCE: the same mathematics on one process, written
with torch only around DeepSpeed's MoE layer at ep_size = 1 (no engine, nothing partitioned). Every
rank computes it over the whole global batch: each rank's slice goes through the ep_size = 1 layer on
its own (DeepSpeed's gate capacity is per rank), the gradient is the mean over the W data-parallel
slices and the grad_accum micro-steps (the loss DeepSpeed's data parallelism averages), clipped by the
global norm of every parameter (each expert counted once), and applied by plain SGD.

Per step the row compares: the loss of every micro-step (mean over ranks), the REDUCED gradient of
every parameter at the accumulation boundary (`safe_get_full_grad`; experts by GLOBAL index), the
engine's global gradient norm where it keeps one (ZeRO 1/2 with clipping), the update the step applied
(after - before = -lr x clipped reduced gradient) and every parameter after the step (the module's
own: ZeRO 1/2 copy the updated partitions back into it). A clip row asserts that the clip binds (the
reference's unclipped norm exceeds it), a drops row that capacity dropped some routes, else the row
would be vacuous.

The first step where anything differs is analysed on every rank (mechanisms.py) and the row's
diagnosis names the mechanism, ZeRO stage, step and parameter group; what differs later is counted as
its consequence (diagnose.FIRST_DIVERGENCE).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from moebench.libraries.deepspeed import half as half_precision
from moebench.libraries.deepspeed.halfmath import LossScaler
from moebench.libraries.deepspeed.names import DIAGNOSIS_GROUP, global_name, group, label
from moebench.libraries.deepspeed.rowmath import (
    D_MODEL,
    EXPERTS_PER_RANK,
    FP16_KEYS,
    HALF_DTYPES,
    LR,
    STEPS,
    batch,
    engine_config,
    loss_of,
    moe_fields,
    reference_step,
)
from moebench.libraries.deepspeed.user_config import BINDING_CLIP, clip_multiplier, row_clip
from moebench.libraries.spec import Row, Settings
from moebench.models.deepspeed_moe import TinyMoENet
from moebench.parity.diagnose import FIRST_DIVERGENCE
from moebench.parity.diagnosis import OUTPUT, REPLICATED, ROUTER, VACUOUS_ROW, make
from moebench.parity.layout import ExpertLayout

CLIP = BINDING_CLIP
"""gradient_clipping of a clip row: the reference's unclipped global norm is 0.15-0.4 on these
models and data (measured), so the clip binds at every step (asserted in the row)."""
PRECISIONS = ("fp32", "bf16", "fp16")
FEATURES = ("grad-accum", "clip", "bf16", "bf16+clip", "fp16", "fp16+clip", "fp16+grad-accum")
"""Engine features, each a row beside the plain one: accumulation, clipping, each precision alone and with clipping
(where DeepSpeed's half-precision optimizers compute their own norm), fp16 with accumulation."""
LAYER_OPTIONS = ("top-2", "drops", "residual")
"""Layer options, each a row alone (at ep_size = W only: see matrix())."""
STATIC_SCALE = 128.0
"""fp16.loss_scale of the static-scale rows: a static scale DeepSpeed users set, and a factor 1/128 = 0.0078 that
no other mechanism gives."""
OVERFLOW = {"overflow_step": 1, "hysteresis": 1}
"""An overflow row (dynamic fp16 scaling, DeepSpeed's initial 2^16): step 1's batch overflows (rowmath.SPIKE), so the
step is skipped and, with hysteresis 1, the scale halves; step 2 runs at 2^15."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSettings(Settings):
    """One engine row's DeepSpeed settings (these names are the row's JSON fields)."""

    zero_stage: int
    """ZeRO stage: 0, 1 or 2."""
    ep_size: int
    """Expert-parallel ranks (divides W); W / ep_size ranks hold each expert (its expert-data group)."""
    grad_accum: int = 1
    """gradient_accumulation_steps: micro-steps per optimizer step (backward + step() after each)."""
    clip: float = 0.0
    """gradient_clipping (0.0: off)."""
    precision: str = "fp32"
    """"fp32", "bf16" or "fp16" (DeepSpeed's bf16 / fp16 section)."""
    top_k: int = 1
    """Experts per token."""
    drop_tokens: bool = False
    """Capacity drops on (capacity_factor DROPS_CAPACITY_FACTOR) or off."""
    use_residual: bool = False
    """Residual MoE: a dense MLP beside the experts."""
    steps: int = STEPS
    """Optimizer steps."""
    loss_multiplier: float = 1.0
    """The loss is multiplied by this, engine and reference alike: a user's gradient_clipping larger than the
    small model's gradient norm binds this way (user_config.clip_multiplier; fp16 rows clip at 0.05 instead)."""
    loss_scale: float = 0.0
    """fp16.loss_scale: a static loss scale; 0 is dynamic loss scaling (the keys below). fp16 rows only."""
    initial_scale_power: int = 16
    """fp16.initial_scale_power: dynamic scaling starts at 2^this."""
    loss_scale_window: int = 1000
    """fp16.loss_scale_window: steps without overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    """fp16.hysteresis: overflows before the dynamic scale halves."""
    consecutive_hysteresis: bool = False
    """fp16.consecutive_hysteresis: a step without overflow refills the hysteresis."""
    min_loss_scale: int = 1
    """fp16.min_loss_scale: the dynamic scale's floor."""
    overflow_step: int = 0
    """An overflow row's step (1-based) whose batch carries an outlier target (rowmath.SPIKE): its scaled fp16
    gradients overflow, so dynamic loss scaling must skip it (0: none)."""

    def features(self) -> tuple[str, ...]:
        """The row's features: () plain, else each setting that is not the default."""
        out = []
        if self.grad_accum > 1:
            out.append("grad-accum")
        if self.clip > 0:
            out.append("clip")
        if self.precision in HALF_DTYPES:
            out.append(self.precision)
        if self.precision == "fp16" and self.loss_scale > 0:
            out.append("static-scale")
        if self.overflow_step:
            out.append("overflow")
        if self.top_k == 2:
            out.append("top-2")
        if self.drop_tokens:
            out.append("drops")
        if self.use_residual:
            out.append("residual")
        return tuple(out)


def ep_sizes(world_size: int) -> list[int]:
    """ep_size = W and every smaller size dividing W (1 included: partitioning alone), largest first."""
    return [ep for ep in range(world_size, 0, -1) if world_size % ep == 0]


def matrix(world_size: int) -> list[EngineSettings]:
    """The default matrix: every ZeRO stage x every ep_size x (plain, each engine feature), and at ep_size = W on
    every stage the layer options (top-2, drops, residual), fp16 with a static loss scale and an fp16 overflow row.

    The layer options change what the MoE layer routes, not how the engine reduces, partitions or clips, so they
    run where routing is exchanged between ranks (ep_size = W) at each stage; so do the static scale (the same
    optimizer as dynamic scaling, another scale) and the overflow row (a skipped step). The engine features run at
    every ep_size, since expert data parallelism (ep_size < W) is where the engine's expert-gradient reduction
    differs. At W = 4 that is 3 x 3 x 8 + 3 x 5 = 87 rows (timed in docs/libraries/deepspeed.md)."""
    out = []
    for stage in (0, 1, 2):
        for ep in ep_sizes(world_size):
            base = EngineSettings(zero_stage=stage, ep_size=ep)
            bf16, fp16 = (dataclasses.replace(base, precision=p) for p in ("bf16", "fp16"))
            out += [base, dataclasses.replace(base, grad_accum=2), dataclasses.replace(base, clip=CLIP),
                    bf16, dataclasses.replace(bf16, clip=CLIP),
                    fp16, dataclasses.replace(fp16, clip=CLIP), dataclasses.replace(fp16, grad_accum=2)]
            if ep == world_size:
                out += [dataclasses.replace(base, top_k=2), dataclasses.replace(base, drop_tokens=True),
                        dataclasses.replace(base, use_residual=True),
                        dataclasses.replace(fp16, loss_scale=STATIC_SCALE), dataclasses.replace(fp16, **OVERFLOW)]
    return out


USER_CONFIG_KEYS = ("zero_stage", "clip", "grad_accum", "precision", *FP16_KEYS)
"""What a user's DeepSpeed config sets in a row (`--ds-config`, read by user_config.read_user_config)."""


def user_rows_settings(world_size: int, user_config: dict) -> list[EngineSettings]:
    """One row per ep_size dividing W with the user's zero_stage / clip / grad_accum / precision / fp16 section."""
    unknown = set(user_config) - set(USER_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown user_config keys {sorted(unknown)}; expected {USER_CONFIG_KEYS}")
    precision = user_config.get("precision", "fp32")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
    clip = user_config.get("clip", 0.0)
    fields = {"zero_stage": 0, **user_config, "clip": row_clip(clip, precision),
              "loss_multiplier": clip_multiplier(clip, precision)}
    return [EngineSettings(ep_size=ep, **fields) for ep in ep_sizes(world_size)]


def row_of(settings: EngineSettings, world_size: int, *, variant: str | None = None) -> Row:
    """The Row of one setting: key deepspeed/engine/zero<S>/ep=<E>/w<W>[/<features>]."""
    features = settings.features()
    cpu_fp16 = settings.precision == "fp16" and not torch.cuda.is_available()
    return Row(library="deepspeed", model="engine", backend=f"zero{settings.zero_stage}",
               ep_mode=f"ep={settings.ep_size}", world_size=world_size, kind="engine", features=features,
               settings=settings, variant="+".join(features) if variant is None else variant,
               note=half_precision.CPU_FP16_NOTE if cpu_fp16 else "")


# ------------------------------------------------------------------ the model


def _engine(model, s: EngineSettings, world: int):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"})
    optimizer = torch.optim.SGD(groups, lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=engine_config(s, world))
    return engine


# ------------------------------------------------------------------ one row on every rank


def run(ctx, row: Row, opts) -> list:
    """The row on this rank: engine vs reference, step by step; the first divergence analysed."""
    try:
        import deepspeed  # noqa: F401
        from deepspeed.utils import groups as ds_groups
        from deepspeed.utils import safe_get_full_grad
    except ImportError as exc:
        from moebench.parity.registry import SkipCheck

        raise SkipCheck(f"deepspeed is not importable: {exc}") from None
    from moebench.libraries.deepspeed import mechanisms as mech
    from moebench.models.deepspeed_moe import create_expert_groups
    from moebench.parity.checks_deepspeed import group_timeout_s, new_groups_time_out_after
    from moebench.parity.checks_engine import _update_tolerance, quiet_deepspeed
    from moebench.parity.compare import STRICT, assertion, compare
    from moebench.variants.deepspeed.comm import deepspeed_comm

    s = row.settings
    r, w = ctx.rank, ctx.world_size
    experts = EXPERTS_PER_RANK * w
    dtype = HALF_DTYPES.get(s.precision)
    tol = STRICT
    out: list = []
    finding = None
    with new_groups_time_out_after(group_timeout_s(opts.timeout_s)), \
            deepspeed_comm(ctx, compiled_ops=False, timeout_s=opts.timeout_s), quiet_deepspeed(), \
            half_precision.cpu_fp16_allowed(s.precision == "fp16"):  # this rank only
        if dtype is not None:
            half_precision.supported_or_skip(s.precision)
        create_expert_groups(1)
        ref = TinyMoENet(moe_fields(s, 1), experts, opts.seed, 0, d_model=D_MODEL)
        ref.moe.moe.set_deepspeed_parallelism()
        half = master = None
        if dtype is not None:  # the noise model's baseline: the same mathematics in that precision on one process
            master = TinyMoENet(moe_fields(s, 1), experts, opts.seed, 0, d_model=D_MODEL)
            half = TinyMoENet(moe_fields(s, 1), experts, opts.seed, 0, d_model=D_MODEL).to(dtype)
            master.moe.moe.set_deepspeed_parallelism()
            half.moe.moe.set_deepspeed_parallelism()
        create_expert_groups(s.ep_size)
        ep_rank = ds_groups._get_expert_parallel_rank(f"ep_size_{s.ep_size}")
        layout = ExpertLayout(experts, s.ep_size)
        model = TinyMoENet(moe_fields(s, s.ep_size), experts, opts.seed, ep_rank, d_model=D_MODEL)
        engine = _engine(model, s, w)
        names = dict(engine.module.named_parameters())
        gname = {n: global_name(n, layout, ep_rank) for n in names}
        groups = {n: DIAGNOSIS_GROUP[group(gname[n])] for n in names}
        sizes = mech.GroupSizes(world=w, dp=w, ep=s.ep_size, edp=w // s.ep_size, grad_accum=s.grad_accum)
        scaler, all_skipped = LossScaler(s), True
        for step in range(s.steps):
            tag = f"ZeRO {s.zero_stage}, step {step + 1}"
            scale = scaler.scale
            base_step = reference_step(master, s, w, opts.seed, step, compute=half,
                                       loss_scale=scale) if half is not None else None
            ref_step = reference_step(ref, s, w, opts.seed, step, skip=base_step is not None and base_step.skipped)
            all_skipped = ref_step.skipped and all_skipped
            scaler.update(base_step is not None and base_step.overflow)
            asserted = base_step is None  # half precision: per element for information; judged by the noise model
            before = {n: p.detach().double().clone() for n, p in names.items()}
            masters = half_precision.fp32_masters(names, engine) if base_step is not None else None
            step_out: list = []
            reduced: dict[str, torch.Tensor] = {}
            losses = []
            for m in range(s.grad_accum):
                x, y = batch(opts.seed, s.zero_stage, step, m, r, s)
                if dtype is not None:
                    x = x.to(dtype)
                loss = loss_of(engine, x, y, s.loss_multiplier)
                engine.backward(loss)
                total = loss.detach().double().clone()
                dist.all_reduce(total)
                losses.append(total / w)
                if m == s.grad_accum - 1:  # the boundary: reduced, not yet stepped
                    for n, p in names.items():
                        g = safe_get_full_grad(p)
                        if g is not None:  # fp16 holds the gradient of the scaled loss until the step
                            reduced[n] = g.detach().double().clone() / scale
                engine.step()
            for m, value in enumerate(losses):
                what = f"loss, micro-step {m + 1}" if s.grad_accum > 1 else "loss"
                step_out.append(compare(f"{tag}: {what} (mean over ranks)", value, ref_step.losses[m], tol,
                                        world_size=w, asserted=asserted, group=OUTPUT))
            if s.clip > 0:
                binds = ref_step.norm > s.clip
                step_out.append(assertion(f"{tag}: clip binds (reference's unclipped global norm "
                                          f"{ref_step.norm:.3g} > gradient_clipping {s.clip:g})", binds,
                                          group=REPLICATED,
                                          note="" if binds else "the clip does not bind: the row would be vacuous"))
            if base_step is not None and step + 1 == s.overflow_step:
                step_out.append(assertion(f"{tag}: the spiked batch overflows the scaled fp16 gradients on one "
                                          f"process (loss scale {scale:g})", base_step.overflow, group=REPLICATED,
                                          note="" if base_step.overflow else "nothing overflowed: the row is vacuous"))
            if s.drop_tokens and step == 0:
                step_out.append(assertion(f"{tag}: capacity dropped routes ({ref_step.dropped} of "
                                          f"{ref_step.routes})", ref_step.dropped > 0, group=ROUTER,
                                          note="" if ref_step.dropped else "nothing dropped: the row is vacuous"))
            grads, wrong = {}, set()
            for n, g in reduced.items():
                grads[n] = (g, ref_step.grad[gname[n]])
                step_out.append(compare(f"{tag}: {label(gname[n])} reduced grad", g, ref_step.grad[gname[n]], tol,
                                        world_size=w, asserted=asserted, group=groups[n]))
                wrong |= set() if step_out[-1].passed or not asserted else {("grad", gname[n])}
            half_view = None
            if base_step is not None:
                judged, half_view = half_precision.step_judgement(
                    tag, s, engine=engine, names=names, gname=gname, reduced=reduced, before=before, masters=masters,
                    ref_step=ref_step, base_step=base_step, scale=scale, next_scale=scaler.scale)
                step_out += judged
            norm = None
            if s.clip > 0 and s.zero_stage > 0 and getattr(engine, "get_global_grad_norm", lambda: None)() is not None:
                norm = (float(engine.get_global_grad_norm()), ref_step.norm)
                step_out.append(compare(f"{tag}: global gradient norm", norm[0], norm[1], tol, world_size=w,
                                        asserted=asserted, group=REPLICATED))
                wrong |= set() if step_out[-1].passed or not asserted else {("norm", "")}
            updates, afters = {}, {}
            ref_params = dict(ref.named_parameters())
            for n, p in names.items():
                expected = ref_step.update[gname[n]]
                actual = p.detach().double() - before[n]
                updates[n] = (actual, expected)
                afters[n] = (p.detach().double(), ref_params[gname[n]].detach().double())
                # An expert no token reached has a zero update: the after-the-step comparison asserts it.
                if expected.any():
                    step_out.append(compare(f"{tag}: {label(gname[n])} update applied by the step "
                                            "(-lr x clipped reduced grad)", actual, expected,
                                            _update_tolerance(before[n].float()), world_size=w, asserted=asserted,
                                            group=groups[n]))
                    wrong |= set() if step_out[-1].passed or not asserted else {("update", gname[n])}
                step_out.append(compare(f"{tag}: {label(gname[n])} after the step", p, ref_params[gname[n]], tol,
                                        world_size=w, asserted=asserted, group=groups[n]))
                wrong |= set() if step_out[-1].passed or not asserted else {("after", gname[n])}
            # Half precision: the per-element comparisons only feed the analysis; reported, each would count as a
            # vacuous (unasserted) comparison, while the row is judged by its noise-model assertions.
            out += [c for c in step_out if c.asserted]
            wrong_here = torch.tensor([0 if all(c.passed for c in step_out if c.asserted) else 1])
            dist.all_reduce(wrong_here, op=dist.ReduceOp.MAX)
            if finding is None and int(wrong_here):
                mine = mech.analyse(mech.StepView(
                    settings=dataclasses.asdict(s), sizes=sizes, step=step + 1, rank=r, comparisons=step_out,
                    grads={gname[n]: v for n, v in grads.items()},
                    updates={gname[n]: v for n, v in updates.items()},
                    afters={gname[n]: v for n, v in afters.items()}, wrong=wrong, norm=norm,
                    per_slice=ref_step.per_slice, ref_grad=ref_step.grad, ref_norm=ref_step.norm, half=half_view))
                every = [None] * w
                dist.all_gather_object(every, mine)
                finding = mech.combine(every, sizes=sizes, zero_stage=s.zero_stage, step=step + 1)
        if base_step is not None and finding is None and all_skipped:  # nothing was compared but skips
            finding = make(VACUOUS_ROW, f"first divergence at ZeRO {s.zero_stage}: every step overflowed on one "
                           "process and was skipped: the row compares no update (vacuous)", **{FIRST_DIVERGENCE: True})
        if hasattr(engine, "destroy"):
            engine.destroy()
    for c in out:
        c.rank = r
    if finding is not None:
        out.insert(0, mech.first_divergence_comparison(finding, rank=r))
    return out

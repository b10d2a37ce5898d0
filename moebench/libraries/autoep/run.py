"""One AutoEP row on every rank: a Hugging Face MoE model trained through `deepspeed.initialize` with AutoEP on
(`"expert_parallel": {"enabled": true, "autoep_size": E}`), against the same model on one process, step by step.

Each rank builds the row's family from its tiny config and seeded weights (rowmath.build), records which parameter
object is which of the model's own, hands it to deepspeed.initialize with the row's config and optimizer, and reads
back what AutoEP made of it: the router it rebuilt (`router.gate`), its grouped experts `w1`/`w3`/`w2` holding this
rank's global experts (the placement AutoEP declares, `autoep_experts_for_rank`; their weights are asserted to be
those experts'), and every other parameter, kept as the same object (so a renamed shared expert is still itself).

The REFERENCE (rowmath.reference_step) is the same model on one process: every rank's slice through it, the
gradient averaged over the slices and micro-steps, clipped by the norm over every parameter (each expert once),
plain SGD. Per step the row compares the loss of every micro-step (mean over ranks), the REDUCED gradient of every
parameter at the accumulation boundary (`safe_get_full_grad`; experts by global index), the engine's global norm
where it keeps one (ZeRO 1/2 with clipping), the applied update and every parameter after the step. bf16 rows are
judged by the noise model (moebench.parity.noise), as the DeepSpeed engine rows are. The first step that differs is
analysed on every rank (mechanisms.py) and named.

A client optimizer DeepSpeed refuses is a refusal (its message); deepspeed.initialize failing is one failed line,
named `incompatible-release` when it is the transformers 5.23+ registry (compat.py), never a traceback.

Over 400 lines: one row is one story on every rank (build, hand over, read back, step, compare, analyse); the
steps share the rank's state, and splitting them would pass it through every call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys

import torch
import torch.distributed as dist

from moebench.libraries import hf_config
from moebench.libraries.autoep import compat
from moebench.libraries.autoep import rowmath as rm
from moebench.libraries.autoep.mechanisms import GroupSizes, StepView, analyse, combine, first_divergence_comparison
from moebench.libraries.spec import Row
from moebench.parity.diagnosis import (
    EXPERTS,
    FAILED_ASSERTION,
    INCOMPATIBLE_RELEASE,
    OUTPUT,
    REPLICATED,
    ROUTER,
    make,
)

GROUP = {"experts": EXPERTS, "router": ROUTER, "dense": REPLICATED}
"""A unit's group as the row's diagnosis counts it."""
HALF = {"bf16": torch.bfloat16}
"""Half precisions the rows run, and their dtype (fp16 plugs in here: rows.HALF_PRECISIONS)."""
OPTIMIZER_WORDS = {"config": "the optimizer its config builds", "config-list": "the optimizer its config builds",
                   "client": "a client optimizer", "callable": "a client optimizer callable"}
REFUSALS = ("None of the param groups are marked as MoE", "untested ZeRO Optimizer")
"""The assertions DeepSpeed refuses a client optimizer with (a refusal row: its message, not a failure)."""


@contextlib.contextmanager
def registry_shim(s):
    """The transformers registry shim for the row's duration (a row that names one, where the registry needs it),
    then transformers' own methods again: under torchrun one process runs every row, the as-shipped one too."""
    installed = None
    if s.transformers_shim and rm.registry_needs_shim():
        from transformers.utils import output_capturing

        cls = type(output_capturing._CAN_RECORD_REGISTRY)
        installed = (cls, cls.get, cls.__setitem__)
        rm.install_registry_shim()
    try:
        yield
    finally:
        if installed is not None:
            cls, get, setitem = installed
            cls.get, cls.__setitem__ = get, setitem
            del cls._moebench_shim


quiet_transformers = hf_config.quiet


def units_of(engine, ids_before: dict, held: list) -> dict:
    """Engine parameter name -> ("unit" or ("experts", projection)), read off AutoEP's replacement: the grouped
    experts by their local slots, the rebuilt router under the model's name `gate`, every kept parameter under
    the model's own name (found by identity). An AutoEP parameter none of these is named in a failed assertion."""
    out = {}
    for name, p in engine.module.named_parameters():
        if re.fullmatch(re.escape(rm.MLP) + r"experts\.w[123]", name):
            out[name] = None  # split by slot: rowmath.autoep_units
        elif name.startswith(rm.MLP + "router.gate."):
            out[name] = rm.autoep_unit(name, None, held)
        elif id(p) in ids_before:
            out[name] = ids_before[id(p)]
        else:
            out[name] = ""
    return out


def by_unit(tensors: dict, units: dict, held: list) -> dict:
    """{unit: tensor} from {engine parameter name: tensor} (experts split by slot into their global experts)."""
    out = {}
    for name, t in tensors.items():
        if units[name] is None:
            out.update(rm.autoep_units({name: t}, held))
        elif units[name]:
            out[units[name]] = t
    return out


def _initialize(engine_args: dict, s, ds_version: str):
    """deepspeed.initialize, or (None, the row's one failed comparison); a refused client optimizer raises Refused."""
    import deepspeed

    from moebench.parity.registry import Refused

    try:
        engine, *_ = deepspeed.initialize(**engine_args)
        return engine, None
    except AssertionError as exc:
        if any(r in str(exc) for r in REFUSALS):
            raise Refused(f"DeepSpeed {ds_version} refuses {OPTIMIZER_WORDS[s.optimizer]} at ZeRO {s.zero_stage} "
                          f"with AutoEP: {' '.join(str(exc).split())}") from None
        failed = exc
    except Exception as exc:  # noqa: BLE001 - what DeepSpeed raised is the row's finding, in one line
        failed = exc
    where = compat.raised_at(sys.exc_info()[2] or failed.__traceback__)
    line = compat.incompatibility(failed, where, ds_version, s.transformers)
    name = INCOMPATIBLE_RELEASE if line else FAILED_ASSERTION
    line = line or (f"deepspeed.initialize raised {type(failed).__name__}: {' '.join(str(failed).split())[:300]} "
                    f"({where}) with DeepSpeed {ds_version}, transformers {s.transformers}")
    return None, _one_line_failure(name, line)


def _one_line_failure(name: str, line: str):
    from moebench.parity.compare import Comparison

    diagnosis = make(name, line, first_divergence=True, phase="initialize")
    return Comparison(name="deepspeed.initialize with AutoEP", passed=False, kind="equal", note=line,
                      diagnosis=diagnosis, group=REPLICATED)


@dataclasses.dataclass(kw_only=True)
class Live:
    """What a rank holds of its row once AutoEP converted the model."""

    engine: object
    names: dict
    """Engine parameter name -> parameter."""
    units: dict
    """Engine parameter name -> unit (units_of)."""
    held: list
    """The global experts this rank's slots hold, slot by slot (AutoEP's declared placement)."""

    def read(self, tensors: dict) -> dict:
        return by_unit(tensors, self.units, self.held)


def run(ctx, row: Row, opts) -> list:
    """The row on this rank: AutoEP's engine vs the one-process reference, step by step; the first divergence named."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as exc:
        from moebench.parity.registry import SkipCheck

        raise SkipCheck(f"DeepSpeed is not importable: {exc}") from None
    from moebench.libraries.deepspeed import half as ds_half
    from moebench.parity.checks_deepspeed import group_timeout_s, new_groups_time_out_after
    from moebench.parity.checks_engine import quiet_deepspeed
    from moebench.variants.deepspeed.comm import deepspeed_comm

    s, r, w = row.settings, ctx.rank, ctx.world_size
    out: list = []
    finding = None
    with new_groups_time_out_after(group_timeout_s(opts.timeout_s)), \
            deepspeed_comm(ctx, compiled_ops=False, timeout_s=opts.timeout_s), quiet_deepspeed(), \
            quiet_transformers(), registry_shim(s):
        half = HALF.get(s.precision)
        if half is not None:
            ds_half.supported_or_skip(s)
        kwargs = model_kwargs(s)  # None: the family's tiny config; a --hf-config row: its file's, shrunk

        def build():
            return rm.build(s.family, s.top_k, opts.seed, kwargs, s.seqs)

        ref = build()
        one = half is not None and r == 0  # the bf16 baseline's models: rank 0 computes every reference
        master = build() if one else None
        low = build().to(half) if one else None
        live, failed = _convert(s, build(), w)
        if failed is not None:
            failed.rank = r
            return [failed]
        placement = _placement(live, ref, r, w, out)
        sizes = GroupSizes(world=w, dp=w, ep=s.autoep_size, edp=w // s.autoep_size, grad_accum=s.grad_accum)
        for step in range(s.steps):
            ref_step = _reference(r, lambda: rm.reference_step(ref, s, w, opts.seed, step), mine=bool(s.hf_config))
            base = _reference(r, lambda: rm.reference_step(master, s, w, opts.seed, step, compute=low,
                                                           labels=ref_step.labels)) if half is not None else None
            view = _step(live, s, r, w, step, opts.seed, ref_step, base)
            view.comparisons[:0] = placement if step == 0 else []
            out += [c for c in view.comparisons if c.asserted]
            bad = torch.tensor([0 if all(c.passed for c in view.comparisons if c.asserted) else 1])
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if finding is None and int(bad):
                view.sizes = sizes
                every = [None] * w
                dist.all_gather_object(every, analyse(view))
                finding = combine(every, sizes=sizes, zero_stage=s.zero_stage, step=step + 1)
        if hasattr(live.engine, "destroy"):
            live.engine.destroy()
    for c in out:
        c.rank = r
    if finding is not None:
        out.insert(0, first_divergence_comparison(finding, rank=r))
    return out


def model_kwargs(s) -> dict | None:
    """A --hf-config row's shrunk config (its file read again, refused if it changed since: hf_config.reread), with
    the row's experts; None for a row of the tiny family configs."""
    if not s.hf_config:
        return None
    from moebench.libraries.autoep.shape import FAMILIES
    from moebench.libraries.autoep.user_config import vocab_for

    setup = hf_config.reread(s.hf_config, s.hf_sha256, families=FAMILIES)
    return {**hf_config.with_experts(setup.kwargs, s.num_experts), "vocab_size": vocab_for(s.num_experts)}


def _convert(s, model, world: int) -> tuple[Live | None, object]:
    """deepspeed.initialize with AutoEP on `model`, and what it made of it; or (None, the row's one failed line)."""
    from moebench.libraries.deepspeed import ADAPTER as DEEPSPEED

    ids_before = {id(p): n for n, p in model.named_parameters()}
    optimizer, params = rm.client_optimizer(s, model)
    engine, failed = _initialize(dict(model=model, optimizer=optimizer, model_parameters=params,
                                      config=rm.engine_config(s, world)), s, DEEPSPEED.version() or "?")
    if failed is not None:
        return None, failed
    moe = engine.module.get_submodule(rm.MLP[:-1])
    held = rm.experts_held(moe)
    return Live(engine=engine, names=dict(engine.module.named_parameters()),
                units=units_of(engine, ids_before, held), held=held), None


def _placement(live: Live, ref, rank: int, world: int, out: list) -> list:
    """Every AutoEP parameter is one of the model's (appended to `out`), and its expert slots hold the experts its
    placement names (returned: judged with step 1, where a wrong slot would first show)."""
    from moebench.parity.compare import STRICT, assertion, compare

    unknown = [n for n, u in live.units.items() if u == ""]
    out.append(assertion("every AutoEP parameter is one of the model's (kept, the router, or an expert slot)",
                         not unknown, group=REPLICATED, note=f"unknown: {', '.join(unknown)}" if unknown else ""))
    ref_units = rm.reference_units(dict(ref.named_parameters()))
    placed = live.read({n: p.detach() for n, p in live.names.items()})
    return [compare(f"{rm.label(u)} as AutoEP placed it (rank {rank} holds experts {live.held})", t.float(),
                    ref_units[u].to(t.dtype).float(), STRICT, world_size=world, group=EXPERTS)
            for u, t in placed.items() if rm.group_of(u) == "experts"]


def _train(live: Live, s, rank: int, world: int, step: int, seed: int, labels: list) -> tuple[list, dict]:
    """One optimizer step of the engine: (each micro-step's loss, mean over ranks; the reduced gradients by unit,
    read at the accumulation boundary before the step)."""
    from deepspeed.utils import safe_get_full_grad

    reduced, losses = {}, []
    for m in range(s.grad_accum):
        ids = rm.batch(seed, step, m, rank, s.seqs, live.engine.module.config.vocab_size)
        loss = rm.loss_of(live.engine, ids, s.loss_multiplier, labels[m][rank])
        live.engine.backward(loss)
        total = loss.detach().double().clone()
        dist.all_reduce(total)
        losses.append(total / world)
        if m == s.grad_accum - 1:  # the boundary: reduced, not yet stepped (a collective at ZeRO 1/2)
            reduced = live.read({n: g.detach().double().clone() for n, p in live.names.items()
                                 if (g := safe_get_full_grad(p)) is not None})
        live.engine.step()
    return losses, reduced


def _step(live: Live, s, rank: int, world: int, step: int, seed: int, ref_step, base) -> StepView:
    """Train one step and compare it with the reference: what the analysis of a first divergence reads."""
    from moebench.parity.checks_engine import _update_tolerance
    from moebench.parity.compare import STRICT, assertion, compare

    tag = f"ZeRO {s.zero_stage}, step {step + 1}"
    asserted = base is None  # half precision: per element for the analysis; judged by the noise model
    before = live.read({n: p.detach().double().clone() for n, p in live.names.items()})
    masters = _masters(live) if base is not None else None
    losses, reduced = _train(live, s, rank, world, step, seed, ref_step.labels)
    outs = [compare(f"{tag}: loss{f', micro-step {m + 1}' if s.grad_accum > 1 else ''} (mean over ranks)", value,
                    ref_step.losses[m], STRICT, world_size=world, asserted=asserted, group=OUTPUT)
            for m, value in enumerate(losses)]
    outs += _premises(tag, s, step, ref_step)
    view = StepView(settings=dataclasses.asdict(s), sizes=None, step=step + 1, rank=rank, comparisons=outs,
                    grads={}, updates={}, afters={}, wrong=set(), norm=None, per_slice=ref_step.per_slice,
                    ref_grad=ref_step.grad, ref_norm=ref_step.norm)

    def judged(c, phase: str, unit: str) -> None:
        outs.append(c)
        if asserted and not c.passed:
            view.wrong.add((phase, unit))

    scale = max(float(g.abs().max()) for g in ref_step.grad.values())
    for u, g in reduced.items():
        view.grads[u] = (g, ref_step.grad[u])
        name, group = f"{tag}: {rm.label(u)} reduced grad", GROUP[rm.group_of(u)]
        if vanishing(s, u):
            outs.append(_vanishes(name, g, ref_step.grad[u], scale))
        elif not ref_step.grad[u].any():  # an expert no token reached at this step: zero, nothing to scale
            outs.append(assertion(f"{name} is zero (no token reached it)", not g.any(), group=group,
                                  note="" if not g.any() else f"it is {float(g.abs().max()):.3g} at most"))
            view.wrong |= set() if outs[-1].passed else {("grad", u)}
        else:
            judged(compare(name, g, ref_step.grad[u], STRICT, world_size=world, asserted=asserted, group=group),
                   "grad", u)
    if base is not None:
        outs.append(_noise(tag, reduced, ref_step.grad, base.grad, s, world, "reduced gradient"))
        after = _masters(live)
        if masters and after:
            outs.append(_noise(tag, {u: after[u] - masters[u] for u in after}, ref_step.update, base.update, s,
                               world, "applied update (fp32 masters)"))
    if s.clip > 0 and s.zero_stage > 0 and live.engine.get_global_grad_norm() is not None:
        view.norm = (float(live.engine.get_global_grad_norm()), ref_step.norm)
        judged(compare(f"{tag}: global gradient norm", view.norm[0], view.norm[1], STRICT, world_size=world,
                       asserted=asserted, group=REPLICATED), "norm", "")
    for u, p in live.read({n: p.detach().double() for n, p in live.names.items()}).items():
        view.updates[u] = (p - before[u], ref_step.update[u])
        view.afters[u] = (p, ref_step.after[u])
        group = GROUP[rm.group_of(u)]
        if ref_step.update[u].any() and not vanishing(s, u):  # an expert no token reached: "after" asserts it
            judged(compare(f"{tag}: {rm.label(u)} update applied by the step (-lr x clipped reduced grad)",
                           p - before[u], ref_step.update[u], _update_tolerance(before[u].float()), world_size=world,
                           asserted=asserted, group=group), "update", u)
        judged(compare(f"{tag}: {rm.label(u)} after the step", p, ref_step.after[u], STRICT, world_size=world,
                       asserted=asserted, group=group), "after", u)
    return view


def _premises(tag: str, s, step: int, ref_step) -> list:
    """What the row asserts of itself (failing, it would be vacuous): its clip binds; at step 1, every expert gets
    tokens."""
    from moebench.parity.compare import assertion

    out = []
    if s.clip > 0:
        binds = ref_step.norm > s.clip
        out.append(assertion(f"{tag}: clip binds (reference's unclipped global norm {ref_step.norm:.3g} > "
                             f"gradient_clipping {s.clip:g})", binds, group=REPLICATED,
                             note="" if binds else "the clip does not bind: the row would be vacuous"))
    if step == 0:
        unreached = [e for e, n in enumerate(ref_step.routes) if n == 0]
        out.append(assertion(f"{tag}: every expert gets tokens (routes per expert {ref_step.routes})", not unreached,
                             group=ROUTER, note=f"experts {unreached} get none: their gradients would be vacuous "
                             "zeros" if unreached else ""))
    return out


VANISHING_RTOL = 1e-5
"""A gradient that is zero in exact arithmetic (a router whose weight is normalised over one expert) is float32
rounding of terms of the row's gradient size: it must stay below 1e-5 x the row's largest reference gradient
entry on both sides (measured: ~4e-8 x; the strict tolerance's rtol, applied to the terms' size)."""


def vanishing(s, unit: str) -> bool:
    """Whether `unit`'s gradient is zero in exact arithmetic in this row (rowmath.router_gets_gradient)."""
    return rm.group_of(unit) == "router" and not rm.router_gets_gradient(s.family, s.top_k, s.norm_topk_prob,
                                                                             s.aux_loss)


def _vanishes(name: str, actual: torch.Tensor, expected: torch.Tensor, scale: float):
    """The assertion replacing the element-wise comparison of a gradient that is zero in exact arithmetic."""
    from moebench.parity.compare import assertion

    bound = VANISHING_RTOL * scale
    largest = max(float(actual.abs().max()), float(expected.abs().max()))
    return assertion(f"{name} vanishes on both sides (top-1 with the routing weight normalised: w = s / s = 1): "
                     f"|grad| {largest:.2g} <= {bound:.2g}", largest <= bound, group=ROUTER,
                     note="" if largest <= bound else "a gradient reaches a router that should get none")


def _reference(rank: int, step, mine: bool = False):
    """The reference step, computed on rank 0 alone (one process) and sent to every rank as it is (pickled
    tensors: bit for bit), so W ranks do not each redo it on shared cores. `mine`: every rank computes it itself
    (a --hf-config row: with 128-256 experts the reference takes ~0.1 s, sending its ~4000 tensors ~3 s)."""
    if mine:
        return step()
    box = [step() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _masters(live: Live) -> dict | None:
    """Each unit's float32 master weight (the half-precision optimizers keep one); None where it cannot be read."""
    from moebench.libraries.deepspeed.half import fp32_masters

    found = fp32_masters(live.names)
    return None if found is None else live.read(found)


def _noise(tag: str, tensors: dict, ref: dict, base: dict, s, world: int, what: str):
    """The noise-model judgement (moebench.parity.noise) of the whole model: this engine's distance from float32
    (every unit once over the ranks: a dense one weighted 1/W, an expert 1/edp) against the one-process half run's."""
    from moebench.parity import noise

    run = sum((noise.sums([(t, ref[u])], (s.autoep_size if rm.group_of(u) == "experts" else 1) / world)
               for u, t in tensors.items()), torch.zeros(3, dtype=torch.float64))
    dist.all_reduce(run)
    return noise.judge(tag, what, run, noise.sums((base[u], e) for u, e in ref.items()))

"""A torchtitan user row's training steps (--torchtitan-args), on every rank: the user's MoE (shrunk), parallelized by
torchtitan over the user's EP / TP degrees (the largest that fit the world size), trained STEPS steps as torchtitan's
trainer trains it, judged against the same mathematics in float32 on one process by the noise model.

Each step, as `Trainer.train_step` does it (torchtitan 0.3, trainer.py):
1. `accum` micro-batches per data-parallel rank, each a forward and backward with the loss = the sum over the
   rank's tokens / the global token count of the whole step (every micro-batch of every data-parallel rank: the
   trainer's `global_valid_tokens`), times the row's loss multiplier (below);
2. the dense parameters' gradients summed over the data-parallel ranks and the experts' over the
   expert-data-parallel ones (what torchtitan's FSDP does with its divide factor 1; emulated, and declared so in
   the row's settings; the bf16 rows apply torchtitan's own);
3. torchtitan's own `clip_grad_norm_` (torchtitan.distributed.utils) with the user's max_norm and `ep_enabled`, over
   the parameters as FSDP presents them to it: DTensors (a spmd_types state read as the DTensor its layout says,
   through torchtitan's `plain_tensor_to_dtensor_state_dict`; a dense parameter that no model-parallel axis shards
   as a DTensor replicated over the data-parallel mesh: FSDP's Shard(0) has the same norm);
4. the optimizer torchtitan's `OptimizersContainer` builds from the user's param group (Adam / AdamW with the user's
   lr, betas, eps, weight_decay; its for-loop implementation), with `register_moe_load_balancing_hook` updating the
   expert bias before the step (when load_balance_coeff is set).

Precision as torchtitan trains: `training.dtype` bfloat16 keeps parameters, gradients and optimizer state in bf16;
float32 keeps float32 parameters (FSDP's sharded masters) and, with `mixed_precision_param` bfloat16, computes in
bf16 (torch.autocast: torchtitan's own mixed-precision path where FSDP is not applied; its experts cast to bf16
themselves, its router asks for float32). The one-process baseline runs the same recipe on torchtitan's module
deep-copied before parallelizing (torchtitan's clip without EP, its optimizers container and hook on one process).

The truth: bf16.reference (the expert bias choosing, not weighing, the experts) in float32, the same accumulation,
the clip as torch defines it (norm over every gradient, coefficient max_norm / (norm + 1e-6) capped at 1), torch's
Adam / AdamW, and the bias update as torchtitan's hook defines it (coeff x sign(mean count - count), centred).

A user's clip binds on the small model only if its gradient norm exceeds max_norm: every row multiplies its loss (run,
baseline and truth alike) so that the truth's unclipped norm at step 1 is CLIP_RATIO x max_norm (clipping at max_norm
with the loss x m is clipping at max_norm / m with the loss as it is), and asserts the clip binds at every step.

Judged per step (noise model: at most BF16_NOISE_RATIO x the baseline's distance from the truth): the router /
expert / shared-expert gradients before clipping (a failing group diagnosed as the bf16 rows do: one TP rank's share,
a uniform scale), the global gradient norm torchtitan's clip returns, the gradients after the clip, each group's
update (parameters after the step minus before), and the expert bias.
"""

from __future__ import annotations

import copy

from moebench.libraries.spec import Row
from moebench.libraries.torchtitan import api, trainer
from moebench.libraries.torchtitan.bf16 import (
    GROUP_OF,
    WORDS,
    _diagnosis,
    covers_dp,
    layout_groups,
    my_tokens,
    reference,
    setup_rank,
)

STEPS = 2
"""Two optimizer steps: Adam's first step is its gradient's sign (betas do not matter); the second mixes both."""
CLIP_RATIO = 4.0
"""The truth's unclipped norm at step 1 is this x max_norm (the loss multiplied to get there): the clip binds."""
CLIP_EPS = 1e-6
"""torch's clip coefficient: max_norm / (total_norm + 1e-6), clamped to 1 (torch.nn.utils.clip_grads_with_norm_)."""
BASELINE_AGREES = 0.02
"""The one-process baseline's unclipped gradient norm must be within 2 % of the truth's (bf16 noise: < 0.1 %
measured): a setting torchtitan or this recipe gets wrong on one process too (the accumulation's normalisation, the
loss multiplier) is not noise, and the noise model, which compares the run with that baseline, would not see it."""
BIAS_AGREES = 0.5
"""The one-process expert bias must be within 50 % (relative L2) of the truth's: its update is +-coeff per expert, so
a route flipped by bf16 moves one entry, and a bias kept in bf16 (training.dtype bfloat16) rounds its small steps
(0.29 measured after 2 steps at coeff 1e-3); a hook not applied is 100 % off, its sign flipped 200 %."""
NORM_FLOOR = 1 / 128
"""The global norm is one number, rounded in the gradients' dtype: the run's may be two bf16 ulps (1/128) from the
truth's even where the one-process baseline's rounds onto it. A norm missing a group of gradients, or counting one
twice, is off by tens of percent."""
STEP_SEED = 7717
"""Micro-batch seeds: seed * STEP_SEED + step * 100 + micro-step."""


def run(ctx, row: Row, opts) -> list:
    """The row on this rank, quiet as the bf16 rows (bf16.quiet)."""
    from moebench.libraries.torchtitan.bf16 import quiet

    with quiet():
        return _run(ctx, row, opts)


class OneProcessDims:
    """What torchtitan's load-balancing hook asks of ParallelDims, on one process (the baseline): no mesh to sum
    the token counts over, no EP, no TP."""

    ep_enabled = False
    tp = 1

    @staticmethod
    def get_optional_mesh(name):
        return None


def micro_batch(seed: int, step: int, micro: int, dp: int):
    import torch

    g = torch.Generator().manual_seed(seed * STEP_SEED + step * 100 + micro)
    shape = (dp * api.SEQS_PER_DP_RANK, api.SEQ_LEN, api.HIDDEN)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def optimizers_config(s):
    """The user's param group, as torchtitan's OptimizersContainer builds it (its for-loop implementation)."""
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    kwargs = {"lr": s.lr, "betas": (s.beta1, s.beta2), "eps": s.eps, "weight_decay": s.weight_decay}
    return OptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name=s.optimizer,
                                                                     optimizer_kwargs=kwargs)],
                                      implementation="for-loop")


def loss_scale(tokens: int) -> float:
    """What each micro-batch's summed loss is divided by: the step's global token count (the trainer's
    global_valid_tokens). A test replaces it to inject an accumulation fault."""
    return float(tokens)


def _truth_step(truth: dict, bias, xs, ts, spec, s, multiplier: float, tokens: int, optimizer):
    """One step of the float32 truth over the global batch; returns (pre-clip grads, norm, post-clip grads, counts)."""
    import torch

    for p in truth.values():
        p.grad = None
    counts = torch.zeros(spec.num_experts, dtype=torch.float64)
    for x, t in zip(xs, ts):
        y = reference(truth, x.reshape(-1, api.HIDDEN), spec, False, bias=bias, counts=counts)
        ((y * t.reshape(-1, api.HIDDEN)).sum() / tokens * multiplier).backward()
    pre = {k: v.grad.detach().clone() for k, v in truth.items()}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in pre.values())).float()
    coef = torch.clamp(s.max_norm / (norm + CLIP_EPS), max=1.0)
    for p in truth.values():
        p.grad.mul_(coef)
    post = {k: v.grad.detach().clone() for k, v in truth.items()}
    return pre, norm, post, counts


def bias_update(bias, counts, coeff: float):
    """torchtitan's hook: coeff x sign(mean - count), centred (components/optimizer/optimizer.py)."""
    import torch

    delta = coeff * torch.sign(counts.float().mean() - counts.float())
    return bias + (delta - delta.mean())


def _dtensor_view(t, dims, name: str, moe):
    """A parameter or gradient as FSDP presents it to torchtitan's clip: its DTensor (a spmd_types state through
    torchtitan's own conversion), or a dense one no model-parallel axis shards replicated over the dp mesh."""
    from torch.distributed.tensor import DTensor, Replicate

    t = api.as_dtensor(moe, name, t, dims)
    if isinstance(t, DTensor) or t is None:
        return t
    mesh = dims.get_optional_mesh("fsdp") or dims.get_optional_mesh("batch")
    if mesh is None:
        mesh = dims.world_mesh
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _clip_views(moe, dims) -> list:
    """Every parameter as a DTensor whose .grad is a DTensor sharing the parameter's gradient storage."""
    import torch

    views = []
    for name, p in moe.named_parameters():
        if p.grad is None:
            continue
        view = _dtensor_view(p.detach(), dims, name, moe)
        holder = torch.nn.Parameter(view, requires_grad=True) if not isinstance(view, torch.nn.Parameter) else view
        holder.grad = _dtensor_view(p.grad, dims, name, moe)
        views.append(holder)
    return views


def _whole(moe, name: str, t, dims):
    from torch.distributed.tensor import DTensor

    t = api.as_dtensor(moe, name, t, dims)
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()


def _run(ctx, row: Row, opts) -> list:
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, register_moe_load_balancing_hook
    from torchtitan.distributed import utils as dist_utils

    from moebench.parity import noise
    from moebench.parity.compare import assertion
    from moebench.parity.diagnosis import EXPERTS, REPLICATED, ROUTER

    gen = setup_rank(row)
    refuse_where_the_trainer_cannot_run(gen, row.backend)
    s, r, w = row.settings, ctx.rank, ctx.world_size
    spec = api.spec_of(row)
    dp_n, tp_n, ep_n, sp = api.degrees(row)
    torch.manual_seed(opts.seed)
    moe = api.build(gen, spec, enable_ep=ep_n > 1, enable_sp=sp, load_balance_coeff=s.load_balance_coeff)
    roles = {role: name for role, name in api.names(gen).items() if role.startswith(("gate", "w")) or spec.shared}
    params32 = dict(moe.named_parameters())
    truth = {role: params32[name].detach().clone().requires_grad_(True) for role, name in roles.items()}
    master = torch.bfloat16 if s.dtype == "bfloat16" else torch.float32
    autocast = s.dtype != "bfloat16" and s.mp_param == "bfloat16"
    moe = moe.to(master)
    base = copy.deepcopy(moe)
    context, tp, enter, dims = api.parallelize(gen, moe, row.backend, row.ep_mode, w, (dp_n, tp_n, ep_n, sp))
    dp = w // tp
    d, t = divmod(r, tp)
    dp_group, tp_group, efsdp_group = layout_groups(w, tp, ep_n, r)
    mine = my_tokens(d, t, tp, sp)
    model, base_model = api.one_block_model(moe), api.one_block_model(base)
    optimizers = OptimizersContainer(optimizers_config(s), model_parts=[model])
    base_optimizers = OptimizersContainer(optimizers_config(s), model_parts=[base_model])
    lbc = s.load_balance_coeff
    if lbc is not None:
        register_moe_load_balancing_hook(optimizers, [model], dims)
        register_moe_load_balancing_hook(base_optimizers, [base_model], OneProcessDims())
    truth_opt = (torch.optim.AdamW if s.optimizer == "AdamW" else torch.optim.Adam)(
        list(truth.values()), lr=s.lr, betas=(s.beta1, s.beta2), eps=s.eps, weight_decay=s.weight_decay,
        foreach=False)
    truth_bias = torch.zeros(spec.num_experts) if lbc is not None else None
    accum = s.accum
    batches = [[micro_batch(opts.seed, step, m, dp) for m in range(accum)] for step in range(STEPS)]
    tokens = accum * dp * api.SEQS_PER_DP_RANK * api.SEQ_LEN

    # the loss multiplier: the truth's unclipped norm at step 1 is CLIP_RATIO x max_norm
    probe = {k: v.detach().clone().requires_grad_(True) for k, v in truth.items()}
    _, norm1, _, _ = _truth_step(probe, truth_bias, [b[0] for b in batches[0]], [b[1] for b in batches[0]], spec, s,
                                 1.0, tokens, None)
    multiplier = float(CLIP_RATIO * s.max_norm / float(norm1))

    def cast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def fwd_bwd(module, x, target, enter_fn=lambda v: v):
        x = x.detach().to(master).clone()
        with cast():
            y = module(enter_fn(x))
        y = y.to_local() if isinstance(y, DTensor) else y
        ((y.float() * target).sum() / loss_scale(tokens) * multiplier).backward()

    out: list = []
    names = dict(moe.named_parameters())
    base_names = dict(base.named_parameters())
    for step in range(STEPS):
        tag = f"step {step + 1}"
        xs, ts = [b[0] for b in batches[step]], [b[1] for b in batches[step]]
        before_run = {role: _whole(moe, name, names[name], dims) for role, name in roles.items()}
        before_base = {role: base_names[name].detach().float().clone() for role, name in roles.items()}
        before_truth = {role: p.detach().clone() for role, p in truth.items()}
        pre_t, norm_t, post_t, counts_t = _truth_step(truth, truth_bias, xs, ts, spec, s, multiplier, tokens, None)
        for x, tt in zip(xs, ts):
            fwd_bwd(base, x, tt)
            with context():
                fwd_bwd(moe, x[mine], tt[mine], enter)
        # torchtitan's FSDP, emulated: dense gradients summed over dp, experts' over efsdp (dp without EP)
        for name, p in moe.named_parameters():
            if p.grad is None:
                continue
            expert = GROUP_OF.get(_role(roles, name), REPLICATED) == EXPERTS
            over = (efsdp_group if ep_n > 1 else dp_group) if expert else dp_group
            if over is not None and not covers_dp(p.grad):
                dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=over)
        pre_run = {role: _whole(moe, name, names[name].grad, dims) for role, name in roles.items()}
        pre_base = {role: base_names[name].grad.detach().float().clone() for role, name in roles.items()}
        norm_run = dist_utils.clip_grad_norm_(_clip_views(moe, dims), s.max_norm, foreach=True,
                                              ep_enabled=dims.ep_enabled)
        norm_run = norm_run.full_tensor() if isinstance(norm_run, DTensor) else norm_run
        norm_base = dist_utils.clip_grad_norm_([p for p in base.parameters()], s.max_norm, foreach=True)
        post_run = {role: _whole(moe, name, names[name].grad, dims) for role, name in roles.items()}
        post_base = {role: base_names[name].grad.detach().float().clone() for role, name in roles.items()}
        out.append(assertion(f"{tag}: the clip binds (the float32 truth's gradient norm {float(norm_t):.3g} > "
                             f"max_norm {s.max_norm:g}, the loss x {multiplier:.3g})", float(norm_t) > s.max_norm,
                             rank=r, group=REPLICATED))
        # the gradients before the clip (the bf16 rows' judgement, with their diagnosis)
        sums = {kind: {g: torch.zeros(3, dtype=torch.float64) for g in (ROUTER, EXPERTS, REPLICATED)}
                for kind in ("run", "base", "partial", "post_run", "post_base", "upd_run", "upd_base")}
        for role in roles:
            group = GROUP_OF.get(role, REPLICATED)
            sums["run"][group] += noise.sums([(pre_run[role], pre_t[role])], 1 / w)
            sums["base"][group] += noise.sums([(pre_base[role], pre_t[role])])
            sums["post_run"][group] += noise.sums([(post_run[role], post_t[role])], 1 / w)
            sums["post_base"][group] += noise.sums([(post_base[role], post_t[role])])
            if group != EXPERTS and tp_group is not None:
                summed = pre_run[role].clone()
                dist.all_reduce(summed, group=tp_group)
                sums["partial"][group] += noise.sums([(summed, pre_t[role])], 1 / w)
        norm_sums = noise.sums([(norm_run.float().reshape(1), norm_t.reshape(1))], 1 / w)
        for kind in ("run", "partial", "post_run"):
            for v in sums[kind].values():
                dist.all_reduce(v)
        dist.all_reduce(norm_sums)
        for group in sums["run"]:
            if sums["base"][group][2] == 0:  # no shared expert in this model
                continue
            judged = noise.judge(tag, f"{WORDS[group]} gradient (before the clip)", sums["run"][group],
                                 sums["base"][group], rank=r, group=group)
            if not judged.passed:
                judged.diagnosis = _diagnosis(group, judged, sums["run"], sums["base"], sums["partial"][group], tp, w)
            out.append(judged)
        agree = abs(float(norm_base) - float(norm_t)) / float(norm_t)
        out.append(assertion(f"{tag}: the one-process baseline is the truth's mathematics: its gradient norm before "
                             f"the clip is {100 * agree:.2g} % from the truth's (<= {100 * BASELINE_AGREES:g} %)",
                             agree <= BASELINE_AGREES, rank=r, group=REPLICATED))
        d_run = noise.distance(norm_sums)
        d_base = noise.distance(noise.sums([(norm_base.float().reshape(1), norm_t.reshape(1))]))
        allowed = max(noise.BF16_NOISE_RATIO * d_base, NORM_FLOOR)
        out.append(assertion(f"{tag}: global gradient norm (torchtitan's clip_grad_norm_) {float(norm_run):.4g}: "
                             f"{d_run:.3g} from the truth's {float(norm_t):.4g} <= max({noise.BF16_NOISE_RATIO:g} x "
                             f"one process's {d_base:.3g}, {NORM_FLOOR:.3g})", d_run <= allowed, rank=r,
                             group=REPLICATED))
        for group in sums["post_run"]:
            if sums["post_base"][group][2] == 0:
                continue
            out.append(noise.judge(tag, f"{WORDS[group]} gradient after the clip", sums["post_run"][group],
                                   sums["post_base"][group], rank=r, group=group))
        # the optimizer step (torchtitan's container; its hook updates the expert bias first)
        optimizers.step()
        base_optimizers.step()
        truth_opt.step()
        if lbc is not None:
            truth_bias = bias_update(truth_bias, counts_t, lbc)
        optimizers.zero_grad()
        base_optimizers.zero_grad()
        for role, name in roles.items():
            group = GROUP_OF.get(role, REPLICATED)
            upd_t = truth[role].detach() - before_truth[role]
            sums["upd_run"][group] += noise.sums([(_whole(moe, name, names[name], dims) - before_run[role], upd_t)],
                                                 1 / w)
            sums["upd_base"][group] += noise.sums([(base_names[name].detach().float() - before_base[role], upd_t)])
        for v in sums["upd_run"].values():
            dist.all_reduce(v)
        for group in sums["upd_run"]:
            if sums["upd_base"][group][2] == 0:
                continue
            out.append(noise.judge(tag, f"{WORDS[group]} update ({s.optimizer} step)", sums["upd_run"][group],
                                   sums["upd_base"][group], rank=r, group=group))
        if lbc is not None:
            bias_run = _whole(moe, "expert_bias_E", moe.expert_bias_E, dims)
            bias_base = base.expert_bias_E.detach().float()
            b_run = noise.sums([(bias_run, truth_bias)], 1 / w)
            dist.all_reduce(b_run)
            base_bias = noise.sums([(bias_base, truth_bias)])
            off = noise.distance(base_bias)
            out.append(assertion(f"{tag}: the one-process expert bias is the truth's (torchtitan's hook): "
                                 f"{off:.3g} from it (<= {BIAS_AGREES:g})", off <= BIAS_AGREES, rank=r, group=ROUTER))
            out.append(noise.judge(tag, "expert bias (load balancing update)", b_run, base_bias, rank=r,
                                   group=ROUTER))
    if lbc is not None:
        moved = bool(truth_bias.abs().sum() > 0)
        out.append(assertion(f"the expert bias moved in {STEPS} steps (load_balance_coeff {lbc:g}: the row checks a "
                             "state that changes)", moved, rank=r, group=ROUTER,
                             note="" if moved else "it is still all zeros"))
    return out


def refuse_where_the_trainer_cannot_run(gen: str, backend: str) -> None:
    """A train row emulates its trainer's FSDP; where that trainer cannot run the backend at all (spmd_types on a
    torch whose fully_shard refuses its parameters), the row is refused as the bf16 row is, never run without it."""
    why = trainer.fsdp_refusal(backend) if gen == "common" else None
    if why is not None:
        trainer.refuse(why)


def _role(roles: dict[str, str], name: str) -> str:
    return next((role for role, n in roles.items() if n == name), "")

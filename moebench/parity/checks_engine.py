"""Check `deepspeed-engine-ep`: DeepSpeed's MoE trained through `deepspeed.initialize`, ZeRO 0/1/2,
ep_size = W against ep_size = 1 (DeepSpeed's TestExpertWeightGradWithZero, plus the loss and steps).

A small model (Linear -> DeepSpeed MoE (adapter models/deepspeed_moe.py) -> Linear) is built twice
from the same weights: ep_size = W (rank r holds experts r*n .. r*n+n-1) and ep_size = 1 (every rank
holds every expert). Both engines get the same global batch (rank r its slice) and train STEPS
plain SGD steps (a torch optimizer handed to the engine: no JIT op). SGD, not Adam, because Adam
divides by the gradient's own size: a gradient reduced N x too large moves the weights almost as
the right one does (the bug class of DeepSpeed #5618 would pass). With SGD the step IS the
reduced gradient (times -lr), at every ZeRO stage. Each step compares:
- the loss (mean over ranks);
- the update the step applied to every parameter (after - before): the engine's reduced gradient
  times -lr, whichever ZeRO stage partitioned it;
- every parameter after the step (the module's own, which ZeRO 1/2 refresh from the partitions);
- at ZeRO 0 also the gradients read back after the reduction (`safe_get_full_grad`). At ZeRO 1/2,
  with two engines in one process, that read-out returned values unlike the ep_size = 1 engine's
  while the applied updates agree (measured on DeepSpeed 0.19.8), so the updates are what is
  asserted there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings

import torch
import torch.distributed as dist

from moebench.models.deepspeed_moe import TINY_EXPERT_PREFIX, TinyMoENet
from moebench.parity.compare import SEED_DEEPSPEED, STRICT, Tolerance, compare, pick
from moebench.parity.layout import ExpertLayout
from moebench.parity.registry import Check, CheckOptions, SkipCheck, register

STAGES = (0, 1, 2)
STEPS = 2
D_MODEL = 8
D_HIDDEN = 16
EXPERTS_PER_RANK = 1
MICRO = (2, 4)  # (batch, seq) per rank
LR = 0.1
"""SGD's learning rate: large enough that an update (lr x gradient) stands well above the float32
rounding of the parameters it is read from (see _update_tolerance)."""
UPDATE_ULPS = 4
"""An update is read as after - before of float32 parameters: each side carries up to half an ulp
of rounding, and the summation order of the reduction adds its own; 4 ulps of the largest |parameter|
bound both (a gradient reduced 2 x too large is off by lr x |g| ~ 1e-3, 10^4 x more)."""


def _engine(model, stage: int, world: int):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    config = {
        "train_batch_size": MICRO[0] * world, "train_micro_batch_size_per_gpu": MICRO[0],
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"})
    optimizer = torch.optim.SGD(groups, lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


@contextlib.contextmanager
def quiet_deepspeed():
    """DeepSpeed's warnings off: "ZeRO with an untested optimizer" (torch's SGD is the point here),
    and torch's FutureWarnings that its ZeRO code triggers."""
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logger.setLevel(level)


def _update_tolerance(before: torch.Tensor) -> Tolerance:
    ulp = torch.finfo(torch.float32).eps * float(before.abs().max())
    return Tolerance(rtol=STRICT.rtol, atol_abs=UPDATE_ULPS * ulp,
                     source=f"strict: 1e-5 relative, atol {UPDATE_ULPS} ulps of the largest |parameter|")


def _rank(ctx, opts: CheckOptions) -> list:
    try:
        import deepspeed  # noqa: F401
        from deepspeed.utils import safe_get_full_grad
    except ImportError as exc:
        raise SkipCheck(f"deepspeed is not importable: {exc}") from None
    from moebench.models.deepspeed_moe import create_expert_groups
    from moebench.parity.checks_deepspeed import group_timeout_s, new_groups_time_out_after
    from moebench.variants.deepspeed.comm import deepspeed_comm
    from moebench.variants.deepspeed.config import DeepSpeedMoEConfig

    tol, asserted = pick(opts.tolerance, strict=STRICT, seed=SEED_DEEPSPEED)
    r, w = ctx.rank, ctx.world_size
    experts = EXPERTS_PER_RANK * w
    layout = ExpertLayout(experts, w)  # ep_size = W: rank r is ep rank r
    out: list = []
    with new_groups_time_out_after(group_timeout_s(opts.timeout_s)), \
            deepspeed_comm(ctx, compiled_ops=False, timeout_s=opts.timeout_s), quiet_deepspeed():
        moe = DeepSpeedMoEConfig(experts=(experts,), d_hidden=D_HIDDEN, capacity_factor=1.0,
                                 eval_capacity_factor=1.0, min_capacity=0, noisy_gate_policy="none",
                                 drop_tokens=False, use_rts=False, ep_size=1, top_k=1, use_residual=False)
        for stage in STAGES:
            engines = {}
            for ep in (w, 1):
                create_expert_groups(ep)
                model = TinyMoENet(dataclasses.replace(moe, ep_size=ep), experts, opts.seed + stage,
                                   r if ep == w else 0, d_model=D_MODEL)
                engines[ep] = _engine(model, stage, w)
            names = {ep: dict(engines[ep].module.named_parameters()) for ep in (w, 1)}
            for step in range(STEPS):
                g = torch.Generator().manual_seed(opts.seed * 10_000 + 8_000 + 100 * stage + 10 * step + r)
                x, y = torch.randn(*MICRO, D_MODEL, generator=g), torch.randn(*MICRO, D_MODEL, generator=g)
                losses = {}
                for ep, engine in engines.items():
                    pred, aux = engine(x)
                    loss = torch.nn.functional.mse_loss(pred, y) + 0.01 * aux
                    engine.backward(loss)
                    total = loss.detach().clone()
                    dist.all_reduce(total)
                    losses[ep] = total / w
                tag = f"ZeRO {stage}, step {step + 1}"
                out.append(compare(f"{tag}: loss (mean over ranks)", losses[w], losses[1], tol, asserted=asserted,
                                   world_size=w))
                for name, p in (names[w].items() if stage == 0 else ()):
                    q = names[1][layout.global_name(name, TINY_EXPERT_PREFIX, r)]
                    gp, gq = safe_get_full_grad(p), safe_get_full_grad(q)
                    if gp is None or gq is None:
                        continue
                    label = name.replace(TINY_EXPERT_PREFIX, "expert ")
                    out.append(compare(f"{tag}: {label} grad after the engine's reduction", gp, gq, tol,
                                       asserted=asserted, world_size=w))
                before = {ep: {n: p.detach().clone() for n, p in names[ep].items()} for ep in (w, 1)}
                for engine in engines.values():
                    engine.step()
                for name, p in names[w].items():
                    global_name = layout.global_name(name, TINY_EXPERT_PREFIX, r)
                    q = names[1][global_name]
                    label = name.replace(TINY_EXPERT_PREFIX, "expert ")
                    update_w = p.detach().double() - before[w][name].double()
                    update_1 = q.detach().double() - before[1][global_name].double()
                    # An expert no token reached has a zero update: comparing zeros would be vacuous,
                    # and the "after the step" comparison below asserts that it stayed where it was.
                    if update_1.any():
                        update_tol = _update_tolerance(before[1][global_name]) if opts.tolerance == "strict" else tol
                        out.append(compare(f"{tag}: {label} update applied by the step (-lr x reduced grad)",
                                           update_w, update_1, update_tol, asserted=asserted, world_size=w))
                    # the module's own parameter: ZeRO 1/2 copy the updated partitions back into it
                    out.append(compare(f"{tag}: {label} after the step", p, q, tol, asserted=asserted,
                                       world_size=w))
            for engine in engines.values():
                engine.destroy() if hasattr(engine, "destroy") else None
    for c in out:
        c.rank = r
    return out


register(Check(
    name="deepspeed-engine-ep", order=130, seed_source="DeepSpeed tests/unit/moe TestExpertWeightGradWithZero",
    description="DeepSpeed MoE through deepspeed.initialize, ZeRO 0/1/2, ep_size = W vs 1, SGD: loss, applied "
                "updates (= reduced grads), parameters each step",
    catches="a DeepSpeed engine (ZeRO 0-2) that reduces expert grads over the wrong group or scale, "
            "or mis-updates weights",
    rank_fn=_rank, min_world_size=2, requires=("deepspeed",), preload=("deepspeed", "deepspeed.moe.layer"),
))

"""Check `loss-curve`: the MoE block trained STEPS steps at ep = W and at ep = 1; equal loss curves.

torchtitan's `loss_compare.py --assert-equal` idea, for both variants:
- fastmoe: the fastmoe-style layer (FMoEReference, --impl moe / moe-sync apply) with
  EXPERTS_PER_RANK experts per rank, gradients synchronised by `sync_gradients`, vs the same
  layer holding every expert on one process, trained on the global batch.
- DeepSpeed: DeepSpeed's MoE (adapter models/deepspeed_moe.py) at ep_size = W vs ep_size = 1 (every
  rank's batch through the whole layer, one batch at a time, as `deepspeed-moe-ep`); replicated
  gradients summed over ranks, expert gradients as DeepSpeed's all-to-all backward leaves them.
Plain SGD, no re-synchronisation between steps: the curves are compared as trained, step by step
(global loss: the mean over ranks of the rank losses), strictly; and the weights at the end.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from moebench.parity.compare import SEED_ALLCLOSE_DEFAULT, STRICT, compare, pick
from moebench.parity.registry import Check, CheckOptions, SkipCheck, impl_or_default, register

STEPS = 6
LR = 0.2
D_MODEL = 8
D_HIDDEN = 16
TOKENS_PER_RANK = 16
EXPERTS_PER_RANK = 2


def _batch(seed: int, step: int, rank: int, shape) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 10_000 + 7_000 + step * 100 + rank)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def _fastmoe(ctx, opts: CheckOptions, tol, asserted) -> list:
    from moebench.distributed import expert_parallel
    from moebench.models.moe.layer import FMoEReference

    layer_cls, label = impl_or_default(opts, "moe", FMoEReference)
    sync, _ = impl_or_default(opts, "moe-sync", expert_parallel.sync_gradients)
    r, w = ctx.rank, ctx.world_size
    experts = EXPERTS_PER_RANK * w
    torch.manual_seed(opts.seed)
    whole = layer_cls(num_expert=experts, d_model=D_MODEL, d_hidden=D_HIDDEN, top_k=2, world_size=1)
    local = layer_cls(num_expert=EXPERTS_PER_RANK, d_model=D_MODEL, d_hidden=D_HIDDEN, top_k=2, world_size=w)
    local.load_state_dict(expert_parallel.shard_state_dict(whole.state_dict(), r, EXPERTS_PER_RANK))
    curve, ref_curve = [], []
    for step in range(STEPS):
        xs = [_batch(opts.seed, step, s, (TOKENS_PER_RANK, D_MODEL)) for s in range(w)]
        x, wt = xs[r]
        y = local(x)
        y = y[0] if isinstance(y, tuple) else y
        loss = (y * wt).mean()
        loss.backward()
        sync(local)
        total = loss.detach().clone()
        dist.all_reduce(total)
        curve.append(float(total) / w)
        x_all, w_all = torch.cat([a for a, _ in xs]), torch.cat([b for _, b in xs])
        y_ref = whole(x_all)
        y_ref = y_ref[0] if isinstance(y_ref, tuple) else y_ref
        ref_loss = (y_ref * w_all).mean()
        ref_loss.backward()
        ref_curve.append(float(ref_loss.detach()))
        with torch.no_grad():
            for p in list(local.parameters()) + list(whole.parameters()):
                if p.grad is not None:
                    p -= LR * p.grad
                p.grad = None
    out = [compare(f"fastmoe: loss curve, ep {w} vs ep 1 ({STEPS} steps)", torch.tensor(curve),
                   torch.tensor(ref_curve), tol, asserted=asserted, world_size=w, note=f"layer {label}")]
    ref = expert_parallel.shard_state_dict(whole.state_dict(), r, EXPERTS_PER_RANK)
    for name, p in local.state_dict().items():
        out.append(compare(f"fastmoe: {name} after {STEPS} steps", p, ref[name], tol, asserted=asserted,
                           world_size=w))
    return out


def _deepspeed(ctx, opts: CheckOptions, tol, asserted) -> list:
    from moebench.parity.checks_deepspeed import build_layer, group_timeout_s, new_groups_time_out_after
    from moebench.variants.deepspeed.comm import deepspeed_comm
    from moebench.variants.deepspeed.config import DeepSpeedMoEConfig

    r, w = ctx.rank, ctx.world_size
    experts = EXPERTS_PER_RANK * w
    shape = (2, TOKENS_PER_RANK // 2, 16)
    with new_groups_time_out_after(group_timeout_s(opts.timeout_s)), \
            deepspeed_comm(ctx, compiled_ops=False, timeout_s=opts.timeout_s):
        moe = DeepSpeedMoEConfig(experts=(experts,), d_hidden=32, capacity_factor=1.0, eval_capacity_factor=1.0,
                                 min_capacity=0, noisy_gate_policy="none", drop_tokens=False, use_rts=False,
                                 ep_size=1, top_k=2, use_residual=False)
        sharded = build_layer(dataclasses.replace(moe, ep_size=w), experts=experts, seed=opts.seed, ep_rank=r)
        whole = build_layer(moe, experts=experts, seed=opts.seed, ep_rank=0)
        curve, ref_curve = [], []
        for step in range(STEPS):
            xs = [_batch(opts.seed, step, s, shape) for s in range(w)]
            y, l_aux = sharded(xs[r][0])
            loss = (y * xs[r][1]).mean() + 0.01 * l_aux
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            curve.append(float(total) / w)
            ref_total = 0.0
            for s in range(w):
                ys, aux_s = whole(xs[s][0])
                ref_total = ref_total + (ys * xs[s][1]).mean() + 0.01 * aux_s
            (ref_total / w).backward()
            ref_curve.append(float(ref_total.detach()) / w)
            with torch.no_grad():
                for name, p in sharded.named_parameters():
                    if p.grad is None:
                        continue
                    if ".deepspeed_experts." not in name:
                        dist.all_reduce(p.grad)  # replicated: the sum over ranks of d(loss_r)
                    p -= LR / w * p.grad  # experts: the all-to-all backward already summed every rank's tokens
                    p.grad = None
                for p in whole.parameters():
                    if p.grad is not None:
                        p -= LR * p.grad
                    p.grad = None
    return [compare(f"deepspeed: loss curve, ep {w} vs ep 1 ({STEPS} steps)", torch.tensor(curve),
                    torch.tensor(ref_curve), tol, asserted=asserted, world_size=w)]


def _rank(ctx, opts: CheckOptions) -> list:
    try:
        from moebench.models.moe.layer import FMoEReference  # noqa: F401
    except ImportError as exc:
        raise SkipCheck(f"the fastmoe-style layer is not available: {exc}") from None
    tol, asserted = pick(opts.tolerance, strict=STRICT, seed=SEED_ALLCLOSE_DEFAULT)
    out = _fastmoe(ctx, opts, tol, asserted)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return out
    if not opts.impls:  # --impl replaces the fastmoe layer / sync only
        out += _deepspeed(ctx, opts, tol, asserted)
    for c in out:
        c.rank = ctx.rank
    return out


register(Check(
    name="loss-curve", order=120, seed_source="torchtitan loss_compare.py --assert-equal",
    description=f"fastmoe and DeepSpeed MoE trained {STEPS} SGD steps at ep = W and ep = 1: equal loss curves "
                "(and fastmoe's weights at the end)",
    catches=f"ep = W training (fastmoe, DeepSpeed) whose loss drifts from ep = 1 over {STEPS} SGD steps, "
            "e.g. a mis-scaled sync",
    rank_fn=_rank, impl_keys=("moe", "moe-sync"), preload=("deepspeed", "deepspeed.moe.layer"),
))

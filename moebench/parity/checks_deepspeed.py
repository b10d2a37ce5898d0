"""Check 10 `deepspeed-moe-ep`: DeepSpeed's MoE layer with ep_size = world vs ep_size = 1.

Every rank builds the same layer twice through moebench's adapter (models/deepspeed_moe.py):
once expert-parallel (ep_size = W: rank r holds global experts r*n .. r*n+n-1, exchanged by
DeepSpeed's all-to-all) and once whole (ep_size = 1, all experts, no collective). Same weights:
the gate, residual MLP and coefficient come from the same seed, and every expert's weights are
seeded by its global index; the check asserts the placement exactly before comparing anything.

Gating is deterministic and drops nothing: drop_tokens=False, use_rts=False, no noisy gate, no
second-expert sampling. Each rank feeds its own tokens; the reference runs every rank's tokens
through the whole layer, one rank's batch at a time (capacity, l_aux and exp_counts are per batch).
Loss on rank r: sum(out_r * w_r) + AUX_WEIGHT * l_aux_r with fixed random w_r, so a gradient sent
to the wrong rank or expert cannot cancel out. Compared on every rank: output, l_aux, exp_counts,
the input gradient, every local expert's gradients (they already sum every rank's tokens), and the
gate / residual gradients summed over ranks (they are per-rank without an engine). Cases: top-1,
and top-2 with a residual expert.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime

import torch

from moebench.parity.compare import EXACT, SEED_DEEPSPEED, STRICT, assertion, compare, pick
from moebench.parity.registry import Check, CheckOptions, SkipCheck, register

D_MODEL = 16
D_HIDDEN = 32
TOKENS_PER_RANK = (2, 8)   # (batch, seq) on every rank
EXPERTS_PER_RANK = 2       # experts = EXPERTS_PER_RANK x world size
AUX_WEIGHT = 0.5           # large, so a wrong l_aux gradient is visible

CASES = (
    ("top-1", dict(top_k=1, use_residual=False)),
    ("top-2 + residual", dict(top_k=2, use_residual=True)),
)


def group_timeout_s(deadline_s: float) -> float:
    """Timeout of the process groups this check creates: launch's fraction of the check's deadline."""
    from moebench.distributed.launch import PG_TIMEOUT_FRACTION

    return max(1.0, deadline_s * PG_TIMEOUT_FRACTION)


@contextlib.contextmanager
def new_groups_time_out_after(seconds: float):
    """DeepSpeed's `dist.new_group(ranks)` passes no timeout, so torch gives its expert groups the
    30-minute default: a stuck all-to-all would outlive the deadline silently. Inside, new groups
    get `seconds` instead (and raise, naming the collective, before the deadline)."""
    from torch.distributed import distributed_c10d as c10d

    names = [n for n in ("default_pg_timeout", "default_pg_nccl_timeout")
             if isinstance(getattr(c10d, n, None), datetime.timedelta)]
    saved = {n: getattr(c10d, n) for n in names}
    for n in names:
        setattr(c10d, n, datetime.timedelta(seconds=seconds))
    try:
        yield
    finally:
        for n, value in saved.items():
            setattr(c10d, n, value)


def build_layer(moe, *, experts: int, seed: int, ep_rank: int):
    """One adapter layer; expert j on this rank is global expert ep_rank * n + j."""
    from moebench.models.deepspeed_moe import DeepSpeedMoEMLP, create_expert_groups

    torch.manual_seed(seed)  # gate / residual / coefficient: same on every rank and both layers
    layer = DeepSpeedMoEMLP(moe, d_model=D_MODEL, experts=experts, seed=seed, ep_rank=ep_rank,
                            top2_2nd_expert_sampling=False)
    create_expert_groups(moe.ep_size)  # DeepSpeed's own expert groups (a collective), created quietly
    layer.moe.set_deepspeed_parallelism()
    return layer


def _inputs(seed: int, case: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000 + case * 100 + rank)
    shape = (*TOKENS_PER_RANK, D_MODEL)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _named_grads(module) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in module.named_parameters()}


def _rank(ctx, opts: CheckOptions) -> list:
    try:
        import deepspeed  # noqa: F401
    except ImportError as exc:
        raise SkipCheck(f"deepspeed is not importable: {exc}") from None
    import torch.distributed as dist

    from moebench.variants.deepspeed.comm import deepspeed_comm
    from moebench.variants.deepspeed.config import DeepSpeedMoEConfig

    tol, asserted = pick(opts.tolerance, strict=STRICT, seed=SEED_DEEPSPEED)
    world, rank = ctx.world_size, ctx.rank
    out: list = []
    # Every group opened here (deepspeed_comm's, DeepSpeed's expert groups) times out before the
    # check's deadline, at launch's PG_TIMEOUT_FRACTION of it.
    with new_groups_time_out_after(group_timeout_s(opts.timeout_s)), \
            deepspeed_comm(ctx, compiled_ops=False, timeout_s=opts.timeout_s):
        for case, (label, knobs) in enumerate(CASES):
            moe = DeepSpeedMoEConfig(experts=(EXPERTS_PER_RANK * world,), d_hidden=D_HIDDEN, capacity_factor=1.0,
                                     eval_capacity_factor=1.0, min_capacity=0, noisy_gate_policy="none",
                                     drop_tokens=False, use_rts=False, ep_size=1, **knobs)
            experts, seed = EXPERTS_PER_RANK * world, opts.seed + case
            sharded = build_layer(dataclasses.replace(moe, ep_size=world), experts=experts, seed=seed, ep_rank=rank)
            whole = build_layer(moe, experts=experts, seed=seed, ep_rank=0)
            n = sharded.num_local_experts
            for j, expert in enumerate(sharded.local_experts):
                g = rank * n + j
                same = all(torch.equal(a, b) for a, b in zip(expert.parameters(), whole.local_experts[g].parameters()))
                out.append(assertion(f"{label}: local expert {j} holds global expert {g}'s weights", same,
                                     rank=rank, note="placement: expert g on rank g // num_local_experts"))
            weights = [torch.randn(*TOKENS_PER_RANK, D_MODEL, generator=torch.Generator().manual_seed(7 + r))
                       for r in range(world)]

            # Expert parallel: this rank's tokens only.
            x, _ = _inputs(opts.seed, case, rank)
            x = x.requires_grad_()
            y, l_aux = sharded(x)
            counts = sharded.last.exp_counts.clone()
            ((y * weights[rank]).sum() + AUX_WEIGHT * l_aux).backward()

            # Reference: every rank's tokens through the whole layer, one rank's batch at a time.
            ref_x, ref_y, ref_aux, ref_counts = [], [], [], []
            total = 0.0
            for r in range(world):
                xr = _inputs(opts.seed, case, r)[0].requires_grad_()
                yr, aux_r = whole(xr)
                ref_x.append(xr), ref_y.append(yr), ref_aux.append(aux_r)
                ref_counts.append(whole.last.exp_counts.clone())
                total = total + (yr * weights[r]).sum() + AUX_WEIGHT * aux_r
            total.backward()

            out.append(compare(f"{label}: output", y, ref_y[rank], tol, rank=rank, asserted=asserted))
            out.append(compare(f"{label}: l_aux", l_aux, ref_aux[rank], tol, rank=rank, asserted=asserted))
            out.append(compare(f"{label}: exp_counts", counts, ref_counts[rank], EXACT, rank=rank))
            out.append(compare(f"{label}: input grad", x.grad, ref_x[rank].grad, tol, rank=rank, asserted=asserted))
            ref_experts = [_named_grads(e) for e in whole.local_experts]
            for j, expert in enumerate(sharded.local_experts):
                ref = ref_experts[rank * n + j]
                for name, grad in _named_grads(expert).items():
                    out.append(compare(f"{label}: expert {rank * n + j} {name} grad", grad, ref[name], tol,
                                       rank=rank, asserted=asserted))
            # Gate / residual / coefficient are replicated: their per-rank gradients sum to the reference's.
            shared = {n: g for n, g in _named_grads(sharded).items() if ".deepspeed_experts." not in n}
            ref_shared = _named_grads(whole)
            for name, grad in shared.items():
                summed = grad.clone()
                dist.all_reduce(summed)
                out.append(compare(f"{label}: {name} grad (sum over ranks)", summed, ref_shared[name], tol,
                                   rank=rank, asserted=asserted))
    return out


register(Check(
    name="deepspeed-moe-ep",
    order=100,
    seed_source="DeepSpeed tests/unit/moe (ep_size vs one process)",
    description="DeepSpeed MoE, ep_size = world vs ep_size = 1: outputs, l_aux, exp_counts, input/gate/expert grads",
    catches="DeepSpeed ep_size = W that misplaces experts, misroutes tokens or their grads, "
            "or changes l_aux/exp_counts",
    rank_fn=_rank,
    min_world_size=2,
    requires=("deepspeed",),
    preload=("deepspeed", "deepspeed.moe.layer"),
))

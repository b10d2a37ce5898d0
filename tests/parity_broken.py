"""Deliberately broken implementations fed to `verify-parity --impl` by the tests.

Each one has a single, realistic bug; every check must FAIL on the ones aimed at it. Importable
as `parity_broken` (tests/ is on sys.path under pytest; subprocess tests set PYTHONPATH).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from moebench.distributed import collectives
from moebench.distributed.collectives import all_gather_variable
from moebench.parity.experts import Experts, rank_share

# ------------------------------------------------------------------ all-gather


class _LocalSliceBackward(torch.autograd.Function):
    """st-moe-pytorch's bug: backward returns this rank's slice of ITS OWN gradient only."""

    @staticmethod
    def forward(ctx, t, dim, sizes):
        ctx.dim, ctx.sizes = dim, sizes
        return collectives._gather_padded(t, sizes, dim, None)

    @staticmethod
    def backward(ctx, grad):
        return grad.split(ctx.sizes, dim=ctx.dim)[dist.get_rank()], None, None


def local_slice_all_gather(t, dim=0, sizes=None):
    dim = dim % t.ndim
    if sizes is None:
        sizes = collectives.gather_sizes(t, dim=dim)
    sizes = [int(s) for s in torch.as_tensor(sizes).tolist()]
    return _LocalSliceBackward.apply(t, dim, sizes), torch.tensor(sizes)


def reversed_order_all_gather(t, dim=0, sizes=None):
    """Forward bug: blocks concatenated in reverse rank order."""
    gathered, sizes = all_gather_variable(t, dim=dim, sizes=sizes)
    sizes_list = [int(s) for s in sizes.tolist()]
    return torch.cat(list(reversed(gathered.split(sizes_list, dim=dim))), dim=dim), sizes


def raising_all_gather(t, dim=0, sizes=None):
    """Rank 1 raises; the others would wait in the collective."""
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    return all_gather_variable(t, dim=dim, sizes=sizes)


def hanging_all_gather(t, dim=0, sizes=None):
    """Rank 1 never returns (pure Python sleep); the others block in the collective."""
    if dist.get_rank() == 1:
        time.sleep(3600)
    return all_gather_variable(t, dim=dim, sizes=sizes)


def hang_everywhere_all_gather(t, dim=0, sizes=None):
    """Every rank sleeps: for the Ctrl-C test (nothing ends on its own)."""
    with open(os.environ.get("PARITY_BROKEN_READY", os.devnull), "a") as f:
        f.write(f"{dist.get_rank()}\n")
    time.sleep(3600)


def nan_all_gather(t, dim=0, sizes=None):
    """Correct rows, but a NaN slipped into the output."""
    gathered, sizes = all_gather_variable(t, dim=dim, sizes=sizes)
    return gathered * torch.where(torch.arange(gathered.numel()).view_as(gathered) == 0,
                                  torch.tensor(float("nan")), torch.tensor(1.0)), sizes


# ------------------------------------------------------------------ experts


class OffByOneExperts(Experts):
    """Expert split off by one: each rank runs the experts one place after its own (same number
    of experts and rows, so every size still matches and only the numbers are wrong)."""

    def share(self, rank, world_size, batch):
        experts, rows = rank_share(rank, world_size, self.num_experts, batch)
        return [(e + 1) % self.num_experts for e in experts], rows


class LocalSliceExperts(Experts):
    """Correct routing, but both gathers use the local-slice backward."""

    all_gather = staticmethod(local_slice_all_gather)


class NoBiasExperts(Experts):
    """Single-process and distributed paths both skip the last layer's bias."""

    def forward(self, x, is_distributed=None):
        out = super().forward(x, is_distributed)
        return out - torch.stack([e[-1].bias for e in self.experts])[None, :, None, :]


class DetachedIdleRankExperts(Experts):
    """The idle rank's empty output piece is cut off from the graph: its backward skips the
    gathers' collectives and every other rank waits in them (a deadlock, bounded by the timeout)."""

    def forward(self, x, is_distributed=None):
        self.idle_piece = lambda gathered: gathered.detach()[:0, 0]
        return super().forward(x, is_distributed)


class LocalOnlyExperts(Experts):
    """Never communicates: every rank runs every expert on its own samples. The numbers are right
    (each sample meets the expert of its slot either way) but nothing was sharded."""

    def forward(self, x, is_distributed=None):
        return super().forward(x, is_distributed=False)


class RaisingExperts(Experts):
    def forward(self, x, is_distributed=None):
        if dist.is_initialized() and dist.get_rank() == 1 and is_distributed is not False:
            raise RuntimeError("deliberate failure inside rank 1's forward")
        return super().forward(x, is_distributed)


# ------------------------------------------------------------------ DDP wrappers


class _HookedDDP(nn.Module):
    """A hand-rolled data-parallel wrapper whose gradient hook (or missing broadcast) is the bug."""

    def __init__(self, module: nn.Module, reduce, broadcast: bool = True) -> None:
        super().__init__()
        self.module = module
        for p in module.parameters():
            if broadcast:
                dist.broadcast(p.data, 0)
        for name, p in module.named_parameters():
            p.register_hook(lambda g, name=name: reduce(name, g))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _summed(name, g):
    g = g.clone()
    dist.all_reduce(g)
    return g


def _averaged_but_bias(name, g):
    if name.endswith("bias"):
        return g  # the dropped bias: never synchronised
    g = g.clone()
    dist.all_reduce(g)
    return g / dist.get_world_size()


def not_averaged_ddp(module):
    """Gradients summed over ranks, never divided by the world size."""
    return _HookedDDP(module, _summed)


def no_sync_ddp(module):
    """No gradient communication at all: every rank trains on its own data."""
    return _HookedDDP(module, lambda name, g: g)


def _averaged(name, g):
    g = g.clone()
    dist.all_reduce(g)
    return g / dist.get_world_size()


def no_broadcast_ddp(module):
    """Gradients averaged correctly, but rank 0's parameters never broadcast at construction."""
    return _HookedDDP(module, _averaged, broadcast=False)


def dropped_bias_ddp(module):
    """Weights averaged, biases left rank-local."""
    return _HookedDDP(module, _averaged_but_bias)


# ------------------------------------------------------------------ replicate


def _real_replicate():
    from torch.distributed._composable.replicate import replicate

    return replicate


def noop_replicate(module, **kwargs):
    """Returns the module untouched: no gradient sync at all."""
    return module


def ddp_wrapping_replicate(module, **kwargs):
    """Wraps in DDP: state_dict keys gain a "module." prefix."""
    kwargs.pop("ignored_modules", None)
    return DistributedDataParallel(module, **kwargs)


def ignores_nothing_replicate(module, ignored_modules=None, **kwargs):
    """Drops ignored_modules: fc1 is synchronised too."""
    return _real_replicate()(module, **kwargs)


def lenient_device_id_replicate(module, device_id=None, **kwargs):
    """Accepts any device_id silently."""
    return _real_replicate()(module, **kwargs)


# ------------------------------------------------------------------ fastmoe-style MoE layer


def unscaled_expert_sync(model):
    """fastmoe's DistributedGroupedDataParallel convention: expert gradients left summed (ep_size x)."""
    from moebench.distributed.expert_parallel import sync_gradients

    sync_gradients(model, scale_expert_grads=False)


def no_moe_sync(model):
    """Nothing synchronised: the gate trains on each rank's tokens only."""


def _fmoe():
    from moebench.models.moe.layer import FMoEReference

    return FMoEReference


class SwappedLocalExpertsMoE(_fmoe()):
    """Off by one in the local expert index: slots for local expert i run through expert i+1."""

    def run_experts(self, expert_in, tokens_per_local_expert):
        experts = list(self.experts)
        rotated = experts[1:] + experts[:1]
        chunks = expert_in.split(tokens_per_local_expert)
        return torch.cat([e(c) for e, c in zip(rotated, chunks)], dim=0)


class DroppedBiasMoE(_fmoe()):
    """The experts' output bias is never added."""

    def run_experts(self, expert_in, tokens_per_local_expert):
        chunks = expert_in.split(tokens_per_local_expert)
        outs = [e(c) - e.h4toh.bias[0] for e, c in zip(self.experts, chunks)]
        return torch.cat(outs, dim=0)


def no_autograd_all_gather(t, dim=0, sizes=None):
    """Right rows, but a plain collective: no gradient can flow back to the input."""
    with torch.no_grad():
        return all_gather_variable(t, dim=dim, sizes=sizes)


def debug_env_probe_all_gather(t, dim=0, sizes=None):
    """Correct, but refuses to run unless torch.distributed itself runs at debug level DETAIL in
    this rank (the environment variable alone does nothing: torch reads it at import)."""
    if dist.get_debug_level() != dist.DebugLevel.DETAIL:
        raise RuntimeError(f"torch.distributed debug level is {dist.get_debug_level()} in this rank, not DETAIL")
    return all_gather_variable(t, dim=dim, sizes=sizes)


def st_moe_all_gather_function(t, dim=0, sizes=None):
    """The adapter for st-moe-pytorch's autograd AllGatherFunction (needs st-moe-pytorch)."""
    from st_moe_pytorch.distributed import AllGatherFunction

    gathered, sizes = AllGatherFunction.apply(t, dim % t.ndim, sizes)
    return gathered, sizes


# ------------------------------------------------------------------ for the diagnoses


def detached_all_gather(t, dim=0, sizes=None):
    """Right rows, still differentiable, but cut from the input: every input gradient is zero."""
    gathered, sizes = all_gather_variable(t.detach(), dim=dim, sizes=sizes)
    return gathered + 0.0 * t.sum(), sizes


def one_rank_summed_sync(model):
    """Correct everywhere but on rank 1, whose expert gradients are left summed (world size x)."""
    from moebench.distributed.expert_parallel import sync_gradients

    sync_gradients(model)
    if dist.get_rank() == 1:
        for name, p in model.named_parameters():
            if name.startswith("experts.") and p.grad is not None:
                p.grad.mul_(dist.get_world_size())


def averaged_twice_sync(model):
    """Expert gradients divided by the ep size once too often."""
    from moebench.distributed.expert_parallel import sync_gradients

    sync_gradients(model)
    for name, p in model.named_parameters():
        if name.startswith("experts.") and p.grad is not None:
            p.grad.div_(dist.get_world_size())


# ------------------------------------------------------------------ gates (routing-invariants)


def _switch_gate():
    from moebench.models.moe.gates import SwitchGate

    return SwitchGate


class NoDivisionSwitchGate(_switch_gate()):
    """fastmoe #199: the Switch gate's capacity lacks the `/ num_expert` (each expert may keep N slots)."""

    def forward(self, inp):
        import math as _math

        from moebench.models.moe import gates

        real = _math.ceil
        try:  # capacity = ceil(rate * N / num_expert) computed with num_expert forced to 1
            gates.math = type("m", (), {"ceil": staticmethod(lambda v: real(v * self.num_expert))})
            return super().forward(inp)
        finally:
            gates.math = _math


class IgnoresCapacitySwitchGate(_switch_gate()):
    """DeepSpeed #1658's shape: top-1 routing that never drops (capacity ignored)."""

    def forward(self, inp):
        from moebench.models.moe import gates

        real = gates.limit_by_capacity
        gates.limit_by_capacity = lambda idx, *a, **k: idx
        try:
            return super().forward(inp)
        finally:
            gates.limit_by_capacity = real


# ------------------------------------------------------------------ expert-parallel exchange / sync bugs


class _ZeroBackwardAllToAll(torch.autograd.Function):
    """The forward exchange, and a backward that sends nothing back: zeros (keep_self=False), or
    only the slots this rank exchanged with itself (keep_self=True: the local part survives)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, keep_self):
        ctx.splits, ctx.group, ctx.keep_self = (out_splits, in_splits), group, keep_self
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        out_splits, in_splits = ctx.splits
        grad_in = grad_out.new_zeros((sum(in_splits), *grad_out.shape[1:]))
        if ctx.keep_self:
            r = dist.get_rank(ctx.group)
            src, dst = sum(out_splits[:r]), sum(in_splits[:r])
            grad_in[dst:dst + in_splits[r]] = grad_out[src:src + out_splits[r]]
        return grad_in, None, None, None, None


def _patched_exchange_moe(keep_self: bool):
    class _MoE(_fmoe()):
        def moe_forward(self, x, topk_idx, topk_score):
            from moebench.distributed import expert_parallel

            real = expert_parallel.all_to_all
            expert_parallel.all_to_all = lambda t, o, i, g=None: _ZeroBackwardAllToAll.apply(t, o, i, g, keep_self)
            try:
                return super().moe_forward(x, topk_idx, topk_score)
            finally:
                expert_parallel.all_to_all = real

    return _MoE


NoBackwardExchangeMoE = _patched_exchange_moe(keep_self=False)
NoBackwardExchangeMoE.__doc__ = "The slots' all-to-all has no backward exchange: its backward returns zeros."
LocalOnlyBackwardMoE = _patched_exchange_moe(keep_self=True)
LocalOnlyBackwardMoE.__doc__ = ("The backward all-to-all keeps the slots a rank exchanged with itself and "
                                "drops every other rank's: gradients come back from local experts only.")


def gate_rank_local_sync(model):
    """Expert gradients right (divided by the ep size), the gate's never all-reduced: each rank keeps
    the gradient of its own tokens (the router-gradient bug class)."""
    from moebench.distributed.expert_parallel import sync_gradients

    kept = {n: p.grad.clone() for n, p in model.named_parameters() if n.startswith("gate.") and p.grad is not None}
    sync_gradients(model)
    for n, p in model.named_parameters():
        if n in kept:
            p.grad.copy_(kept[n])


class UnroutedSlotsRouterGradMoE(_fmoe()):
    """The router gradient collects gradient from slots this rank never routed: each slot whose expert
    lives on another rank also runs here through this rank's LAST local expert (transformers' sentinel
    slot, clamped in-bounds by its batched_mm experts) with its score zeroed in the forward only (a
    straight-through zero: the value is 0, the gradient of the score passes). Outputs, the experts' and
    the input's expert-path gradients stay right; the gate gets <output grad, that expert's output>."""

    def moe_forward(self, x, topk_idx, topk_score):
        y = super().moe_forward(x, topk_idx, topk_score)
        rank = dist.get_rank(self.group) if self.world_size > 1 else 0
        off_rank = (topk_idx // self.num_expert) != rank
        zero_in_forward_only = (topk_score - topk_score.detach()) * off_rank
        return y + zero_in_forward_only.sum(dim=-1, keepdim=True) * self.experts[-1](x)

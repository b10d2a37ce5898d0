"""Faults injected into DeepSpeed's OWN objects (never its installed files) that the AutoEP rows must catch and
name: `FAULTS[name](set_attr)` patches the current process (pytest's monkeypatch.setattr in-process; plain setattr
through tests/faults/inject/sitecustomize.py in a subprocess). Ranks forked afterwards inherit the patch.

- per-rank-clip-norm: the global norm gradient clipping uses is each rank's own (ZeRO 0: its own parameters,
  never combined; ZeRO 1/2: its own partition) - ds_faults' local-global-norm, here on the AutoEP engine;
- expert-grads-summed: the expert gradients are summed over the data-parallel ranks instead of averaged (ZeRO 0:
  the engine's expert all-reduce left undivided; ZeRO 1/2: each expert gradient enters the reduction bucket x dp);
- router-detached: AutoEP's router returns its routing weights detached from the graph (the forward is the same,
  the router gets no gradient), as a non-differentiable gather of the routing weights would.
"""

from __future__ import annotations

from typing import Callable

import ds_faults


def expert_grads_summed(set_attr: Callable) -> None:
    import deepspeed.comm as dist
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import groups

    reduce_experts = DeepSpeedEngine._reduce_expert_gradients

    def summed(self, expert_grads, elements_per_buffer):  # ZeRO 0: the all-reduce, then undo its division by dp
        reduce_experts(self, expert_grads, elements_per_buffer)
        dp = dist.get_world_size(groups._get_data_parallel_group())
        for grads in expert_grads.values():
            for g in grads:
                g.mul_(dp)

    set_attr(DeepSpeedEngine, "_reduce_expert_gradients", summed)
    zero = ds_faults._zero_optimizer()
    reduce_bucket = zero.reduce_independent_p_g_buckets_and_remove_grads

    def bucket(self, param, i):  # ZeRO 1/2: the bucket is divided by dp, so enter it x dp
        if is_moe_param(param):
            grad = self.get_gradient_for_reduction(param)
            if grad is not None:
                grad.mul_(dist.get_world_size(group=self.dp_process_group))
        return reduce_bucket(self, param, i)

    set_attr(zero, "reduce_independent_p_g_buckets_and_remove_grads", bucket)


def router_detached(set_attr: Callable) -> None:
    from deepspeed.moe.ep_router import TokenChoiceTopKRouter

    route = TokenChoiceTopKRouter.forward

    def forward(self, *args, **kwargs):
        top_scores, *rest = route(self, *args, **kwargs)
        return (top_scores.detach(), *rest)

    set_attr(TokenChoiceTopKRouter, "forward", forward)


FAULTS: dict[str, Callable[[Callable], None]] = {
    "per-rank-clip-norm": ds_faults.local_global_norm,
    "expert-grads-summed": expert_grads_summed,
    "router-detached": router_detached,
}

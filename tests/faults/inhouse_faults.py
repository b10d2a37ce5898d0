"""Faults for the worked example's in-house layer (tests/examples/inhouse_moe), each breaking its gradient sync as
a real bug would: FAULTS[name](set_attr) patches `inhouse_moe.layer.sync_gradients`.

- expert-grads-summed: the expert gradients are not divided by W (summed over the ranks' losses, not averaged);
- router-not-reduced: the router's gradient is never all-reduced (each rank keeps its own tokens' share).
"""

from __future__ import annotations

from typing import Callable


def _expert_grads_summed(set_attr: Callable) -> None:
    import torch.distributed as dist
    from inhouse_moe import layer

    def sync(mine) -> None:
        for p in mine.router.parameters():
            dist.all_reduce(p.grad)
            p.grad /= mine.world_size

    set_attr(layer, "sync_gradients", sync)


def _router_not_reduced(set_attr: Callable) -> None:
    from inhouse_moe import layer

    def sync(mine) -> None:
        for p in mine.parameters():
            if p.grad is not None:
                p.grad /= mine.world_size

    set_attr(layer, "sync_gradients", sync)


FAULTS = {"expert-grads-summed": _expert_grads_summed, "router-not-reduced": _router_not_reduced}

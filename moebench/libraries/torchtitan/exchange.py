"""The one bridge torchtitan 0.3's default backend needs on CPU, installed in the ranks only.

`spmd_backend="spmd_types"` (0.3's default) exchanges the routed tokens with spmd_types' uneven all_to_all, which
calls `torch.distributed.all_to_all` with a list of chunks of different sizes; gloo refuses that
(`ProcessGroupGloo::alltoall: invalid tensor size`). spmd_types has a hook for its collectives' implementation
(`spmd_types._dist.set_dist`): in each rank of a spmd_types row moebench sets one whose `all_to_all` pads every chunk
to the largest chunk of the exchange (agreed over the group first, so every rank sends and receives the same sizes),
exchanges, and keeps each received chunk's own rows. The result is the uneven exchange's, element for element;
everything else is torch.distributed itself. Every such row records it (`PATCH`).
"""

from __future__ import annotations

PATCH = ("spmd_types' uneven list all_to_all padded to the largest chunk for gloo (same rows exchanged; "
         "spmd_types._dist.set_dist)")
"""What a spmd_types row records it bridged."""


class PaddedAllToAll:
    """torch.distributed as spmd_types sees it in a rank: `all_to_all` of uneven chunks as a padded exchange."""

    def __init__(self, dist_module) -> None:
        self._dist = dist_module

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def all_to_all(self, output_tensor_list, input_tensor_list, group=None, async_op=False):
        import torch

        if async_op:
            raise RuntimeError("moebench's padded all_to_all (torchtitan's spmd_types rows on gloo) is synchronous")
        chunks = [*output_tensor_list, *input_tensor_list]
        largest = torch.tensor([max((c.shape[0] for c in chunks), default=0)], dtype=torch.int64)
        self._dist.all_reduce(largest, op=self._dist.ReduceOp.MAX, group=group)  # every rank pads alike
        rows = int(largest)

        def padded(c):
            return torch.cat([c.contiguous(), c.new_zeros((rows - c.shape[0], *c.shape[1:]))]) if c.shape[0] < rows \
                else c.contiguous()

        received = [c.new_empty((rows, *c.shape[1:])) for c in output_tensor_list]
        self._dist.all_to_all(received, [padded(c) for c in input_tensor_list], group=group)
        for out, got in zip(output_tensor_list, received):
            out.copy_(got[: out.shape[0]])
        return None


def bridge() -> None:
    """Set the padded exchange as spmd_types' collectives implementation (in a rank; the parent never calls this)."""
    import torch.distributed as dist
    from spmd_types import _dist

    if not isinstance(_dist.dist, PaddedAllToAll):
        _dist.set_dist(PaddedAllToAll(dist))

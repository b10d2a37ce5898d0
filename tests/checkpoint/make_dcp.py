"""Real DCP checkpoints of a small MoE layer, saved by two gloo ranks (run as a script: `python make_dcp.py OUT`).

Every folder is torch.distributed.checkpoint's own save, after one real Adam step, of the state dicts
`get_state_dict(model, optimizer)` gives (model keys `model.*`, optimizer state `optim.state.*`):
- sound/      the expert stacks as DTensors sharded over the experts (Shard(0)): 4 experts, 2 a rank;
- local/      the same experts as plain local tensors (each rank's 2): DCP keeps one rank's as a replica
              (pytorch/pytorch#120356's class): 2 of the 4 experts are in the checkpoint;
- replica/    DTensors, but rank 1's shard holds a copy of rank 0's experts (one rank's copy written for both);
- strided/    DTensors whose shards hold experts 0, 2 (rank 0) and 1, 3 (rank 1): the strided order.
Experts are seeded by global index, so every folder holds the same experts, in its own arrangement.
"""

from __future__ import annotations

import os

EXPERTS, D_MODEL, D_HIDDEN = 4, 8, 16


def expert_values():
    import torch

    g = torch.Generator().manual_seed(1234)
    w1 = torch.randn(EXPERTS, D_MODEL, D_HIDDEN, generator=g)
    w2 = torch.randn(EXPERTS, D_HIDDEN, D_MODEL, generator=g)
    router = torch.randn(EXPERTS, D_MODEL, generator=g)
    return w1, w2, router


def _model(kind: str, rank: int, mesh):
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    w1, w2, router = expert_values()
    order = {"sound": [0, 1, 2, 3], "local": [0, 1, 2, 3], "replica": [0, 1, 0, 1], "strided": [0, 2, 1, 3]}[kind]
    w1, w2 = w1[order], w2[order]
    layer = torch.nn.Module()
    layer.router = torch.nn.Module()
    layer.router.gate = torch.nn.Linear(D_MODEL, EXPERTS, bias=False)
    layer.router.gate.weight.data.copy_(router)
    layer.experts = torch.nn.Module()
    for name, full in (("w1", w1), ("w2", w2)):
        if kind == "local":
            value = full[2 * rank:2 * rank + 2].clone()
        else:
            value = distribute_tensor(full, mesh, [Shard(0)])
        setattr(layer.experts, name, torch.nn.Parameter(value))
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].moe = layer
    return model


def _rank(rank: int, out: str, store: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    for kind in ("sound", "local", "replica", "strided"):
        model = _model(kind, rank, mesh)
        if kind != "local":  # a DTensor's gradient: its full value is the same on both ranks
            router = model.layers[0].moe.router.gate
            router.weight.data = router.weight.data.clone()
        adam = torch.optim.Adam(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.ones_like(p) * 1e-2
        adam.step()
        model_sd, optim_sd = get_state_dict(model, adam)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(out, kind))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import two_ranks

    two_ranks.main(_rank)

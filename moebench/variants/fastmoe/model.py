"""The fastmoe Transformer-MoE: the shared block with fastmoe's MoE MLP, sharded over the ranks."""

from __future__ import annotations

import torch

from moebench.models.moe import build_moe_mlp
from moebench.models.transformer import build_transformer
from moebench.variants.fastmoe.config import FastMoERunConfig


def build_model(config: FastMoERunConfig, *, world_size: int = 1, group=None, device: str = "cpu"):
    """The Transformer-MoE holding `experts // world_size` experts per layer."""
    moe = config.moe

    def make_mlp(_layer: int):
        return build_moe_mlp(backend=moe.moe_impl, experts=moe.experts, d_model=config.model.d_model,
                             d_hidden=moe.d_hidden, top_k=moe.top_k, gate=moe.gate,
                             world_size=world_size, group=group, device=device)

    return build_transformer(layers=config.model.layers, d_model=config.model.d_model, heads=config.model.heads,
                             make_mlp=make_mlp).to(device)


def build_rank_model(config: FastMoERunConfig, rank: int, world_size: int, device: str):
    """Seeded one-process weights; on N ranks each keeps its experts (same weights as one process)."""
    from moebench.distributed import expert_parallel

    torch.manual_seed(config.train.seed)
    full = build_model(config, device=device)
    if world_size == 1:
        return full
    with torch.device("meta"):
        local = build_model(config, world_size=world_size, device="meta")
    local = local.to_empty(device=device)
    for block in local.layers:  # to_empty made new Parameters: restore the expert-parallel marks
        mark = getattr(block.mlp, "mark_parallel_comm", None)
        if mark is not None:
            mark()
    shard = expert_parallel.shard_state_dict(full.state_dict(), rank, config.moe.experts // world_size)
    local.load_state_dict(shard)
    return local

"""The DeepSpeed-MoE Transformer: the shared block with deepspeed.moe.layer.MoE as its MLP."""

from __future__ import annotations

import torch

from moebench.variants.deepspeed.config import DeepSpeedRunConfig


def build_model(config: DeepSpeedRunConfig, *, ep_rank: int = 0):
    from moebench.models.deepspeed_moe import DeepSpeedMoEMLP
    from moebench.models.transformer import build_transformer

    def make_mlp(layer: int):
        return DeepSpeedMoEMLP(config.moe, d_model=config.model.d_model, experts=config.experts_per_layer[layer],
                               layer_index=layer, seed=config.train.seed, ep_rank=ep_rank)

    torch.manual_seed(config.train.seed)  # same non-expert weights on every rank and every ep_size
    return build_transformer(layers=config.model.layers, d_model=config.model.d_model, heads=config.model.heads,
                             make_mlp=make_mlp)

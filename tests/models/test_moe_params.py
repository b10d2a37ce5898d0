"""count_params on the fastmoe Transformer-MoE equals the closed-form formula."""

from __future__ import annotations

import pytest
import torch
from helpers import fastmoe_config

from moebench.models.transformer import count_params
from moebench.variants.fastmoe.model import build_model


def closed_form(*, layers: int, d_model: int, d_hidden: int, experts: int) -> dict:
    """Per layer: experts E(2·d·h + h + d), NaiveGate d·E + E, attention 4d² + 4d, two LayerNorms 4d."""
    experts_n = experts * (2 * d_model * d_hidden + d_hidden + d_model)
    gate = d_model * experts + experts
    attention = 4 * d_model * d_model + 4 * d_model
    norm = 4 * d_model
    per_layer = experts_n + gate + attention + norm
    return {"total": layers * per_layer, "moe": layers * (experts_n + gate), "experts": layers * experts_n,
            "gate": layers * gate, "attention": layers * attention, "norm": layers * norm, "other": 0}


def _count(config, world_size: int = 1) -> dict:
    with torch.device("meta"):  # shapes only: the chapter's 273 M parameters cost no memory
        model = build_model(config, world_size=world_size, device="meta")
    counted = count_params(model, ep_size=world_size)
    return {**counted, "totals": {"other": 0, **counted["by_category"]}}


@pytest.mark.parametrize(
    "layers,d_model,d_hidden,experts,heads", [(1, 16, 24, 4, 2), (3, 32, 64, 8, 4), (2, 8, 8, 1, 1)]
)
def test_count_params_equals_the_closed_form(layers, d_model, d_hidden, experts, heads):
    config = fastmoe_config(layers=layers, d_model=d_model, d_hidden=d_hidden, experts=experts, heads=heads,
                            top_k=1)
    counted = _count(config)
    assert counted["totals"] == closed_form(layers=layers, d_model=d_model, d_hidden=d_hidden, experts=experts)
    assert [row["total"] for row in counted["per_layer"]] == [counted["totals"]["total"] // layers] * layers


def test_chapter_preset_moe_layer_is_268_6_million():
    config = fastmoe_config(layers=1, d_model=1024, d_hidden=4096, experts=32, heads=16)
    totals = _count(config)["totals"]
    assert totals == closed_form(layers=1, d_model=1024, d_hidden=4096, experts=32)
    assert round(totals["moe"] / 1e6, 1) == 268.6


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_shards_count_as_the_whole_model(world_size):
    config = fastmoe_config(layers=2, d_model=16, d_hidden=24, experts=8, heads=2, world_size=world_size)
    assert _count(config, world_size)["totals"] == _count(config)["totals"]

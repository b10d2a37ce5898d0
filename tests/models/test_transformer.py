"""The shared block and count_params by category."""

from __future__ import annotations

import torch
from torch import nn

from moebench.models.transformer import build_transformer, count_params


class _ToyMoE(nn.Module):
    """Two 'experts' and a gate, to exercise category counting and ep_size scaling."""

    def __init__(self, d):
        super().__init__()
        self.gate = nn.Linear(d, 2)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])

    def param_category(self, name):
        return "experts" if name.startswith("experts.") else "gate"

    def forward(self, x):
        return self.experts[0](x) + self.experts[1](x), x.new_tensor(0.5)


def test_counts_match_the_closed_form_and_scale_experts_only():
    d, heads, layers = 8, 2, 3
    model = build_transformer(layers=layers, d_model=d, heads=heads, make_mlp=lambda i: _ToyMoE(d))
    counts = count_params(model)
    attention = 4 * d * d + 4 * d  # in_proj (3 d x d + 3 d) + out_proj (d x d + d)
    norm = 2 * 2 * d  # two LayerNorms, weight + bias
    experts, gate = 2 * (d * d + d), d * 2 + 2
    cats = counts["by_category"]
    assert cats["attention"] == layers * attention
    assert cats["norm"] == layers * norm
    assert cats["experts"] == layers * experts and cats["gate"] == layers * gate
    assert cats["moe"] == layers * (experts + gate)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    scaled = count_params(model, ep_size=4)
    assert scaled["by_category"]["experts"] == 4 * cats["experts"]
    assert scaled["total"] == counts["total"] + 3 * cats["experts"]


def test_block_sums_aux_losses_and_keeps_shape():
    model = build_transformer(layers=2, d_model=8, heads=2, make_mlp=lambda i: _ToyMoE(8))
    y, aux = model(torch.randn(3, 5, 8))
    assert y.shape == (3, 5, 8)
    assert aux.item() == 1.0  # 0.5 from each of the two layers

"""The Transformer block both variants share, and `count_params` by category.

A block is pre-norm: x + Attn(LN(x)), then h + MLP(LN(h)). The MLP is whatever MoE layer the
variant plugs in (fastmoe-style reference, real fmoe, DeepSpeed's MoE). The MLP contract:
  forward(x: [batch, seq, d_model]) -> y  or  (y, aux_loss)
and optionally `param_category(local_name) -> str` naming the category of each of its parameters
("experts", "gate", "residual", ...). Categories beginning with "experts" hold expert-parallel
shards: on `ep_size` ranks each rank holds 1/ep_size of them.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def split_aux(out) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An MLP may return y or (y, aux_loss); normalise to (y, aux or None)."""
    if isinstance(out, tuple):
        return out[0], out[1]
    return out, None


class TransformerBlock(nn.Module):
    def __init__(self, *, d_model: int, heads: int, mlp: nn.Module, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model, eps=norm_eps)
        self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.mlp_norm = nn.LayerNorm(d_model, eps=norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        a = self.attn_norm(x)
        h = x + self.attn(a, a, a, need_weights=False)[0]
        y, aux = split_aux(self.mlp(self.mlp_norm(h)))
        return h + y, aux


class MoETransformer(nn.Module):
    """A stack of blocks; returns (output, summed aux loss of every MoE layer)."""

    def __init__(self, blocks: list[TransformerBlock]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        aux_total = x.new_zeros(())
        for layer in self.layers:
            x, aux = layer(x)
            if aux is not None:
                aux_total = aux_total + aux
        return x, aux_total


def build_transformer(*, layers: int, d_model: int, heads: int,
                      make_mlp: Callable[[int], nn.Module]) -> MoETransformer:
    """`make_mlp(layer_index)` builds each layer's MoE MLP (layers may differ: pyramid MoE)."""
    return MoETransformer([TransformerBlock(d_model=d_model, heads=heads, mlp=make_mlp(i)) for i in range(layers)])


_BLOCK_CATEGORIES = ("attention", "norm", "other")


def _category(block: TransformerBlock, local_name: str) -> str:
    if local_name.startswith("attn."):
        return "attention"
    if local_name.startswith(("attn_norm.", "mlp_norm.")):
        return "norm"
    if local_name.startswith("mlp."):
        inner = local_name[len("mlp."):]
        categorise = getattr(block.mlp, "param_category", None)
        return categorise(inner) if categorise else "mlp"
    return "other"


def count_params(model: MoETransformer, *, ep_size: int = 1) -> dict:
    """Parameter counts of the whole model as if on one process, by category and per layer.

    Counts every element of every parameter once (shared parameters once). Expert categories
    ("experts*") are this rank's shard times `ep_size`, so the totals are the global model's.
    "moe" is everything inside the MLP slot: experts + gate (+ residual MLP and its coefficient).
    """
    per_layer = []
    totals: dict[str, int] = {}
    seen: set[int] = set()
    for i, block in enumerate(model.layers):
        counts: dict[str, int] = {}
        for name, p in block.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            cat = _category(block, name)
            n = p.numel() * (ep_size if cat.startswith("experts") else 1)
            counts[cat] = counts.get(cat, 0) + n
        total = sum(counts.values())
        counts["moe"] = total - sum(counts.get(k, 0) for k in _BLOCK_CATEGORIES)
        counts["total"] = total
        per_layer.append({"layer": i, **counts})
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v
    for name, p in model.named_parameters():  # anything outside the blocks
        if id(p) not in seen:
            seen.add(id(p))
            totals["other"] = totals.get("other", 0) + p.numel()
            totals["total"] = totals.get("total", 0) + p.numel()
    return {"total": totals.get("total", 0), "by_category": totals, "per_layer": per_layer, "ep_size": ep_size}

"""The in-house layer's moebench adapter, written against moebench's public protocol alone.

    moebench verify-parity --adapter inhouse_moe.adapter:ADAPTER -n 2     (with tests/examples on PYTHONPATH)

One row per experts-per-rank choice (E = W and E = 2W): every rank builds the layer with its own experts, the
reference is the same layer on one process holding every expert (world_size 1), both from the same seeded weights
(expert e's weights drawn from seed + e, whichever rank holds it). Compared on every rank, for STEPS SGD steps:
the output, the input gradient, the router's gradient, every expert's gradient by its GLOBAL index
(moebench.parity.layout) and the weights after each step. A router gradient that matches this rank's tokens alone
is named rank-local (moebench.parity.diagnose.rank_local builds that known-wrong answer).
"""

from __future__ import annotations

import dataclasses

import torch

from moebench.libraries.spec import PARITY, Adapter, Row, Settings
from moebench.parity.compare import STRICT, compare
from moebench.parity.diagnose import rank_local
from moebench.parity.diagnosis import EXPERTS, INPUT_GRAD, OUTPUT, ROUTER
from moebench.parity.layout import ExpertLayout

D_MODEL, D_HIDDEN = 8, 16
TOKENS_PER_RANK = 32
STEPS = 2
LR = 0.5
PER_RANK = (1, 2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSettings(Settings):
    experts_per_rank: int


def _weights(layer, seed: int, layout: ExpertLayout, ep_rank: int) -> None:
    """The router from `seed`, each local expert from seed + its global index: every rank and the reference
    hold the same weights for the same expert."""
    torch.manual_seed(seed)
    torch.nn.init.normal_(layer.router.weight, std=0.5)
    for slot, module in enumerate(layer.experts):
        torch.manual_seed(seed + 1 + layout.global_expert(ep_rank, slot))
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.3)


def _batch(seed: int, step: int, world: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return (torch.randn(world, TOKENS_PER_RANK, D_MODEL, generator=g),
            torch.randn(world, TOKENS_PER_RANK, D_MODEL, generator=g))


def run(ctx, row: Row, opts) -> list:
    """Every rank: the layer over the ranks vs the one-process layer, STEPS SGD steps."""
    from inhouse_moe import layer as inhouse

    r, w = ctx.rank, ctx.world_size
    experts = row.settings.experts_per_rank * w
    layout = ExpertLayout(experts, w)
    mine = inhouse.InHouseMoE(D_MODEL, D_HIDDEN, experts, rank=r, world_size=w)
    whole = inhouse.InHouseMoE(D_MODEL, D_HIDDEN, experts)
    _weights(mine, opts.seed, layout, r)
    _weights(whole, opts.seed, ExpertLayout(experts, 1), 0)
    ref_params = dict(whole.named_parameters())
    out = []
    for step in range(STEPS):
        tag = f"step {step + 1}"
        x_all, t_all = _batch(opts.seed, step, w)
        x = x_all[r].clone().requires_grad_(True)
        y = mine(x)
        (y * t_all[r]).mean().backward()
        y = y.detach()
        inhouse.sync_gradients(mine)
        big = x_all.reshape(-1, D_MODEL).clone().requires_grad_(True)
        y_ref = whole(big)
        (y_ref * t_all.reshape(-1, D_MODEL)).mean().backward()
        # the known-wrong answer for the router: its gradient from this rank's tokens alone, never all-reduced
        alone = whole.router.weight.detach().clone().requires_grad_(True)
        probs = (x_all[r] @ alone.T).softmax(-1)
        score = probs.max(-1).values
        with torch.no_grad():
            expert_out = y_ref.detach().reshape(w, TOKENS_PER_RANK, D_MODEL)[r] / score[:, None].detach()
        ((expert_out * score[:, None]) * t_all[r]).mean().div(w).backward()
        tokens = slice(r * TOKENS_PER_RANK, (r + 1) * TOKENS_PER_RANK)
        out.append(compare(f"{tag}: output", y, y_ref.detach()[tokens], STRICT, group=OUTPUT))
        out.append(compare(f"{tag}: input grad", x.grad, big.grad[tokens] * w, STRICT, group=INPUT_GRAD))
        for name, p in mine.named_parameters():
            ref = ExpertLayout.split_name(name, "experts.")
            global_name = layout.global_name(name, "experts.", r)
            label = name if ref is None else f"{name} (expert {layout.global_expert(r, ref[0])})"
            extra = {"alternatives": {"rank-local": rank_local(alone.grad)}} if name == "router.weight" else {}
            out.append(compare(f"{tag}: grad {label}", p.grad, ref_params[global_name].grad, STRICT,
                               group=ROUTER if ref is None else EXPERTS, **extra))
        with torch.no_grad():
            for p in list(mine.parameters()) + list(whole.parameters()):
                p -= LR * p.grad
                p.grad = None
    for name, p in mine.named_parameters():
        global_name = layout.global_name(name, "experts.", r)
        out.append(compare(f"{name} after {STEPS} SGD steps", p, ref_params[global_name], STRICT,
                           group=ROUTER if global_name == name else EXPERTS))
    return out


class InHouse(Adapter):
    name = "inhouse-moe"
    import_name = "inhouse_moe"
    catches = "an in-house MoE whose all-to-all or gradient sync leaves outputs or gradients unlike one process"
    runners = {PARITY: run}

    def version(self) -> str | None:
        return "example"

    def rows(self, world_size: int, *, resume: bool = False, user_config=None) -> list[Row]:
        if world_size < 2:
            return []
        return [Row(library=self.name, model="top1", backend="-", ep_mode=f"a2a-E={n if n > 1 else ''}W",
                    world_size=world_size, settings=LayerSettings(experts_per_rank=n)) for n in PER_RANK]


ADAPTER = InHouse()

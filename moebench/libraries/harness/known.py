"""The known-wrong answers of an expert-parallel layer, computed on copies of the one-process layer, so that a failure
is named by the mechanism that matches it with no alternative written by the user.

For rank r of W (the loss is linear in the output, so a copy whose forward differs still gives the backward that
wrong implementation would give):
- rank-local: the router's gradient from rank r's tokens alone, never all-reduced;
- gather-backward-unreduced: gradients that reach a token (its input, its routing weights) only through the experts
  of its own rank (an all-gather whose backward keeps this rank's slice without reducing it), computed with every
  other rank's experts zeroed (a zeroed expert outputs zero); for the router, averaged over the ranks by a right
  sync, or not (both at once: named as both);
- missing-backward-exchange (a ModuleList of experts): the input gradient when the expert path of the experts on
  other ranks is cut (an all-to-all whose backward keeps only this rank's own slots), or of every expert;
- permutation: the output when the dispatch maps local slots to global experts by another built-in layout than the
  one the weights were laid out by (slot by slot in the diagnosis);
- global-norm (a clip row): the step taken with this rank's own clip coefficient (a norm over its own experts).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moebench.libraries.harness.common import loss_of, output_of
from moebench.libraries.harness.units import by_unit, describe, expert_unit, global_map, units
from moebench.parity.diagnose import gather_backward_unreduced, no_backward_exchange, per_rank_norm, rank_local
from moebench.parity.diagnosis import GATHER_BACKWARD_UNREDUCED, MISSING_BACKWARD_EXCHANGE, PERMUTATION, RANK_LOCAL
from moebench.parity.layout import ExpertLayout

MAX_SLOTS_NAMED = 6
"""Slots named one by one in a permutation's sentence; the rest are counted."""


@dataclasses.dataclass
class Answers:
    """The known-wrong answers for rank r, as `alternatives` for each comparison (moebench.parity.diagnose)."""

    outputs: dict[str, tuple] = dataclasses.field(default_factory=dict)
    routers: dict[str, dict[Any, tuple]] = dataclasses.field(default_factory=dict)
    experts: dict[str, dict[Any, tuple]] = dataclasses.field(default_factory=dict)
    inputs: dict[str, tuple] = dataclasses.field(default_factory=dict)

    def output(self, rank: int) -> dict[str, tuple]:
        return self.outputs

    def router_grad(self, unit) -> dict[str, tuple]:
        return {label: by[unit] for label, by in self.routers.items() if unit in by}

    def expert_grad(self, unit) -> dict[str, tuple]:
        return {label: by[unit] for label, by in self.experts.items() if unit in by}

    def input_grad(self, rank: int) -> dict[str, tuple]:
        return self.inputs


def _copy(spec, whole, experts: int):
    clone = spec.build(0, 1, experts)
    clone.load_state_dict(whole.state_dict())
    return clone


def _backward(spec, layer, x: torch.Tensor, t: torch.Tensor):
    """(input gradient, {unit: gradient}, output) of `layer` on x (the loss's mean over x's tokens)."""
    x = x.clone().requires_grad_(True)
    y = output_of(layer(x))
    loss_of(y, t).backward()
    grads = {u: g.detach().clone() for u, _, g in units(spec, layer, lambda i: i, grads=True) if g is not None}
    return x.grad, grads, y.detach()


def _zero_experts(spec, layer, keep: set[int]) -> None:
    with torch.no_grad():
        for unit, _, t in units(spec, layer, lambda i: i):
            if expert_unit(unit) and unit[0] not in keep:
                t.zero_()


def _held(spec, rank: int, world: int, experts: int) -> set[int]:
    to_global = global_map(spec, rank, world, experts)
    return {to_global(slot) for slot in range(experts // world)}


def answers(spec, whole, rank: int, world: int, experts: int, x_all: torch.Tensor, t_all: torch.Tensor) -> Answers:
    """Every known-wrong answer for `rank` at the layer's current weights (whole is left as it is)."""
    found = Answers()
    x_r, t_r = x_all[rank], t_all[rank]
    # rank-local: the router's gradient from this rank's tokens alone
    _, alone, _ = _backward(spec, _copy(spec, whole, experts), x_r, t_r)
    # gradients through each rank's own experts only (every other expert zeroed), on that rank's tokens
    own: list[tuple[torch.Tensor, dict]] = []
    for r in range(world):
        clone = _copy(spec, whole, experts)
        _zero_experts(spec, clone, _held(spec, r, world, experts))
        x_grad, grads, _ = _backward(spec, clone, x_all[r], t_all[r])
        own.append((x_grad, grads))
    dense = [u for u in alone if not expert_unit(u)]
    where = "the experts of this rank only"
    found.routers["rank-local"] = {u: rank_local(alone[u]) for u in dense}
    unreduced = gather_backward_unreduced(None, where)
    found.routers["gather-backward-unreduced"] = {
        u: (torch.stack([g[u] for _, g in own]).mean(0), *unreduced[1:]) for u in dense if all(u in g for _, g in own)}
    found.routers["rank-local+gather-backward-unreduced"] = {
        u: (own[rank][1][u], "an all-gather whose backward never reduces, and a router gradient never all-reduced",
            f"{RANK_LOCAL}+{GATHER_BACKWARD_UNREDUCED}",
            "both at once: the router's gradient comes from this rank's tokens through this rank's experts alone")
        for u in dense if u in own[rank][1]}
    found.inputs["gather-backward-unreduced"] = (own[rank][0], *unreduced[1:])
    if isinstance(spec.experts, str):  # a ModuleList: each expert's input path can be cut on its own
        mine = _held(spec, rank, world, experts)
        cut_others, cut_all = _copy(spec, whole, experts), _copy(spec, whole, experts)
        for clone, cut in ((cut_others, lambda g: g not in mine), (cut_all, lambda g: True)):
            modules = clone.get_submodule(spec.experts)
            for g, module in enumerate(modules):
                if cut(g):
                    module.register_forward_pre_hook(lambda m, args: tuple(a.detach() if torch.is_tensor(a) else a
                                                                           for a in args))
        local_only, _, _ = _backward(spec, cut_others, x_r, t_r)
        nothing, _, _ = _backward(spec, cut_all, x_r, t_r)
        found.inputs.update(no_backward_exchange(nothing, local_only))
    mine = _held(spec, rank, world, experts)
    found.experts["local-only backward exchange"] = {
        u: (g, "an all-to-all whose backward keeps only this rank's own slots", MISSING_BACKWARD_EXCHANGE,
            "an expert's gradient comes from its own rank's tokens alone: the gradients of the tokens other ranks "
            "sent it never come back through the exchange's backward")
        for u, g in alone.items() if expert_unit(u) and u[0] in mine}
    found.outputs.update(_permutations(spec, whole, rank, world, experts, x_r))
    return found


def _permutations(spec, whole, rank: int, world: int, experts: int, x_r: torch.Tensor) -> dict[str, tuple]:
    """The output when the dispatch treats slot (h, s) as the expert another built-in layout says it holds, while
    the weights there are the declared layout's."""
    out = {}
    local = experts // world
    declared = {(h, s): global_map(spec, h, world, experts)(s) for h in range(world) for s in range(local)}
    weights = by_unit(spec, whole, lambda i: i)
    for order in ("contiguous", "strided"):
        layout = ExpertLayout(experts, world, order=order)
        dispatch = {(h, s): layout.global_expert(h, s) for h in range(world) for s in range(local)}
        if dispatch == declared:
            continue
        # the token routed to expert g lands on the slot the dispatch says holds g, whose weights are declared(slot)
        sigma = {dispatch[slot]: declared[slot] for slot in dispatch}
        clone = _copy(spec, whole, experts)
        with torch.no_grad():
            for unit, _, t in units(spec, clone, lambda i: i):
                if expert_unit(unit):
                    t.copy_(weights[(sigma[unit[0]], unit[1])])
        y = output_of(clone(x_r.clone())).detach()
        wrong = sorted((slot for slot in dispatch if dispatch[slot] != declared[slot]))
        named = [f"rank {h}, local slot {s} holds global expert {declared[(h, s)]}'s weights; the dispatch sends it "
                 f"expert {dispatch[(h, s)]}'s tokens" for h, s in wrong[:MAX_SLOTS_NAMED]]
        more = f"; and {len(wrong) - MAX_SLOTS_NAMED} more slots" if len(wrong) > MAX_SLOTS_NAMED else ""
        declared_label = spec.layout if isinstance(spec.layout, str) else "the layout function's"
        out[f"{order} dispatch"] = (y, f"a dispatch that maps local slots to global experts {order} while the weights "
                                       f"are laid out {declared_label}", PERMUTATION, "; ".join(named) + more)
    return out


def per_rank_clip(spec, clipped_grads: dict, rank: int, world: int, experts: int, max_norm: float,
                  ref_norm: float) -> dict[Any, tuple]:
    """{unit: alternative} for the gradients clipped with this rank's own clip coefficient: the norm over the
    dense parameters and this rank's own experts only, never reduced over the ranks."""
    coefficient = max_norm / (ref_norm + 1e-6)
    grads = {u: g / coefficient for u, g in clipped_grads.items() if g is not None}  # unclipped
    mine = _held(spec, rank, world, experts)
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for u, g in grads.items()
                                if not expert_unit(u) or u[0] in mine)))
    own = min(1.0, max_norm / (norm + 1e-6))
    entry = per_rank_norm(None, "a clip whose norm never sums over the expert-parallel ranks")
    return {u: (own * g, *entry[1:]) for u, g in grads.items()}


def describe_unit(unit) -> str:
    return describe(unit)

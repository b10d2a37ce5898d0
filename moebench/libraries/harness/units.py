"""Where a layer's experts live: every parameter as units keyed by GLOBAL expert (or by name, for the rest).

A unit is one expert's share of one parameter ((global expert, parameter name with the expert's own index left
out)) or a whole non-expert parameter (its name). Both layouts a layer may have are read the same way:
- a ModuleList: parameters named "<experts>.<slot>.<rest>", one module per local expert;
- stacked: {parameter name: dim}, each local expert a slice of the parameter along that dim.
The one-process layer holds every expert, slot = global index.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from moebench.parity.layout import ExpertLayout

Unit = "tuple[int, str] | str"


def global_map(spec, rank: int, world_size: int, num_experts: int) -> Callable[[int], int]:
    """slot -> global expert on `rank`, by the layer's declared layout (identity on one process)."""
    if world_size == 1:
        return lambda slot: slot
    if callable(spec.layout):
        return lambda slot: int(spec.layout(rank, slot, world_size, num_experts))
    layout = ExpertLayout(num_experts, world_size, order=spec.layout)
    return lambda slot: layout.global_expert(rank, slot)


def layout_problem(spec, world_size: int, num_experts: int) -> str:
    """Why the declared layout is no placement of `num_experts` over the ranks ("" when it is one)."""
    local = num_experts // world_size
    seen = sorted(global_map(spec, r, world_size, num_experts)(s) for r in range(world_size) for s in range(local))
    if seen != list(range(num_experts)):
        return (f"layout puts slots on experts {seen[:16]}; every expert 0..{num_experts - 1} must be held by exactly "
                "one (rank, slot)")
    return ""


def units(spec, layer: torch.nn.Module, to_global: Callable[[int], int], *, grads: bool = False
          ) -> Iterator[tuple[Any, int | None, torch.Tensor]]:
    """(unit, local slot or None, tensor) for every parameter of `layer` (its gradient with `grads`: None where
    there is none)."""
    for name, p in layer.named_parameters():
        t = p.grad if grads else p
        if isinstance(spec.experts, str):
            prefix = spec.experts + "."
            if name.startswith(prefix) and name[len(prefix):].split(".", 1)[0].isdigit():
                slot_text, rest = name[len(prefix):].split(".", 1)
                slot = int(slot_text)
                yield (to_global(slot), rest), slot, t
                continue
        elif name in spec.experts:
            dim = spec.experts[name]
            for slot in range(p.shape[dim]):
                yield (to_global(slot), name), slot, None if t is None else t.select(dim, slot)
            continue
        yield name, None, t


def expert_unit(unit) -> bool:
    return isinstance(unit, tuple)


def by_unit(spec, layer, to_global, *, grads: bool = False) -> dict:
    return {u: t for u, _, t in units(spec, layer, to_global, grads=grads)}


def describe(unit) -> str:
    """A unit as a comparison names it: "experts[3].fc1.weight" / "router.weight"."""
    return f"expert {unit[0]} {unit[1]}" if expert_unit(unit) else unit


def global_experts(spec, layer, rank: int, world_size: int, num_experts: int) -> list[int]:
    """The global experts `rank` holds (its slots in order)."""
    to_global = global_map(spec, rank, world_size, num_experts)
    return sorted({u[0] for u, _, _ in units(spec, layer, to_global) if expert_unit(u)})

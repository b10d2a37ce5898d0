"""Optimizer state in a checkpoint: every parameter with state has both moments (of its shape) and a step; every
expert and router of an MoE layer has state where others do; steps agree; and no single step object is shared by
every parameter (where the format keeps object identity)."""

from __future__ import annotations

from moebench.checkpoint_audit import stream as s
from moebench.checkpoint_audit.experts import STACKED, Layer, per_expert


def _expert_of(name: str) -> tuple[str, list[int]]:
    m = per_expert(name)
    if m:
        return m.group("layer") or "", [int(m.group("index"))]
    m = STACKED.match(name)
    return (m.group("layer") or "", []) if m else ("", [])


def check(tensors: list[s.Stored], layers: dict[str, Layer]) -> tuple[list[s.Problem], dict]:
    """(problems, a summary: parameters with state, the step counts found)."""
    state: dict[str, dict[str, list[s.Stored]]] = {}
    for t in tensors:
        if t.role in s.OPTIMIZER_ROLES and t.of is not None:
            state.setdefault(t.of, {}).setdefault(t.role, []).append(t)
    if not state:
        return [], {"present": False}
    params = {t.name: t for t in tensors if t.role == s.PARAM}
    problems = []
    for of, quantities in sorted(state.items()):
        layer, experts = _expert_of(of)
        lacking = [q for q in s.OPTIMIZER_ROLES if q not in quantities]
        if lacking:
            problems.append(s.Problem(name=s.MISSING_STATE, tensor=of, layer=layer, experts=experts,
                                      sentence=f"{of}: optimizer state has no {' and no '.join(lacking)}"
                                               + (" (a resumed Adam restarts its bias correction for it)"
                                                  if s.STEP in lacking else "")))
        param = params.get(of)
        for q in s.MOMENTS:
            for t in quantities.get(q, []):
                if param is not None and t.shape != param.shape:
                    problems.append(s.Problem(name=s.STATE_SHAPE, tensor=t.name, layer=layer, experts=experts,
                                              sentence=f"{t.name}: {q} is {list(t.shape)}, its parameter "
                                                       f"{of} is {list(param.shape)}"))
    experts_with_state = {of for of in state}
    named = any(of in params for of in state)  # the state names the model's parameters (not positions)
    for layer in layers.values() if named else ():
        for t in layer.stacked + [x[0] for by in layer.per_expert.values() for x in by.values()]:
            if t.name not in experts_with_state and not any(t.name.endswith("." + of) for of in experts_with_state):
                name, experts = _expert_of(t.name)
                problems.append(s.Problem(name=s.MISSING_STATE, tensor=t.name, layer=name, experts=experts,
                                          sentence=f"{t.name}: no optimizer state, while {len(state)} other "
                                                   "parameter(s) have it"))
        for t in layer.routers:  # never stepped (no gradient reached it), or its state not saved
            if t.name not in experts_with_state and not any(t.name.endswith("." + of) for of in experts_with_state):
                problems.append(s.Problem(name=s.MISSING_STATE, tensor=t.name, layer=layer.name, experts=[],
                                          sentence=f"{t.name}: the router has no optimizer state, while "
                                                   f"{len(state)} other parameter(s) have it (its gradient never "
                                                   "reached the optimizer, or its state was not saved; a strict "
                                                   "resume refuses it)"))
    steps, problems_steps = _steps(state)
    return problems + problems_steps, {"present": True, "parameters": len(state), "steps": steps}


def _steps(state: dict[str, dict[str, list[s.Stored]]]) -> tuple[list[float], list[s.Problem]]:
    values: dict[float, list[str]] = {}
    groups: dict[str, list[str]] = {}
    for of, quantities in sorted(state.items()):
        for t in quantities.get(s.STEP, [])[:1]:
            value = t.load()
            number = float(value.reshape(-1)[0]) if hasattr(value, "reshape") and value.numel() else float(value)
            values.setdefault(number, []).append(of)
            if t.group:
                groups.setdefault(t.group, []).append(of)
    problems = []
    if len(values) > 1:
        said = "; ".join(f"{v:g} for {len(names)} ({names[0]}{', ...' if len(names) > 1 else ''})"
                         for v, names in sorted(values.items(), key=lambda kv: -len(kv[1])))
        problems.append(s.Problem(name=s.STEP_MISMATCH, tensor=min(values.items(), key=lambda kv: len(kv[1]))[1][0],
                                  sentence=f"parameters' step counts differ: {said}"))
    for group, names in groups.items():
        if len(names) > 1:  # torch's optimizers keep one step tensor per parameter
            problems.append(s.Problem(name=s.SHARED_STEP, tensor=names[0],
                                      sentence=f"{len(names)} parameters share one step object ({names[0]}, ...): "
                                               "an optimizer that steps one in place steps them all"))
    return sorted(values), problems

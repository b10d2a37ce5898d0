"""`--against`: the same model in another layout or format, matched expert by expert by global index.

Layers are paired in order (the i-th MoE layer of each), whatever each format calls them; an expert is the
multiset of its tensors' digests, so `w1` and `gate_proj`, a stacked slice and a per-expert file, fp32 and its
bf16 export all compare. A slot that holds another expert's values is a `permutation`, named slot by slot (with
the EP degree whose strided order it is, when one explains it); a slot like no expert's is named as such.
"""

from __future__ import annotations

from collections import Counter

from moebench.checkpoint_audit import stream as s
from moebench.checkpoint_audit.audit import ROUNDED, _span
from moebench.checkpoint_audit.experts import natural

UNMATCHED = "unmatched"
"""An expert of the checkpoint whose values no expert of the other holds."""


def _key(prints: list, rounded: bool) -> tuple:
    return tuple(sorted(Counter(p[2 if rounded else 1] for p in prints).items()))


def compare(ours: dict, theirs: dict, path: str, other: str) -> tuple[list[s.Problem], list[dict]]:
    """(problems, one record per layer pair) for fingerprints `ours` (PATH) and `theirs` (--against)."""
    problems, records = [], []
    our_layers, their_layers = sorted(ours, key=natural), sorted(theirs, key=natural)
    if len(our_layers) != len(their_layers):
        problems.append(s.Problem(name=s.EXPERT_COUNT, sentence=f"{path} has {len(our_layers)} MoE layer(s), "
                                                                 f"{other} has {len(their_layers)}"))
    for a_name, b_name in zip(our_layers, their_layers):
        a, b = ours[a_name], theirs[b_name]
        record = {"layer": a_name, "against_layer": b_name, "experts": len(a), "against_experts": len(b),
                  "matched": 0, "slots": []}
        exact, rounded = {}, {}
        for i, prints in a.items():
            exact.setdefault(_key(prints, False), []).append(i)
            rounded.setdefault(_key(prints, True), []).append(i)
        for j in sorted(b):
            for by, is_rounded in ((exact, False), (rounded, True)):
                holds = by.get(_key(b[j], is_rounded), [])
                if holds:
                    record["matched"] += j in holds
                    record["slots"].append({"slot": j, "holds": j if j in holds else holds[0], "rounded": is_rounded})
                    break
            else:
                record["slots"].append({"slot": j, "holds": None, "rounded": False})
        record["slots"].sort(key=lambda x: x["slot"])
        records.append(record)
        problems += _problems(record, a, b, path, other)
    return problems, records


def _problems(record: dict, a: dict, b: dict, path: str, other: str) -> list[s.Problem]:
    problems = []
    layer = record["layer"]
    moved = [x for x in record["slots"] if x["holds"] is not None and x["holds"] != x["slot"]]
    if moved:
        said = "; ".join(f"slot {x['slot']} holds expert {x['holds']}" for x in moved[:8])
        more = f"; {len(moved) - 8} more" if len(moved) > 8 else ""
        strided = _strided(moved, len(b))
        problems.append(s.Problem(name=s.PERMUTATION, layer=layer, experts=sorted(x["slot"] for x in moved),
                                  sentence=f"layer {layer}: {other} holds {path}'s experts in another order: "
                                           f"{said}{more}{strided}"))
    lost = [x["slot"] for x in record["slots"] if x["holds"] is None]
    if lost:
        problems.append(s.Problem(name=UNMATCHED, layer=layer, experts=lost,
                                  sentence=f"layer {layer}: expert{'s' if len(lost) > 1 else ''} {_span(lost)} of "
                                           f"{other} match{'es' if len(lost) == 1 else ''} no expert of {path} "
                                           f"(not even within {ROUNDED} rounding)"))
    absent = sorted(set(a) - set(b))
    if absent:
        problems.append(s.Problem(name=s.MISSING_EXPERT, layer=layer, experts=absent,
                                  sentence=f"layer {layer}: experts {_span(absent)} of {path} are not in {other}"))
    return problems


def _strided(moved: list[dict], experts: int) -> str:
    """", the strided order of ep_size E" when slot j holding expert (j % per) * E + j // per explains every move."""
    where = {x["slot"]: x["holds"] for x in moved}
    for ep in range(2, experts):
        if experts % ep:
            continue
        per = experts // ep
        order = {j: (j % per) * ep + j // per for j in range(experts)}
        inverse = {v: k for k, v in order.items()}
        for mapping, words in ((order, "strided"), (inverse, "strided")):
            if all(mapping[j] == h for j, h in where.items()) and \
                    sum(mapping[j] != j for j in range(experts)) == len(where):
                return f" (the {words} order of ep_size {ep}, where contiguous was expected)"
    return ""

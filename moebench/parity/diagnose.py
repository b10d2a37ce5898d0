"""Name the bug behind a failed comparison, from the numbers only.

`diagnose(actual, expected, tol)` returns {"name", "sentence", "details"} for a comparison that
failed. Detectors, in order (the first that explains the numbers wins):

- non-finite: NaN / Inf in the actual (or expected) tensor; the first flat index and position.
- zero: the actual tensor is all zeros while the expected is not (detached; backward returned nothing).
- alternatives: the caller may pass tensors a known-wrong implementation would produce, e.g. the
  all-gather check passes {"local slice": what a local-slice backward gives}; a match names it.
- uniform scale: actual = c * expected everywhere (c fitted by least squares). When c or 1/c is an
  integer N >= 2 (within SCALE_INTEGER_RTOL): "summed instead of averaged over N ranks" / "averaged twice".
- rows permuted: every row of actual equals some row of expected (within the tolerance), in another order.
- partial: only some rows (dim 0) differ; they are named.
- unexplained: none of the above, with statistics.

`summarise(comparisons, world_size)` gives the check-level finding: which parameter groups (experts,
gate/router, replicated, input gradient, output) are right and which are wrong, and which ranks.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

# A fitted scale c explains the numbers when |actual - c * expected| stays within this fraction of
# max |actual| everywhere. Summation-order noise is ~1e-7 of the magnitude (compare.py); 1e-4 leaves
# 1000x margin and is still far below what any partially wrong tensor would leave (>= 1e-2 here).
SCALE_FIT_RTOL = 1e-4
# c or 1/c counts as the integer N when within 2 % of it: a summed-not-averaged gradient is N x to
# ~1e-7; 2 % only matters for noisy users' code, and integers >= 2 are >= 33 % apart at N <= 64.
SCALE_INTEGER_RTOL = 0.02
# A scale this close to 1 is no finding (it would be a tolerance issue, not a bug class).
SCALE_MIN_DEVIATION = 1e-3
# Rows are matched for the permutation / partial detectors with the comparison's own tolerance
# widened by this factor, so a row that is right up to summation noise is never called wrong.
ROW_MATCH_SLACK = 10.0
# At most this many rows are named in a sentence (the details keep all of them).
MAX_NAMED = 8

GROUPS = ("output", "input gradient", "gate/router", "experts", "replicated")


def _t(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64)
    return torch.as_tensor(x, dtype=torch.float64)


def _close(a: torch.Tensor, e: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    return (a - e).abs() <= ROW_MATCH_SLACK * (atol + rtol * e.abs())


def _names(idx: list[int], what: str = "row") -> str:
    shown = ", ".join(str(i) for i in idx[:MAX_NAMED])
    more = f" and {len(idx) - MAX_NAMED} more" if len(idx) > MAX_NAMED else ""
    return f"{what}{'s' if len(idx) > 1 else ''} {shown}{more}"


def _d(name: str, sentence: str, **details) -> dict[str, Any]:
    return {"name": name, "sentence": sentence, "details": details}


def _integer_scale(c: float, world_size: int | None) -> tuple[int | None, str]:
    for value, word in ((c, "summed instead of averaged"), (1.0 / c if c else math.inf, "averaged twice")):
        n = round(value) if math.isfinite(value) else 0
        if n >= 2 and abs(value - n) <= SCALE_INTEGER_RTOL * n:
            who = " (the world size)" if world_size == n else ""
            if word.startswith("summed"):
                return n, f"summed instead of averaged over {n} ranks{who}"
            return n, f"averaged twice: divided by {n}{who} once too often"
    return None, ""


def diagnose(actual: Any, expected: Any, *, atol: float, rtol: float, world_size: int | None = None,
             alternatives: dict[str, Any] | None = None) -> dict[str, Any]:
    """The diagnosis of a failed comparison (actual vs expected, judged with atol / rtol)."""
    a, e = _t(actual), _t(expected)
    if a.shape != e.shape:
        return _d("shape", f"shape {tuple(a.shape)} instead of {tuple(e.shape)}",
                  actual_shape=list(a.shape), expected_shape=list(e.shape))
    for which, t in (("actual", a), ("expected", e)):
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            flat = int(bad.flatten().nonzero()[0])
            pos = [int(i) for i in torch.unravel_index(torch.tensor(flat), t.shape)] if t.ndim else []
            kind = "NaN" if bool(torch.isnan(t).any()) else "Inf"
            return _d("non-finite", f"{kind} in the {which} result, first at index {tuple(pos)} "
                      f"({int(bad.sum())} of {t.numel()} elements)", tensor=which, first_index=pos,
                      count=int(bad.sum()), numel=t.numel())
    magnitude = float(e.abs().max()) if e.numel() else 0.0
    if a.numel() and bool((a == 0).all()) and magnitude > 0:
        return _d("zero", "all zeros: no gradient reached it (detached, or a backward that returns nothing)",
                  expected_magnitude=magnitude)
    for label, alt in (alternatives or {}).items():
        alt_t = _t(alt)
        if alt_t.shape == a.shape and bool(_close(a, alt_t, atol, rtol).all()):
            return _d(label.replace(" ", "-"), f"matches what {label} would give", alternative=label)
    ee = float((e * e).sum())
    if ee > 0:
        c = float((a * e).sum()) / ee
        resid = float((a - c * e).abs().max())
        scale_ok = resid <= SCALE_FIT_RTOL * max(float(a.abs().max()), 1e-300)
        if scale_ok and abs(c - 1.0) > SCALE_MIN_DEVIATION and c != 0:
            n, why = _integer_scale(c, world_size)
            sentence = f"actual = {c:.4g} x expected everywhere" + (f": {why}" if why else "")
            return _d("uniform-scale", sentence, scale=c, integer=n, residual=resid)
    if a.ndim >= 1 and a.shape[0] > 1:
        rows_a, rows_e = a.reshape(a.shape[0], -1), e.reshape(e.shape[0], -1)
        match = torch.stack([_close(rows_a[i][None, :], rows_e, atol, rtol).all(dim=1) for i in range(len(rows_a))])
        perm: list[int] = []
        used: set[int] = set()
        for i in range(len(rows_a)):
            j = next((int(j) for j in match[i].nonzero().flatten() if int(j) not in used), None)
            if j is None:
                break
            perm.append(j)
            used.add(j)
        if len(perm) == len(rows_a) and perm != list(range(len(perm))):
            moved = [i for i, j in enumerate(perm) if i != j]
            return _d("rows-permuted", f"the right rows in the wrong order: row i holds expected row perm[i], "
                      f"perm = {perm[:4 * MAX_NAMED]}", permutation=perm, moved=moved)
        wrong = [i for i in range(len(rows_a)) if not bool(match[i, i])]
        if 0 < len(wrong) < len(rows_a):
            return _d("partial", f"only {_names(wrong)} of {len(rows_a)} differ; the others are right",
                      rows=wrong, rows_total=len(rows_a))
    diff = (a - e).abs()
    outside = diff > atol + rtol * e.abs()
    c = float((a * e).sum()) / ee if ee > 0 else 0.0
    na, ne = float(a.norm()), float(e.norm())
    corr = float((a * e).sum()) / (na * ne) if na > 0 and ne > 0 else 0.0
    return _d("unexplained", f"{int(outside.sum())} of {a.numel()} elements outside the tolerance; max abs diff "
              f"{float(diff.max()):.3g}, mean abs diff {float(diff.mean()):.3g}, |actual|/|expected| "
              f"{na / ne if ne else math.inf:.3g}, correlation {corr:.3g}, best scale {c:.3g}",
              outside=int(outside.sum()), numel=a.numel(), max_abs_diff=float(diff.max()),
              mean_abs_diff=float(diff.mean()), norm_ratio=(na / ne if ne else None), correlation=corr,
              best_scale=c)


# ------------------------------------------------------------------ check level


def group_of(name: str) -> str:
    """The parameter group a comparison's name belongs to."""
    n = name.lower()
    if re.search(r"\b(gate|router|routing|gating)\b", n):
        return "gate/router"
    if "input grad" in n or "x.grad" in n:
        return "input gradient"
    if re.search(r"\bexperts?\b|h4toh|htoh4|deepspeed_experts", n):
        return "experts"
    if re.search(r"\b(output|outputs|loss|gathered|sizes|forward|mask|capacity|kept|dropped|combine)\b", n):
        return "output"
    return "replicated"


def summarise(comparisons: list, world_size: int) -> dict[str, Any] | None:
    """The check-level diagnosis from its comparisons (Comparison objects); None when none failed."""
    asserted = [c for c in comparisons if c.asserted]
    failed = [c for c in asserted if not c.passed]
    if not failed:
        return None
    groups: dict[str, list[int]] = {}
    for c in asserted:
        g = groups.setdefault(group_of(c.name), [0, 0])
        g[1] += 1
        g[0] += 0 if c.passed else 1
    right = [g for g in GROUPS if g in groups and groups[g][0] == 0]
    wrong = [g for g in GROUPS if g in groups and groups[g][0] > 0]
    names = [c.diagnosis["name"] for c in failed if c.diagnosis]
    parts = [f"{g} right" for g in right] + [f"{g} wrong ({groups[g][0]}/{groups[g][1]})" for g in wrong]
    ranks_failed = sorted({c.rank for c in failed if c.rank is not None})
    ranks_all = sorted({c.rank for c in asserted if c.rank is not None})
    if ranks_failed and len(ranks_failed) < len(ranks_all):
        parts.append(f"only on {_names(ranks_failed, 'rank')} of {len(ranks_all)}")
    dominant = max(set(names), key=names.count) if names else "unexplained"
    scales = sorted({c.diagnosis["details"].get("integer") for c in failed
                     if c.diagnosis and c.diagnosis["name"] == "uniform-scale"} - {None})
    if dominant == "uniform-scale" and scales:
        parts.append(f"scaled by {' / '.join(str(s) for s in scales)}"
                     + (" (the world size)" if scales == [world_size] else ""))
    if len(set(names)) > 1:
        counts = {n: names.count(n) for n in sorted(set(names))}
        parts.append("diagnoses: " + ", ".join(f"{n} x{k}" for n, k in counts.items()))
    if right and wrong:
        name = "partial"
    elif len(ranks_failed) < len(ranks_all) and ranks_failed:
        name = "partial"
    else:
        name = dominant
    return {"name": name, "sentence": "; ".join(parts),
            "details": {"groups": {g: {"failed": v[0], "total": v[1]} for g, v in groups.items()},
                        "ranks_failed": ranks_failed, "diagnoses": {n: names.count(n) for n in set(names)}}}

"""Name the bug behind a failed comparison, from the numbers only.

`diagnose(actual, expected, atol=, rtol=)` returns {"name", "sentence", "details"} for a comparison
that failed. Detectors, in order (the first that explains the numbers wins):

- shape: the shapes differ.
- non-finite: NaN / Inf in the actual (or expected) tensor; the first index.
- zero: the actual tensor is all zeros while the expected is not (detached; backward returned nothing).
- alternatives: the caller may pass tensors a known-wrong implementation would produce, e.g. the
  all-gather check passes {"local slice": what a local-slice backward gives}; a match names it, and
  so does a match up to an integer scale N or 1/N (a rank-local gradient later divided by W).
  Two expert-parallel classes have builders here so every check names them alike:
  `rank_local(grad)` (RANK_LOCAL: the gradient this rank computes alone, never all-reduced) and
  `no_backward_exchange(...)` (MISSING_BACKWARD_EXCHANGE: the all-to-all's backward sends nothing
  back, or only the rank's own slots, so the expert path adds nothing to tokens whose experts live
  elsewhere); `mispaired_scores(...)` (SCORES_MISPAIRED: each token's routing scores applied to
  its experts in the wrong order); `unrouted_slots(...)` (UNROUTED_SLOTS: the router gradient
  collects gradient from slots the rank never routed - sent to another rank's expert or dropped -
  whose zero routing weight hides them in the forward but not in the backward); `together(...)` (two
  of them at once, computed by the caller where their effects interact and their errors do not add).
- uniform-scale: actual = c * expected everywhere (c fitted by least squares). When c or 1/c is an
  integer N >= 2 (within SCALE_INTEGER_RTOL): "summed instead of averaged over N ranks" / "averaged twice".
- rows-permuted: along some dim, every slice of actual equals some slice of expected, in another order.
- partial: only some slices (rows) differ; they are named.
- unexplained: none of the above, with statistics.

`summarise(comparisons, world_size, first)` gives the check-level finding: which parameter groups
(output, input gradient, gate/router, experts, replicated) are right and which wrong, which ranks,
and the earliest failure's diagnosis.

Over 400 lines: every detector and every builder of a known-wrong answer in one place, so each diagnosis name
has one spot that decides it (the names themselves: diagnosis.py).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from moebench.parity.diagnosis import (
    EXPERT_GRAD_SCALE,
    FAILED_ASSERTION,
    GATHER_BACKWARD_UNREDUCED,
    GLOBAL_NORM,
    GROUPS,
    MISSING_BACKWARD_EXCHANGE,
    NON_FINITE,
    PARTIAL,
    RANK_LOCAL,
    ROUTER_DETACHED,
    ROWS_PERMUTED,
    SCORES_MISPAIRED,
    SHAPE,
    UNEXPLAINED,
    UNIFORM_SCALE,
    UNROUTED_SLOTS,
    ZERO,
    make,
)

# A fitted scale c explains the numbers when |actual - c * expected| stays within this fraction of
# max |actual| everywhere. Summation-order noise is ~1e-7 of the magnitude (compare.py); 1e-4 leaves
# 1000x margin and is still far below what a partly wrong tensor leaves (>= 1e-2 in every case seen).
SCALE_FIT_RTOL = 1e-4
# The comparison's absolute floor joins the fit's allowance only while it is below this fraction of
# max |actual| (strict floors are ~1e-5 of it; the engine check's float32 update floor ~1e-3).
SCALE_FLOOR_MAX = 1e-2
# c or 1/c counts as the integer N when within 2 % of it: a summed-not-averaged gradient is N x to
# ~1e-7; the slack only serves noisier user code, and integers >= 2 are >= 1.5 % apart up to N = 64.
SCALE_INTEGER_RTOL = 0.02
# A scale this close to 1 is no finding (that is a tolerance question, not a bug class).
SCALE_MIN_DEVIATION = 1e-3
# Slices are matched (permutation / partial) with the comparison's own tolerance widened by this
# factor, so a slice that is right up to summation noise is never called wrong.
ROW_MATCH_SLACK = 10.0
# At most this many indices are named in a sentence (the details keep all of them).
MAX_NAMED = 8


FIRST_DIVERGENCE = "first_divergence"
"""A check that knows its own causal order (stage, step, gradient before update) marks the diagnosis
of its first divergence with this detail set True and puts that comparison first; `summarise` then
headlines it and counts every other failure as its consequence."""


def _t(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64)
    return torch.as_tensor(x, dtype=torch.float64)


def _close(a: torch.Tensor, e: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    return (a - e).abs() <= ROW_MATCH_SLACK * (atol + rtol * e.abs())


def _names(idx: list, what: str = "row") -> str:
    shown = ", ".join(str(i) for i in idx[:MAX_NAMED])
    more = f" and {len(idx) - MAX_NAMED} more" if len(idx) > MAX_NAMED else ""
    return f"{what}{'s' if len(idx) > 1 else ''} {shown}{more}"


def integer_scale(c: float, world_size: int | None = None) -> tuple[int | None, str]:
    """(N, why) when c or 1/c is within SCALE_INTEGER_RTOL of an integer N >= 2, else (None, "")."""
    for value, summed in ((c, True), (1.0 / c if c else math.inf, False)):
        n = round(value) if math.isfinite(value) else 0
        if n >= 2 and abs(value - n) <= SCALE_INTEGER_RTOL * n:
            who = " (the world size)" if world_size == n else ""
            if summed:
                return n, f"summed instead of averaged over {n} ranks{who}"
            return n, f"averaged twice: divided by {n}{who} once too often"
    return None, ""


def diagnose(actual: Any, expected: Any, *, atol: float, rtol: float, world_size: int | None = None,
             alternatives: dict[str, Any] | None = None) -> dict[str, Any]:
    """The diagnosis of a failed comparison (actual vs expected, judged with atol / rtol).

    `alternatives`: label -> tensor, or label -> (tensor, what would give it[, diagnosis name[, its cause]])."""
    a, e = _t(actual), _t(expected)
    if a.shape != e.shape:
        return make(SHAPE, f"shape {tuple(a.shape)} instead of {tuple(e.shape)}",
                  actual_shape=list(a.shape), expected_shape=list(e.shape))
    for which, t in (("actual", a), ("expected", e)):
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            flat = int(bad.flatten().nonzero()[0])
            pos = [int(i) for i in torch.unravel_index(torch.tensor(flat), t.shape)] if t.ndim else []
            kind = "NaN" if bool(torch.isnan(t).any()) else "Inf"
            return make(NON_FINITE, f"{kind} in the {which} result, first at index {tuple(pos)} "
                      f"({int(bad.sum())} of {t.numel()} elements)", tensor=which, first_index=pos,
                      count=int(bad.sum()), numel=t.numel())
    magnitude = float(e.abs().max()) if e.numel() else 0.0
    if a.numel() and bool((a == 0).all()) and magnitude > 0:
        return make(ZERO, "all zeros: no gradient reached it (detached, or a backward that returns nothing)",
                  expected_magnitude=magnitude)
    known = [(label, *((*alt, label, "")[:4] if isinstance(alt, tuple) else (alt, label, label, "")))
             for label, alt in (alternatives or {}).items()]
    known = [(label, _t(alt), what, name, cause) for label, alt, what, name, cause in known if alt is not None]
    for label, alt, what, name, cause in known:
        found = _matches_alternative(a, alt, atol, rtol, world_size)
        if found is not None:
            scale, n = found
            parts = name.replace(" ", "-").split("+")
            sentence = f"matches what {what} would give" + (f", scaled by {_fraction(scale, n, world_size)}" if n
                                                              else "") + (f": {cause}" if cause else "")
            if len(parts) > 1:  # a `together` entry: two mechanisms computed at once by the caller
                return make("+".join(parts), sentence, alternative=label, scale=scale, composite=parts)
            return make(parts[0], sentence, alternative=label, scale=scale)
    # two known-wrong answers at once, where each alone explains nothing: their errors added to the right answer
    for i, (label1, alt1, what1, name1, _) in enumerate(known):
        for label2, alt2, what2, name2, _ in known[i + 1:]:
            if name1 == name2 or alt1.shape != e.shape or alt2.shape != e.shape:
                continue
            found = _matches_alternative(a, alt1 + alt2 - e, atol, rtol, world_size)
            if found is not None and found[1] is None:
                names = sorted({name1.replace(" ", "-"), name2.replace(" ", "-")})
                return make("+".join(names), f"matches what {what1} and {what2} together would give (both at once; "
                                             "neither alone explains it)", alternatives=[label1, label2],
                            composite=names)
    ee = float((e * e).sum())
    c = float((a * e).sum()) / ee if ee > 0 else 0.0
    if ee > 0 and c != 0 and abs(c - 1.0) > SCALE_MIN_DEVIATION:
        resid = float((a - c * e).abs().max())
        # The comparison's own absolute floor is noise it accepts on each side (e.g. an update read
        # from float32 parameters): a fit is not asked to be finer than that - when that floor is
        # small beside the values (a loose seed atol would let any scale "fit").
        peak = float(a.abs().max())
        floor = (1.0 + abs(c)) * atol if atol <= SCALE_FLOOR_MAX * peak else 0.0
        if resid <= SCALE_FIT_RTOL * peak + floor:
            n, why = integer_scale(c, world_size)
            sentence = f"actual = {c:.4g} x expected everywhere" + (f": {why}" if why else "")
            return make(UNIFORM_SCALE, sentence, scale=c, integer=n, residual=resid)
    found = _slices(a, e, atol, rtol)
    if found is not None:
        return found
    diff = (a - e).abs()
    outside = diff > atol + rtol * e.abs()
    na, ne = float(a.norm()), float(e.norm())
    corr = float((a * e).sum()) / (na * ne) if na > 0 and ne > 0 else 0.0
    ratio = na / ne if ne else math.inf
    return make(UNEXPLAINED, f"{int(outside.sum())} of {a.numel()} elements outside the tolerance; max abs diff "
              f"{float(diff.max()):.3g}, mean abs diff {float(diff.mean()):.3g}, |actual|/|expected| "
              f"{ratio:.3g}, correlation {corr:.3g}, best scale {c:.3g}",
              outside=int(outside.sum()), numel=a.numel(), max_abs_diff=float(diff.max()),
              mean_abs_diff=float(diff.mean()), norm_ratio=ratio if ne else None, correlation=corr,
              best_scale=c)


def _matches_alternative(a: torch.Tensor, alt: torch.Tensor, atol: float, rtol: float,
                         world_size: int | None) -> tuple[float, int | None] | None:
    """(1.0, None) when `a` matches `alt`; (c, N) when a = c x alt with c or 1/c the integer N >= 2; else None."""
    if alt.shape != a.shape or not bool((alt != 0).any()):
        return None
    if bool(_close(a, alt, atol, rtol).all()):
        return 1.0, None
    c = float((a * alt).sum()) / float((alt * alt).sum())
    n, _ = integer_scale(c, world_size) if c > 0 else (None, "")
    if n is not None and bool(_close(a, c * alt, atol, rtol).all()):
        return c, n
    return None


def _fraction(c: float, n: int, world_size: int | None) -> str:
    """c as "N" or "1/N", naming the world size when N is it."""
    return (f"{n}" if c > 1 else f"1/{n}") + (" (the world size)" if n == world_size else "")


def rank_local(grad: Any) -> tuple[Any, str, str]:
    """The `alternatives` entry for a gradient left rank-local: `grad` is what this rank computes
    from its own tokens alone (its loss, its slice of the batch), never all-reduced."""
    return (grad, "this rank's own tokens alone", RANK_LOCAL,
            "the gradient was never all-reduced over the ranks (a parameter the gradient sync skips, "
            "or one marked as an expert's)")


def no_backward_exchange(no_exchange: Any, local_only: Any = None) -> dict[str, tuple[Any, str, str]]:
    """The `alternatives` entries for an all-to-all without a backward exchange: `no_exchange` is the
    input gradient with the expert path contributing nothing (the exchange's backward returns zeros
    or is cut off), `local_only` the one where only this rank's own experts contribute (the backward
    keeps the slots the rank exchanged with itself, so tokens routed to other ranks' experts get none)."""
    out = {"no backward exchange": (no_exchange, "an all-to-all with no backward exchange", MISSING_BACKWARD_EXCHANGE,
                                    "the experts' path adds nothing to the input gradient (check the "
                                    "exchange's autograd backward)")}
    if local_only is not None:
        out["local-only backward exchange"] = (
            local_only, "a backward all-to-all that keeps only this rank's own slots", MISSING_BACKWARD_EXCHANGE,
            "tokens whose experts live on other ranks get no expert gradient (check the exchange's autograd "
            "backward)")
    return out


def mispaired_scores(output: Any) -> tuple[Any, str, str, str]:
    """The `alternatives` entry for routing scores paired with the wrong experts: `output` is the
    layer's output when each token's top-k scores are applied to its experts in another order."""
    return (output, "each token's routing scores applied to its experts in the wrong order", SCORES_MISPAIRED,
            "the scores lost their pairing with the experts (check where scores are permuted, sorted or "
            "gathered alongside the expert indices)")


def unrouted_slots(grad: Any, where: str = "") -> tuple[Any, str, str, str]:
    """The `alternatives` entry for a router gradient with contributions from slots the rank never
    routed: `grad` is the gradient when every slot whose expert is not this rank's (sent elsewhere, or
    dropped) still runs through some expert here and is weighted by a score that is zero in the
    forward only, so d(loss)/d(score) = <output gradient, that expert's output> reaches the router.
    `where` names the expert such a slot runs through (e.g. "the last local expert")."""
    return (grad, "a router that also collects gradient from slots this rank never routed", UNROUTED_SLOTS,
            "slots routed to another rank's expert (or dropped) keep a non-zero expert output"
            + (f" ({where})" if where else "") + "; their zero routing weight hides it in the forward "
            "but not in the backward (mask the routing weights at those slots with an op whose backward "
            "zeros them too)")


def together(grad: Any, first: tuple[str, str], second: tuple[str, str], cause: str = "") -> tuple[Any, str, str, str]:
    """The `alternatives` entry for two known-wrong mechanisms at once where their effects interact, so their
    errors do not add (the pair search above would miss them): `grad` is computed with both applied; `first` and
    `second` are each (what gives it, diagnosis name). Named as both, `a+b` (names sorted)."""
    (what1, name1), (what2, name2) = first, second
    return (grad, f"{what1} and {what2} at once (neither alone explains it)", "+".join(sorted((name1, name2))),
            cause)


def gather_backward_unreduced(grad: Any, where: str = "") -> tuple[Any, str, str, str]:
    """The `alternatives` entry for an all-gather whose backward is never reduced over the ranks: `grad` is the
    gradient when each token's input and routing weights get gradient only through the experts of its own rank
    (the rank's gathered-input gradient narrowed to its own tokens, without the all-reduce that brings the other
    ranks' experts' share). `where` names the gather."""
    return (grad, "an all-gather whose backward never reduces over the ranks", GATHER_BACKWARD_UNREDUCED,
            "each token's input and routing weights get gradient only through the experts of its own rank"
            + (f" ({where})" if where else "") + "; the backward must all-reduce (or reduce-scatter) the gathered "
            "gradient before keeping its own tokens' slice")


def per_rank_norm(norm: Any, where: str = "") -> tuple[Any, str, str, str]:
    """The `alternatives` entry for a clip norm taken over this rank's gradients only: `norm` is the norm of what
    this rank holds (its own experts and the replicated parameters), never reduced over the expert-parallel ranks."""
    return (norm, "a norm over this rank's own gradients", GLOBAL_NORM,
            "a global norm from per-rank norms: each rank's norm covers only the experts it holds, so every rank "
            "clips by its own coefficient" + (f" ({where})" if where else ""))


def scaled_experts_norm(norm: Any, factor: int) -> tuple[Any, str, str, str]:
    """The `alternatives` entry for a clip norm taken with the expert gradients `factor` x too large."""
    return (norm, f"the norm of the right gradients with the experts' x {factor}", EXPERT_GRAD_SCALE,
            f"expert gradients summed instead of averaged over {factor} ranks before the norm")


def router_detached(comparison: Any, where: str = "") -> None:
    """Name a router gradient that is exactly zero (the `zero` diagnosis, or a gradient that never arrived) as the
    mechanism behind it, when the caller knows the output was right: the routing weights crossed the ranks by a
    gather without a backward. Leaves any other diagnosis as it is."""
    found = comparison.diagnosis
    if found is None or found["name"] != ZERO:
        return
    comparison.diagnosis = make(ROUTER_DETACHED, "is exactly zero while the output is right: the routing weights "
                                "reach the experts through a non-differentiable gather, so no gradient returns to the "
                                "router"
                                + (f" ({where})" if where else ""), **found["details"])


def _slices(a: torch.Tensor, e: torch.Tensor, atol: float, rtol: float) -> dict[str, Any] | None:
    """rows-permuted along any dim, else partial along the dim where the fewest slices differ."""
    partial = None
    for dim in range(a.ndim):
        n = a.shape[dim]
        if n < 2:
            continue
        rows_a = a.movedim(dim, 0).reshape(n, -1)
        rows_e = e.movedim(dim, 0).reshape(n, -1)
        match = torch.stack([_close(rows_a[i][None, :], rows_e, atol, rtol).all(dim=1) for i in range(n)])
        perm: list[int] = []
        used: set[int] = set()
        for i in range(n):
            j = next((int(j) for j in match[i].nonzero().flatten() if int(j) not in used), None)
            if j is None:
                break
            perm.append(j)
            used.add(j)
        what, where = ("row", "") if dim == 0 else ("slice", f" along dim {dim}")
        if len(perm) == n and perm != list(range(n)):
            return make(ROWS_PERMUTED, f"the right {what}s{where} in the wrong order: position i holds expected "
                      f"{what} perm[i], perm = {perm[:4 * MAX_NAMED]}", dim=dim, permutation=perm,
                      moved=[i for i, j in enumerate(perm) if i != j])
        wrong = [i for i in range(n) if not bool(match[i, i])]
        if 0 < len(wrong) < n and (partial is None or len(wrong) / n < partial[0]):
            partial = (len(wrong) / n, dim, wrong, n, what, where)
    if partial is None:
        return None
    _, dim, wrong, n, what, where = partial
    return make(PARTIAL, f"only {_names(wrong, what)}{where} of {n} differ; the others are right",
              dim=dim, indices=wrong, total=n)


# ------------------------------------------------------------------ check level


def group_of(name: str) -> str:
    """The parameter group of a comparison made without one (the built-in checks), from its name."""
    n = name.lower()
    if re.search(r"\b(gate|router|routing|gating|top\dgating|capacity|kept|dropped|combine)\b", n):
        return "gate/router"
    if "input grad" in n or re.search(r"differentiable|grad_fn|backward", n):
        return "input gradient"
    if re.search(r"\bexperts?\b|h4toh|htoh4", n):
        return "experts"
    if re.search(r"\b(output|outputs|loss|gathered|sizes|forward)\b", n):
        return "output"
    return "replicated"


def summarise(comparisons: list, world_size: int, first: Any = None) -> dict[str, Any] | None:
    """The check-level diagnosis from its comparisons (Comparison objects); None when none failed.

    `first` is the earliest failed comparison (the likeliest root cause); its diagnosis names the
    check's, unless only some of the ranks failed ("partial")."""
    asserted = [c for c in comparisons if c.asserted]
    failed = [c for c in asserted if not c.passed]
    if not failed:
        return None
    first = first if first is not None else failed[0]
    if first.diagnosis and first.diagnosis.get("details", {}).get(FIRST_DIVERGENCE):
        return _first_divergence(first, failed)
    if first.diagnosis and first.diagnosis.get("details", {}).get("scope") == "row":
        return first.diagnosis  # already over every rank's comparisons (parity/restore.py): the check's own
    groups: dict[str, list[int]] = {}
    for c in asserted:
        g = groups.setdefault(c.group or group_of(c.name), [0, 0])
        g[1] += 1
        g[0] += 0 if c.passed else 1
    right = [g for g in GROUPS if g in groups and groups[g][0] == 0]
    wrong = [g for g in GROUPS if g in groups and groups[g][0] > 0]
    parts = [f"{g} right" for g in right] + [f"{g} wrong ({groups[g][0]}/{groups[g][1]})" for g in wrong]
    ranks_failed = sorted({c.rank for c in failed if c.rank is not None})
    ranks_all = sorted({c.rank for c in asserted if c.rank is not None})
    only_some = bool(ranks_failed) and len(ranks_failed) < len(ranks_all)
    if only_some:
        parts.append(f"only on {_names(ranks_failed, 'rank')} of {len(ranks_all)}")
    names = [c.diagnosis["name"] for c in failed if c.diagnosis]
    scales = sorted({c.diagnosis["details"].get("integer") for c in failed
                     if c.diagnosis and c.diagnosis["name"] == UNIFORM_SCALE} - {None})
    if scales:
        parts.append(f"scaled by {' / '.join(str(s) for s in scales)}"
                     + (" (the world size)" if scales == [world_size] else ""))
    if first.diagnosis:
        parts.append(f"first failure: rank {first.rank}: {first.name}: {first.diagnosis['name']}")
    elif first.note:  # a non-numeric assertion (keys, an exception, a grad_fn): its note says what broke
        parts.append(f"first failure: rank {first.rank}: {first.name}: {first.note}")
    first_name = first.diagnosis["name"] if first.diagnosis else FAILED_ASSERTION if first.note else UNEXPLAINED
    name = PARTIAL if only_some else first_name
    return {"name": name, "sentence": "; ".join(parts),
            "details": {"right": right, "wrong": wrong,
                        "groups": {g: {"failed": v[0], "total": v[1]} for g, v in groups.items()},
                        "ranks_failed": ranks_failed, "scales": scales,
                        "first": {"rank": first.rank, "name": first.name,
                                  "sentence": first.diagnosis["sentence"] if first.diagnosis else first.note},
                        "diagnoses": {n: names.count(n) for n in sorted(set(names))}}}


def _first_divergence(first: Any, failed: list) -> dict[str, Any]:
    """The check-level diagnosis of a check that named its first divergence (FIRST_DIVERGENCE): that
    mechanism, and every later failure marked as its consequence (counted by group, never as a cause)."""
    later = [c for c in failed if c is not first and not (c.diagnosis or {}).get("details", {}).get(FIRST_DIVERGENCE)]
    groups: dict[str, int] = {}
    for c in later:
        g = c.group or group_of(c.name)
        groups[g] = groups.get(g, 0) + 1
    sentence = first.diagnosis["sentence"]
    if later:
        by_group = ", ".join(f"{g} {groups[g]}" for g in GROUPS if g in groups)
        sentence += f"; {len(later)} other failed comparison(s) follow from it ({by_group}): consequences, not causes"
    details = dict(first.diagnosis.get("details", {}))
    return {"name": first.diagnosis["name"], "sentence": sentence,
            "details": {**details, "consequences": len(later), "consequence_groups": groups,
                        "first": {"rank": first.rank, "name": first.name, "sentence": first.diagnosis["sentence"]}}}

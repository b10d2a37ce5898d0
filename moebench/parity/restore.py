"""What a resumed run restored: for every expert slot and every piece of state, which expert's it holds.

A resume check loads a checkpoint into a model built from a *different* seed, then compares each
piece of restored state with the uninterrupted run's in the same layout (a correct resume matches it
bit for bit). A mismatch is explained, not just counted:
- the slot holds ANOTHER expert's state (a permutation: wrong rank's file, wrong index map);
- the slot still holds the fresh initialisation (never restored);
- neither: unexplained.
`diagnose_restore` turns the findings of a row into one diagnosis: not-restored, permutation or
split-restore (module weights right while masters / optimizer state are wrong, so the resumed run's
first loss looks right and the damage starts at the next optimizer step), naming the quantity and the
global expert indices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

import torch

from moebench.parity.compare import Comparison  # @PASTED@ (a script that pastes this file never makes one)

WEIGHTS = "weights"
FP32_MASTER = "fp32 master"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
STEP = "step"
QUANTITIES = (WEIGHTS, FP32_MASTER, EXP_AVG, EXP_AVG_SQ, STEP)
"""Restored state, in the order a diagnosis names it."""
OPTIMIZER_STATE = (FP32_MASTER, EXP_AVG, EXP_AVG_SQ, STEP)
"""What a split restore gets wrong while the module weights are right."""

NOT_RESTORED = "not-restored"
PERMUTATION = "permutation"
SPLIT_RESTORE = "split-restore"
UNEXPLAINED = "restore-unexplained"
REFUSED = "refused"
"""The library refused the load: its own verdict, with the library's message."""

RIGHT, HOLDS, FRESH, UNKNOWN = "right", "holds", "fresh", "unknown"
MAX_LISTED = 6
"""Slots named one by one in a sentence; the rest are counted."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slot:
    """Where a unit of state lives after the load: an expert slot on a rank, or a dense parameter."""

    rank: int
    """The rank that holds the slot."""
    local: int | None
    """The local expert slot on that rank (None for a dense / gate parameter)."""
    unit: int | str
    """What the slot should hold: a global expert index, or a dense parameter's name."""

    def where(self) -> str:
        if self.local is None:
            return f"rank {self.rank}, {self.unit}"
        return f"rank {self.rank}, local slot {self.local}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finding:
    """What one slot holds of one quantity after the load."""

    slot: Slot
    quantity: str
    """One of QUANTITIES."""
    state: str
    """RIGHT (what it should hold), HOLDS (another unit's), FRESH (the fresh initialisation) or UNKNOWN."""
    holds: int | str | None = None
    """For HOLDS: the unit whose state the slot holds."""
    max_abs_diff: float = 0.0
    """Largest |got - expected| (0 when right)."""

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.slot), "quantity": self.quantity, "state": self.state,
                "holds": self.holds, "max_abs_diff": self.max_abs_diff}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal: a correct resume in the same layout copies state, it never recomputes it."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return a.shape == b.shape and bool(torch.equal(a.detach().cpu().double(), b.detach().cpu().double()))


def identify(slot: Slot, quantity: str, got: Any, want: Mapping[int | str, Any],
             fresh: Any = None) -> Finding:
    """What `got` (the slot's `quantity` after the load) is: `want[slot.unit]`, another unit's `want`,
    the fresh initialisation `fresh`, or none of them. `want` maps every unit of the reference (the
    uninterrupted run, same layout) to its state; every unit is a candidate for a permutation."""
    expected = torch.as_tensor(want[slot.unit])
    got_t = torch.as_tensor(got)
    if _same(got_t, expected):
        return Finding(slot=slot, quantity=quantity, state=RIGHT)
    diff = float((got_t.double() - expected.double()).abs().max()) if got_t.shape == expected.shape else float("inf")
    for unit, candidate in want.items():
        if unit != slot.unit and _same(got_t, candidate):
            # a fresh slot that happens to equal another expert's initial weights is still "fresh" below,
            # unless the reference itself holds that state (then it IS that expert's)
            return Finding(slot=slot, quantity=quantity, state=HOLDS, holds=unit, max_abs_diff=diff)
    if fresh is not None and _same(got_t, fresh):
        return Finding(slot=slot, quantity=quantity, state=FRESH, max_abs_diff=diff)
    return Finding(slot=slot, quantity=quantity, state=UNKNOWN, max_abs_diff=diff)


def _units(units: Iterable[int | str]) -> str:
    """ "expert 2", "experts 2, 4 and 3 more", or parameter names."""
    units = sorted(set(units), key=lambda u: (isinstance(u, str), u))
    shown = ", ".join(str(u) for u in units[:MAX_LISTED])
    more = f" and {len(units) - MAX_LISTED} more" if len(units) > MAX_LISTED else ""
    if not all(isinstance(u, int) for u in units):
        return shown + more
    return f"expert{'s' if len(units) > 1 else ''} {shown}{more}"


def _qualities(findings: list[Finding]) -> str:
    qs = [q for q in QUANTITIES if any(f.quantity == q for f in findings)]
    return ", ".join(qs[:-1]) + (" and " if len(qs) > 1 else "") + qs[-1]


def _holds_sentences(wrong: list[Finding]) -> list[str]:
    """One clause per slot that holds another unit's state: "rank 1, local slot 0 holds global expert
    4's fp32 master and exp_avg; it should hold expert 2"."""
    by_slot: dict[tuple[Slot, int | str], list[Finding]] = {}
    for f in wrong:
        if f.state == HOLDS:
            by_slot.setdefault((f.slot, f.holds), []).append(f)
    out = []
    for (slot, holds), fs in sorted(by_slot.items(), key=lambda kv: (kv[0][0].rank, str(kv[0][0].local),
                                                                       str(kv[0][0].unit))):
        what = f"global expert {holds}'s" if isinstance(holds, int) else f"{holds}'s"
        should = f"expert {slot.unit}" if isinstance(slot.unit, int) else str(slot.unit)
        out.append(f"{slot.where()} holds {what} {_qualities(fs)}; it should hold {should}")
    return out


def diagnose_restore(findings: list[Finding]) -> dict[str, Any] | None:
    """One diagnosis {name, sentence, details} for a row's findings (every rank's: details["scope"] is "row", so
    the runner takes it whole as the check's diagnosis); None when everything was restored.

    The name, by what a maintainer must fix first: not-restored (a slot never loaded) > permutation
    (a slot holds another expert's state) > split-restore (weights right, the rest wrong in no
    recognisable way) > restore-unexplained."""
    wrong = [f for f in findings if f.state != RIGHT]
    if not wrong:
        return None
    weights_right = all(f.state == RIGHT for f in findings if f.quantity == WEIGHTS)
    fresh = [f for f in wrong if f.state == FRESH]
    holds = [f for f in wrong if f.state == HOLDS]
    parts = []
    if fresh:
        parts.append(f"{_units(f.slot.unit for f in fresh)}: {_qualities(fresh)} "
                     "still the fresh initialisation (never restored)")
    shown = _holds_sentences(holds)
    parts += shown[:MAX_LISTED] + ([f"{len(shown) - MAX_LISTED} more slots hold another expert's state"]
                                   if len(shown) > MAX_LISTED else [])
    unknown = [f for f in wrong if f.state == UNKNOWN]
    if unknown:
        parts.append(f"{_units(f.slot.unit for f in unknown)}: {_qualities(unknown)} wrong "
                     f"(max |diff| {max(f.max_abs_diff for f in unknown):.3g}) and like no expert's state")
    if weights_right and any(f.quantity in OPTIMIZER_STATE for f in wrong):
        parts.append("the module weights are right, so the first resumed loss looks right and the damage "
                     "starts at the next optimizer step")
    name = NOT_RESTORED if fresh else PERMUTATION if holds else SPLIT_RESTORE if weights_right else UNEXPLAINED
    return {"name": name, "sentence": "; ".join(parts),
            "details": {"scope": "row", "weights_right": weights_right, "findings": [f.to_dict() for f in wrong],
                        "experts": sorted({f.slot.unit for f in wrong if isinstance(f.slot.unit, int)})}}


def as_comparison(finding: Finding, name: str, *, diagnosis: dict[str, Any] | None = None) -> Comparison:
    """A Finding as the parity runner's record (an exact comparison): passes when RIGHT. A failed one
    carries `diagnosis` (the row's, from diagnose_restore) so the check names the mechanism."""
    passed = finding.state == RIGHT
    note = "" if passed else (f"holds {finding.holds}'s {finding.quantity}" if finding.state == HOLDS
                              else f"{finding.quantity} is the fresh initialisation" if finding.state == FRESH
                              else f"{finding.quantity} like no expert's")
    if not passed:
        note += f" (max |diff| {finding.max_abs_diff:.3g} from what it should hold)"
    # No max_abs_diff field: the record's numbers (max rel diff, magnitude) belong to numeric comparisons; the
    # runner describes a comparison without them by its note.
    return Comparison(name=name, passed=passed, rank=finding.slot.rank, kind="equal", rtol=0.0, atol=0.0,
                      tolerance_source="exact equality (same layout)", note=note,
                      diagnosis=None if passed else diagnosis)

"""What a failed check is finally named, over its comparisons and its runs: NaN is never noise, and a failure that two
runs with the same seed do not agree on is nondeterministic (the parity runner asks both)."""

from __future__ import annotations

from typing import Any

from moebench.parity.compare import Comparison
from moebench.parity.diagnosis import (
    BF16_NOISE,
    EMULATED_PIECE,
    FP16_NOISE,
    NON_FINITE,
    NONDETERMINISTIC,
    PARTIAL,
    UNEXPLAINED,
    make,
)

NOISE_NAMES = (BF16_NOISE, FP16_NOISE, UNEXPLAINED)
"""Row diagnoses that say "no mechanism, only distance": a NaN or Inf behind one of them is named non-finite."""


def never_noise(diagnosis: dict | None, failed: list[Comparison]) -> dict | None:
    """A failure with NaN or Inf in it is `non-finite`, whatever precision the row ran in: low-precision noise is a
    distance, and NaN is no distance (DeepSpeed 0.15/0.16's fp16 rows at W = 4 read fp16-noise "distance from fp32
    nan" before)."""
    if diagnosis is None or diagnosis["name"] not in NOISE_NAMES:
        return diagnosis
    bad = next((c for c in failed if not c.finite), None)
    if bad is None:
        return diagnosis
    return make(NON_FINITE, f"NaN or Inf on rank {bad.rank}: {bad.name}" + (f" ({bad.note})" if bad.note else "")
                + f"; never {diagnosis['name']}", was=diagnosis["name"], rank=bad.rank, comparison=bad.name)


def on_emulated(diagnosis: dict | None, failed: list[Comparison], emulated: list[dict] | None) -> dict | None:
    """A failure a piece the row emulates could have produced is a question, never the library's bug: the first
    piece (spec.Emulated, in the row's labels) whose groups hold a failed comparison and whose mechanisms hold the
    diagnosis names it, keeping the diagnosis it would otherwise carry (`was`)."""
    if diagnosis is None or not emulated:
        return diagnosis
    for piece in emulated:
        touched = next((c for c in failed if c.group in piece["groups"]), None)
        if touched is not None and diagnosis["name"] in piece["mechanisms"]:
            return make(EMULATED_PIECE, f"a question, not the library's bug: {diagnosis['name']} on rank "
                        f"{touched.rank}'s {touched.name}, which {piece['piece']} feeds, a piece this row runs in "
                        f"moebench's code ({diagnosis['sentence']})", piece=piece["piece"], was=diagnosis)
    return diagnosis


RERUN_NAMES = (UNEXPLAINED, NON_FINITE, PARTIAL)
"""A row that fails with one of these is run once more with the same seed: runs that differ are named
nondeterministic (transformers 5.16's grouped_mm reads its uninitialised sentinel rows)."""


def nondeterminism(first: Any, second: Any) -> dict | None:
    """The diagnosis of two runs of one check (runner.CheckRecord each) that differ (None when they agree comparison
    for comparison)."""
    def signature(record) -> list:
        return [(c["name"], c["rank"], c["passed"], repr(c.get("max_abs_diff"))) for c in record.comparisons]

    if first.status == second.status and signature(first) == signature(second):
        return None
    name1 = (first.diagnosis or {}).get("name", first.status)
    name2 = (second.diagnosis or {}).get("name", second.status)
    differ = next(((a[0], a[1]) for a, b in zip(signature(first), signature(second)) if a != b), None)
    where = f"; first difference: rank {differ[1]}: {differ[0]}" if differ else ""
    return make(NONDETERMINISTIC, f"two runs with the same seed differ: the first read {name1}, the second {name2}"
                f"{where} (uninitialised memory or a race in the code under test)",
                runs=[first.diagnosis, second.diagnosis], statuses=[first.status, second.status])

"""The comparison record every parity check produces, and the tolerances it is judged by.

`compare(name, actual, expected, tol)` returns a `Comparison`: the largest absolute and relative
difference, the tolerance actually applied, the largest magnitude compared, whether it passed,
and whether the assertion was *vacuous* - i.e. an all-zero answer would have passed it
(atol >= (1 - rtol) * magnitude). NaN or Inf in either tensor never passes.

Two tolerance modes:
- "strict" (default): gradients and outputs are judged relative to their own magnitude
  (atol = ATOL_FRACTION * largest |expected|), so the assertion keeps its power whatever the scale.
- "seed": the tolerances the seed documents use, exactly (torch.allclose defaults where a seed
  calls allclose without arguments).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

TOLERANCE_MODES = ("strict", "seed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tolerance:
    """|actual - expected| <= atol + rtol * |expected| elementwise,
    with atol = atol_abs + atol_fraction * magnitude."""

    rtol: float
    """Relative tolerance per element."""
    atol_abs: float = 0.0
    """Absolute tolerance, as a fixed number."""
    atol_fraction: float = 0.0
    """Absolute tolerance as a fraction of the largest |expected| (scale-free)."""
    source: str = ""
    """Where the numbers come from (a seed file, or why a strict constant has its size)."""

    def __post_init__(self) -> None:
        if self.rtol < 0 or self.atol_abs < 0 or self.atol_fraction < 0:
            raise ValueError("tolerances must be >= 0")

    def atol_for(self, magnitude: float) -> float:
        return self.atol_abs + self.atol_fraction * magnitude


# ------------------------------------------------------------------ strict constants
# Distributed float32 results differ from one process only by summation order. Worst measured
# here (all checks, 1-16 ranks): 1.4e-6 absolute on values up to ~10, i.e. ~1.5e-7 of the
# magnitude. 1e-5 leaves ~60x margin and is still 10^4 times below a 10 % error.
STRICT_RTOL = 1e-5
# Elements near zero get an absolute floor of 1e-5 of the largest element (not of 1.0), so the
# floor shrinks with the tensor: a gradient of size 1e-3 gets atol 1e-8, never a vacuous 1e-2.
STRICT_ATOL_FRACTION = 1e-5
STRICT = Tolerance(rtol=STRICT_RTOL, atol_fraction=STRICT_ATOL_FRACTION,
                   source="strict: 1e-5 relative, atol 1e-5 x largest |expected|")
# Adam divides by sqrt(v): a 1e-7 gradient difference where v ~ 0 moves a parameter by up to lr.
# Same numbers as STRICT, kept apart so Adam's drift can be judged on its own: after 10 steps of
# lr 1e-3 the worst measured drift is 1.2e-7 on parameters of size ~0.6 (9 ranks).
STRICT_ADAM = Tolerance(rtol=1e-5, atol_fraction=1e-5,
                        source="strict: 1e-5 relative, atol 1e-5 x largest |expected| (Adam, 10 steps)")
# A scalar that is a mean of terms of both signs (a loss such as mean(y * w)) can cancel to 1e-5 of its terms,
# while float32 sums it with an error of ~1e-7 of the terms: a floor relative to the cancelled result fails on a
# machine whose kernels sum in another order (fairscale's W = 4 loss: 1.2e-5, off by 1.4e-9). `of_terms` gives
# such a scalar its floor from the terms' mean magnitude instead.


def of_terms(tol: Tolerance, terms_magnitude: float) -> Tolerance:
    """`tol` for a scalar that is a mean of terms whose mean |term| is `terms_magnitude`: the absolute floor
    (atol_fraction) scales with the terms, not with the cancelled result; rtol is unchanged."""
    return dataclasses.replace(tol, atol_abs=tol.atol_abs + tol.atol_fraction * terms_magnitude,
                               source=f"{tol.source}; floor from the mean |term| ({terms_magnitude:.3g})")


# Exact equality: state_dict copies and broadcasts must be bit-identical.
EXACT = Tolerance(rtol=0.0, atol_abs=0.0, source="exact equality")

# ------------------------------------------------------------------ the seeds' own tolerances
# torch.allclose(a, b) with no arguments (003 test_c10d_spawn_gloo, 000 assert.py outputs).
SEED_ALLCLOSE_DEFAULT = Tolerance(rtol=1e-5, atol_abs=1e-8, source="torch.allclose defaults (seed)")
# 001 test_replicate _compare_module: assertEqual(i, j, rtol=1.3e-06, atol=5e-5).
SEED_REPLICATE = Tolerance(rtol=1.3e-6, atol_abs=5e-5, source="001 test_replicate: rtol 1.3e-6, atol 5e-5")
# 000 assert.py: first expert's weight grad allclose(atol=1e-2) (rtol left at its 1e-5 default).
SEED_EXPERTS_GRAD = Tolerance(rtol=1e-5, atol_abs=1e-2, source="000 assert.py: allclose(atol=1e-2)")
# 001 test_replicate _check_state_dict_parity: assertEqual on tensors (exact for equal dtypes
# after a copy; assertEqual's float32 default would be rtol 1.3e-6, atol 1e-5).
SEED_STATE_DICT = Tolerance(rtol=1.3e-6, atol_abs=1e-5, source="001 test_replicate: assertEqual float32 defaults")
# DeepSpeed's own MoE tests compare with rtol 1e-4.
SEED_DEEPSPEED = Tolerance(rtol=1e-4, atol_abs=1e-8, source="DeepSpeed tests/unit/moe: rtol 1e-4")


@dataclasses.dataclass(kw_only=True)
class Comparison:
    """One assertion inside a check, as measured on one rank."""

    name: str
    """What was compared, e.g. "step 1: expert 3 fc2.weight grad"."""
    passed: bool
    rank: int | None = None
    """The rank whose result was compared (None: filled in with the rank that compared it)."""
    kind: str = "allclose"
    """"allclose" (values agree), "differ" (values must NOT agree), "equal" (exact/structural) or "raises"."""
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    """max |a - e| / |e| over elements where |e| > 0."""
    rtol: float | None = None
    atol: float | None = None
    """The absolute tolerance actually applied (atol_abs + atol_fraction * magnitude)."""
    magnitude: float | None = None
    """Largest |expected| compared."""
    vacuous: bool = False
    """True when an all-zero `actual` would pass too: the tolerance is not below the magnitude.
    Always True for an unasserted comparison: its tolerance is, in effect, infinite."""
    finite: bool = True
    """False when actual or expected holds NaN / Inf (then passed is False)."""
    asserted: bool = True
    """False for comparisons reported for information only (e.g. in seed mode, what the seed never asserted)."""
    tolerance_source: str = ""
    note: str = ""
    diagnosis: dict | None = None
    """For a failed numeric comparison: {name, sentence, details} naming the bug class (diagnose.py)."""
    group: str = ""
    """The parameter group compared (diagnosis.GROUPS), set where the comparison is made; "" leaves it to the
    built-in checks' naming convention (diagnose.group_of)."""
    used: float | None = None
    """For a judged assertion with a number behind it (the noise model's distance over its allowance): the share
    of the allowance used (> 1 fails); None for the others (a tolerance's share comes from the fields above)."""

    def __post_init__(self) -> None:
        if not self.asserted:
            self.vacuous = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def ratio(self) -> float:
        """How much of the allowed error was used (> 1 fails); for ranking comparisons."""
        if self.max_abs_diff is None or self.atol is None:
            return 0.0 if self.passed else math.inf
        allowed = self.atol + (self.rtol or 0.0) * (self.magnitude or 0.0)
        return self.max_abs_diff / allowed if allowed > 0 else (0.0 if self.max_abs_diff == 0 else math.inf)


def _to_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64)
    return torch.as_tensor(x, dtype=torch.float64)


def compare(name: str, actual: Any, expected: Any, tol: Tolerance, *, rank: int | None = None,
            asserted: bool = True, expect_equal: bool = True, note: str = "", world_size: int | None = None,
            alternatives: dict[str, Any] | None = None, group: str = "") -> Comparison:
    """Compare `actual` against `expected` (the reference). `expect_equal=False` asserts they DIFFER.

    A failed (or, unasserted, out-of-tolerance) equality gets a `diagnosis` (diagnose.py); `alternatives`
    are tensors a known-wrong implementation would produce (e.g. {"local slice": ...}), named on a match.
    `world_size` (default: the initialised process group's) names a scale of exactly the world size as such;
    `group` is the parameter group compared (diagnosis.GROUPS)."""
    c = _compare(name, actual, expected, tol, rank=rank, asserted=asserted, expect_equal=expect_equal, note=note)
    c.group = group
    if expect_equal and not c.passed:
        from moebench.parity.diagnose import diagnose

        c.diagnosis = diagnose(actual, expected, atol=c.atol or 0.0, rtol=tol.rtol,
                               world_size=world_size if world_size is not None else _world_size(),
                               alternatives=alternatives)
    return c


def _world_size() -> int | None:
    """The initialised default process group's size (every rank function runs inside one), else None."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def _compare(name: str, actual: Any, expected: Any, tol: Tolerance, *, rank: int | None,
             asserted: bool, expect_equal: bool, note: str) -> Comparison:
    a, e = _to_tensor(actual), _to_tensor(expected)
    base = dict(name=name, rank=rank, asserted=asserted, tolerance_source=tol.source, rtol=tol.rtol)
    if a.shape != e.shape:
        return Comparison(**base, passed=False, kind="allclose" if expect_equal else "differ",
                          note=f"shape {tuple(a.shape)} != expected {tuple(e.shape)}. {note}".strip())
    finite = bool(torch.isfinite(a).all() and torch.isfinite(e).all())
    magnitude = float(e.abs().max()) if e.numel() and finite else 0.0
    atol = tol.atol_for(magnitude)
    if not finite:
        return Comparison(**base, kind="allclose" if expect_equal else "differ", passed=False, finite=False,
                          atol=atol, magnitude=magnitude, note=f"NaN or Inf present. {note}".strip())
    diff = (a - e).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    nz = e.abs() > 0
    max_rel = float((diff[nz] / e.abs()[nz]).max()) if bool(nz.any()) else (0.0 if max_abs == 0 else math.inf)
    within = bool((diff <= atol + tol.rtol * e.abs()).all())
    if expect_equal:
        # An all-zero answer would pass iff max|e| <= atol + rtol * max|e|.
        vacuous = atol >= (1.0 - tol.rtol) * magnitude
        return Comparison(**base, kind="allclose", passed=within, max_abs_diff=max_abs, max_rel_diff=max_rel,
                          atol=atol, magnitude=magnitude, vacuous=vacuous, note=note)
    return Comparison(**base, kind="differ", passed=not within, max_abs_diff=max_abs, max_rel_diff=max_rel,
                      atol=atol, magnitude=magnitude, note=note)


def assertion(name: str, passed: bool, *, rank: int | None = None, kind: str = "equal", note: str = "",
              asserted: bool = True, group: str = "", used: float | None = None) -> Comparison:
    """A non-numeric assertion (keys equal, an exception raised with the right message); `used`: the share of
    an allowance it used, when a number decided it (Comparison.used)."""
    return Comparison(name=name, passed=bool(passed), rank=rank, kind=kind, note=note, asserted=asserted, group=group,
                      used=used)


def pick(mode: str, *, strict: Tolerance, seed: Tolerance | None) -> tuple[Tolerance, bool]:
    """The tolerance for `mode`, and whether the comparison is asserted in that mode.

    In seed mode a comparison the seed never made (seed=None) is reported but not asserted."""
    if mode == "seed":
        return (seed, True) if seed is not None else (strict, False)
    return strict, True

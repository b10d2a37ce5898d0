"""The record every probe returns, and the report that collects them."""

from __future__ import annotations

import dataclasses
from typing import Any

from moebench.status import FAIL, OK, SKIP, STATUSES, WARN  # noqa: F401 - every probe names them from here

SCHEMA = "moebench.env-check/1"
"""Bumped when a field of the JSON document changes meaning or disappears."""

# Display order of the sections; a check names its section by one of these strings.
PLATFORM = "Platform"
TORCH_CUDA = "PyTorch and CUDA"
COMM = "Communication"
PROBE = "Collective probe"
DEEPSPEED = "DeepSpeed"
FASTMOE = "fastmoe"
FRAMEWORKS = "MoE frameworks (verify-parity --library)"
REFERENCE = "Chapter's reference stack"
CAPABILITIES = "What can run here"
SECTIONS = (PLATFORM, TORCH_CUDA, COMM, PROBE, DEEPSPEED, FASTMOE, FRAMEWORKS, REFERENCE, CAPABILITIES)


@dataclasses.dataclass(kw_only=True)
class Check:
    """One item of the report."""

    id: str
    """Stable dotted name, e.g. "cuda.nvcc"; scripts and tests key on it."""
    section: str
    """One of SECTIONS."""
    title: str
    """Short human label for the table."""
    status: str
    """ok / warn / fail / skip (skip: does not apply here, with the reason in `found`)."""
    found: str
    """What was found, in words."""
    required: str = ""
    """What is required, and why."""
    hint: str = ""
    """A one-line fix ("" when nothing needs fixing)."""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Machine-readable facts behind `found` (versions as strings, paths, counts)."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check {self.id}: status {self.status!r} not in {STATUSES}")
        if self.section not in SECTIONS:
            raise ValueError(f"check {self.id}: section {self.section!r} not in {SECTIONS}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(kw_only=True)
class Report:
    """Every check of one env-check run, in section order."""

    checks: list[Check]
    mode: str
    """"full" (run_all) or "summary" (the fast subset stored with every training run)."""
    created: str
    """ISO-8601 UTC time the run started."""
    elapsed_s: float
    """Rounded to the millisecond once, here, so the console's summary line and envcheck.json never round the
    same run's time to different tenths (0.0495 s printed 0.0 beside a saved 0.05 that reads 0.1)."""
    probe: dict[str, Any]
    """{"enabled": bool, "timeout_s": float}."""
    moebench_version: str
    hostname: str
    results_path: str | None = None
    """Where the CLI saved this document (set by the CLI, None otherwise)."""

    def __post_init__(self) -> None:
        self.elapsed_s = round(self.elapsed_s, 3)

    def get(self, check_id: str) -> Check | None:
        return next((c for c in self.checks if c.id == check_id), None)

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in STATUSES}

    @property
    def status(self) -> str:
        """The worst status present: fail > warn > ok (skips alone count as ok)."""
        counts = self.counts()
        return FAIL if counts[FAIL] else WARN if counts[WARN] else OK

    def exit_code(self, strict: bool = False) -> int:
        """0 when nothing failed (and, with strict, nothing warned); 1 otherwise."""
        counts = self.counts()
        return 1 if counts[FAIL] or (strict and counts[WARN]) else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "mode": self.mode,
            "moebench_version": self.moebench_version,
            "created": self.created,
            "hostname": self.hostname,
            "elapsed_s": round(self.elapsed_s, 3),
            "probe": self.probe,
            "status": self.status,
            "counts": self.counts(),
            "sections": [s for s in SECTIONS if any(c.section == s for c in self.checks)],
            "checks": [c.to_dict() for c in self.checks],
            "results_path": self.results_path,
        }


MAX_PROBE_TIMEOUT_S = 3600.0
"""--probe-timeout's upper bound: an hour is far beyond any NCCL init; more is a typo."""


def _probe_timeout_bound():
    from moebench.bounds import Number

    return Number(integer=False, min=0, above=True, max=MAX_PROBE_TIMEOUT_S, why="1 h")


PROBE_TIMEOUT_BOUND = _probe_timeout_bound()
"""--probe-timeout's bound (moebench.bounds), read by the CLI and by require_probe_timeout."""


def require_probe_timeout(seconds: object) -> None:
    """UserError unless `seconds` is a number in (0, MAX_PROBE_TIMEOUT_S] (checked before torch loads)."""
    import math

    from moebench.errors import UserError

    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise UserError(f"must be a number of seconds, got {seconds!r}", flag="--probe-timeout")
    from moebench import bounds

    bounds.check(PROBE_TIMEOUT_BOUND, seconds, "--probe-timeout")  # the same message as the CLI's
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_PROBE_TIMEOUT_S):
        raise UserError(f"must be in (0, {MAX_PROBE_TIMEOUT_S:.0f}] seconds, got {seconds:g}", flag="--probe-timeout")

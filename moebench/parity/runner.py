"""Run parity checks: one `launch` per check, each under its own deadline; then the audit.

The audit turns per-rank comparison lists into one record per check:
- "pass": every rank returned, >= 1 asserted comparison, all asserted comparisons passed;
- "fail": a comparison failed, a rank raised / hung / died, or nothing was asserted;
- "skip": world size outside the check's range, a missing requirement, or the check said so;
- "refused": the library refused what the check asked (registry.Refused), with its message: a
  documented limitation, which does not by itself fail the run.
Vacuous comparisons (tolerance not below magnitude, or not asserted at all) are counted and
flagged, never hidden. A run in which no check passed is a failed run ("no check ran").
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from moebench import signals
from moebench.config import COMM_BACKENDS, require_choice, require_launch_env, require_seed, require_world_size
from moebench.distributed.launch import launch, local_world_size, resolve_backend, sigterm_as_interrupt, under_torchrun
from moebench.errors import Interrupted, UserError
from moebench.parity.compare import TOLERANCE_MODES, Comparison
from moebench.parity.diagnose import summarise
from moebench.parity.diagnosis import REFUSED, make
from moebench.parity.final import RERUN_NAMES, never_noise, nondeterminism, on_emulated
from moebench.parity.raised import AdapterProtocolError, failure_diagnosis, not_comparisons
from moebench.parity.registry import Check, CheckOptions, Refused, SkipCheck, all_checks, load_all, parse_impls, select
from moebench.preload import import_present
from moebench.results import STATUS_FAILED, STATUS_INTERRUPTED, STATUS_OK, RunDir

DEFAULT_TIMEOUT_S = 120.0
# --seed takes every command's range (0 to 2**63-1); the checks derive per-rank / per-step seeds as
# seed * 10_000 + offset, which must still fit torch's 64-bit generator seed, so they see seed mod 2**32.
CHECK_SEED_MODULUS = 2**32
# Under torchrun the job has ONE default group for every check. On NCCL it carries both backends,
# so CPU-only checks run over gloo and CUDA tensors over NCCL in the same job.
TORCHRUN_NCCL_BACKEND = "cpu:gloo,cuda:nccl"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParityConfig:
    """A verify-parity run, validated before anything starts."""

    world_size: int = 4
    """Ranks to start (ignored under torchrun, where WORLD_SIZE decides)."""
    checks: tuple[str, ...] = ()
    """Names of the checks to run (empty: all)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Deadline of each check, seconds; the process-group timeout is shorter."""
    comm_backend: str = "auto"
    """"auto" (NCCL with enough GPUs, else gloo), "gloo" or "nccl"."""
    tolerance: str = "strict"
    """"strict" or "seed"."""
    impls: dict[str, str] = dataclasses.field(default_factory=dict)
    """--impl overrides (validated: each imports)."""
    debug_collectives: bool = False
    """Set TORCH_DISTRIBUTED_DEBUG=DETAIL in every rank."""
    seed: int = 0
    """Base random seed, 0 <= seed < 2**63 (the checks use it modulo 2**32)."""

    def __post_init__(self) -> None:
        if not under_torchrun():
            require_world_size(self.world_size)
        if not self.timeout_s > 0 or not math.isfinite(self.timeout_s):
            raise UserError(f"must be a positive number of seconds, got {self.timeout_s}", flag="--timeout")
        require_choice(self.comm_backend, COMM_BACKENDS, "--comm-backend")
        if self.comm_backend == "nccl" and not torch.cuda.is_available():
            raise UserError("nccl needs CUDA GPUs and none is visible; use --comm-backend gloo (or auto)",
                            flag="--comm-backend")
        if self.tolerance not in TOLERANCE_MODES:
            raise UserError(f"must be one of {', '.join(TOLERANCE_MODES)}, got {self.tolerance!r}", flag="--tolerance")
        require_seed(self.seed)
        if self.impls:  # an --impl no selected check uses would be silently ignored
            selected = select(list(self.checks) or None)
            used = {key for check in selected for key in check.impl_keys}
            unused = [key for key in self.impls if key not in used]
            if unused:
                users = [c.name for c in all_checks() if set(unused) & set(c.impl_keys)]
                raise UserError(f"no selected check uses {', '.join(unused)} (used by: "
                                f"{', '.join(users) or 'no registered check'}); add one to --checks "
                                "or drop the --impl", flag="--impl")


def parity_config(*, world_size: int = 4, checks: str | Sequence[str] | None = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S, comm_backend: str = "auto", tolerance: str = "strict",
                  impls: Sequence[str] | Mapping[str, str] = (), debug_collectives: bool = False,
                  seed: int = 0) -> ParityConfig:
    """A validated ParityConfig from what the CLI and the Python API take: `checks` as names or one
    comma-separated string (None: all), `impls` as "KEY=module:attr" strings or {KEY: "module:attr"}
    (each imported in a child process first). Bad input is a UserError naming the flag."""
    if checks is None:
        names: tuple[str, ...] = ()
    else:
        parts = checks.split(",") if isinstance(checks, str) else list(checks)
        if not all(isinstance(n, str) for n in parts):
            raise UserError(f"names checks by their names (strings), got {checks!r}", flag="--checks")
        names = tuple(n.strip() for n in parts if n.strip())
        if not names:
            raise UserError("names no check; give check names (see --list) or leave the flag out", flag="--checks")
    specs = [f"{key}={target}" for key, target in impls.items()] if isinstance(impls, Mapping) else list(impls)
    return ParityConfig(world_size=world_size, checks=names, timeout_s=timeout_s, comm_backend=comm_backend,
                        tolerance=tolerance, impls=parse_impls(specs, timeout_s=timeout_s),
                        debug_collectives=debug_collectives, seed=seed)


@dataclasses.dataclass(kw_only=True)
class CheckRecord:
    """One check's outcome: what the table and summary.json show."""

    name: str
    status: str  # pass / fail / skip / refused
    seed_source: str
    description: str
    catches: str
    """The check's one line on the defect it would catch (Check.catches), so a report built from
    summary.json alone can show it."""
    world_size: int
    elapsed_s: float
    reason: str = ""
    """Why it failed or skipped (failed comparisons, a rank's traceback, stuck ranks' stacks)."""
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    tolerance: str = ""
    """The tolerance of the comparison that came closest to failing, as text."""
    rtol: float | None = None
    atol: float | None = None
    """rtol / applied atol of that comparison (each comparison's own are in `comparisons`)."""
    magnitude: float | None = None
    """Largest magnitude compared over all numeric comparisons."""
    comparisons_total: int = 0
    comparisons_failed: int = 0
    vacuous: int = 0
    """How many comparisons were vacuous: an all-zero answer would have passed them. Includes every
    unasserted comparison (seed mode: what the seed never asserts has, in effect, an infinite tolerance)."""
    unasserted: int = 0
    """Comparisons reported but not asserted (seed mode); each is also counted in `vacuous`."""
    unasserted_outside: int = 0
    """Comparisons reported but not asserted (seed mode) that are outside their tolerance."""
    launch_status: str = ""
    backend: str = ""
    """The backend this check ran on (CPU-only checks use gloo even where "auto" picks NCCL)."""
    comparisons: list[dict] = dataclasses.field(default_factory=list)
    diagnosis: dict | None = None
    """For a failed check: {name, sentence, details} summarised by parameter group and rank
    (e.g. "output right; gate/router wrong (1/1)"); each failed comparison has its own."""
    user_impls: dict[str, str] = dataclasses.field(default_factory=dict)
    """The implementations this check tested that are the user's (--impl), not moebench's:
    {key: "module:attribute"}. Empty: moebench's own code was tested."""

    labels: dict = dataclasses.field(default_factory=dict)
    """The check's labels (Check.labels), e.g. a library row's library / version / model."""


def _rank_entry(ctx, check_name: str, opts: CheckOptions) -> dict:
    """Runs inside each rank: one check's rank function, its comparisons as plain dicts."""
    check = load_all()[check_name]
    try:
        comparisons = check.rank_fn(ctx, opts)
    except SkipCheck as exc:
        return {"skip": str(exc) or "skipped by the check"}
    except Refused as exc:
        return {"refused": str(exc) or "refused by the library"}
    got = not_comparisons(comparisons)
    if got:
        raise AdapterProtocolError(f"check {check_name} returned {got}; it must return a list of comparisons "
                                   "(moebench.parity.compare.compare(...))")
    out = []
    for c in comparisons:
        if c.rank is None:
            c.rank = ctx.rank
        out.append(c.to_dict())
    return {"comparisons": out}


def _audit(check: Check, result, world_size: int) -> CheckRecord:
    base = dict(name=check.name, seed_source=check.seed_source, description=check.description,
                catches=check.catches, world_size=world_size, elapsed_s=result.elapsed_s,
                launch_status=result.status, backend=result.backend, labels=dict(check.labels))
    if not result.ok:
        return CheckRecord(**base, status="fail", reason=result.describe(), diagnosis=failure_diagnosis(result))
    skips = [r["skip"] for r in result.returns if r and "skip" in r]
    if skips:
        return CheckRecord(**base, status="skip", reason=skips[0])
    refusals = [r["refused"] for r in result.returns if r and "refused" in r]
    if refusals:
        return CheckRecord(**base, status="refused", reason=refusals[0], diagnosis=make(REFUSED, refusals[0]))
    indexed = [(i, Comparison(**c)) for r in result.returns for i, c in enumerate(r["comparisons"])]
    comps = [c for _, c in indexed]
    order = {id(c): i for i, c in indexed}  # position in its rank's list (sorted() keeps rank order on ties)
    asserted = [c for c in comps if c.asserted]
    failed = [c for c in asserted if not c.passed]
    # Maxima over what was asserted; "differ" assertions WANT a large difference, so they stay out.
    numeric = [c for c in asserted if c.max_abs_diff is not None and c.kind != "differ"]
    unasserted_outside = sum(1 for c in comps if not c.asserted and not c.passed)
    worst = max(asserted, key=Comparison.ratio, default=None)
    record = CheckRecord(
        **base, status="pass" if asserted and not failed else "fail",
        max_abs_diff=max((c.max_abs_diff for c in numeric), default=None),
        max_rel_diff=max((c.max_rel_diff for c in numeric if c.max_rel_diff is not None), default=None),
        magnitude=max((c.magnitude for c in numeric if c.magnitude is not None), default=None),
        tolerance=(f"{worst.rtol:.1g}/{worst.atol:.1g}" if worst is not None and worst.atol is not None else ""),
        rtol=worst.rtol if worst is not None else None, atol=worst.atol if worst is not None else None,
        comparisons_total=len(comps), comparisons_failed=len(failed),
        vacuous=sum(1 for c in comps if c.vacuous or not c.asserted), unasserted=len(comps) - len(asserted),
        unasserted_outside=unasserted_outside,
        comparisons=[c.to_dict() for c in comps],
    )
    record.diagnosis = on_emulated(never_noise(summarise(comps, world_size, first=min(
        failed, key=lambda c: order[id(c)], default=None)), failed), failed, dict(check.labels).get("emulated"))
    if not asserted:
        record.reason = "the check asserted nothing"
    elif failed:
        # Earliest comparisons first, across ranks: the first thing that went wrong is the root cause
        # more often than rank 0's later symptoms.
        lines = [_describe_failure(c) for c in sorted(failed, key=lambda c: order[id(c)])[:8]]
        more = f"\n... and {len(failed) - 8} more" if len(failed) > 8 else ""
        record.reason = "\n".join(lines) + more
    if unasserted_outside:
        note = (f"{unasserted_outside} comparison(s) the seed never asserts are outside the strict "
                f"tolerance (reported, not asserted in this mode)")
        record.reason = f"{record.reason}\n{note}".strip()
    return record


def _describe_failure(c: Comparison) -> str:
    return _describe_numbers(c) + (f"\n    diagnosis: {c.diagnosis['name']}: {c.diagnosis['sentence']}"
                                   if c.diagnosis else "")


def _describe_numbers(c: Comparison) -> str:
    if c.max_abs_diff is None:
        return f"rank {c.rank}: {c.name}: {c.note or 'failed'}"
    verb = "should differ but agree" if c.kind == "differ" else "differ"
    return (f"rank {c.rank}: {c.name}: {verb}: max abs diff {c.max_abs_diff:.3g}, max rel diff "
            f"{c.max_rel_diff:.3g}, magnitude {c.magnitude:.3g}, rtol {c.rtol:g} atol {c.atol:.3g}"
            + ("" if c.finite else " (NaN/Inf)") + (f" - {c.note}" if c.note else ""))


def check_backend(check: Check, requested: str, resolved: str) -> tuple[str | None, str | None]:
    """(concrete backend to launch `check` with, None) or (None, why it is skipped).

    `resolved` is `requested` with "auto" resolved once for the whole run (local world size)."""
    if under_torchrun():
        # One default group serves every check of the job (launch creates it at the first one).
        return (TORCHRUN_NCCL_BACKEND if resolved == "nccl" else resolved), None
    if resolved == "nccl" and not check.cuda_ready:
        if requested == "nccl":
            return None, "CPU-only check (its tensors stay on the CPU); run it with --backend gloo"
        return "gloo", None  # "auto" picked NCCL, but this check's tensors live on the CPU
    return resolved, None


def run_checks(config: ParityConfig, *, on_record: Callable[[CheckRecord], None] | None = None) -> dict[str, Any]:
    """Run the selected checks one after another; returns the summary document."""
    checks = select(list(config.checks) or None)
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else config.world_size
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if config.debug_collectives else {}
    if config.debug_collectives and under_torchrun():
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # this process is a rank (set before init)
        import torch.distributed as dist

        dist.set_debug_level_from_env()  # torch read the variable at import
    records: list[CheckRecord] = []
    start = time.monotonic()
    resolved = resolve_backend(config.comm_backend, local_world_size(world_size))
    for check in checks:
        signals.check()  # a safe point between checks
        # A check with its own world (a library row) runs at it, except under torchrun (the job's is fixed).
        size = check.world_size if check.world_size is not None and not under_torchrun() else world_size
        reason = check.skip_reason(size)
        backend = None
        if reason is None:
            backend, reason = check_backend(check, config.comm_backend, resolved)
        if reason is not None:
            record = CheckRecord(name=check.name, status="skip", seed_source=check.seed_source,
                                 description=check.description, catches=check.catches,
                                 world_size=size, elapsed_s=0.0, reason=reason, labels=dict(check.labels))
        else:
            import_present(check.preload)  # only what the installed release has; a broken one is the rows' error
            timeout_s = check.timeout_s or config.timeout_s
            opts = CheckOptions(
                tolerance=config.tolerance,
                impls=dict(config.impls),
                seed=config.seed % CHECK_SEED_MODULUS,
                timeout_s=timeout_s,
            )
            result = launch(_rank_entry, size, args=(check.name, opts), backend=backend,
                            timeout_s=timeout_s, label=f"check {check.name}", env=env)
            record = _audit(check, result, size)
            if record.status == "fail" and (record.diagnosis or {}).get("name") in RERUN_NAMES:
                signals.check()
                again = _audit(check, launch(_rank_entry, size, args=(check.name, opts), backend=backend,
                                             timeout_s=timeout_s, label=f"check {check.name}", env=env), size)
                differs = nondeterminism(record, again)
                if differs is not None:
                    record.diagnosis = differs
                    record.elapsed_s += again.elapsed_s
        record.user_impls = {key: config.impls[key] for key in check.impl_keys if key in config.impls}
        records.append(record)
        if on_record is not None:
            on_record(record)
    counts = {s: sum(1 for r in records if r.status == s) for s in ("pass", "fail", "skip", "refused")}
    if not counts["refused"]:  # only runs with a refusal carry the key (the library rows' --resume)
        del counts["refused"]
    return {
        "world_size": world_size,
        "comm_backend": resolved,
        "tolerance": config.tolerance,
        "impls": dict(config.impls),
        "under_torchrun": under_torchrun(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "checks_time_s": time.monotonic() - start,
        "counts": counts,
        "vacuous_total": sum(r.vacuous for r in records),
        "checks": [dataclasses.asdict(r) for r in records],
    }


def no_check_ran(summary: dict[str, Any]) -> str:
    """The reason a run in which no check passed and none failed is still a failure ("" otherwise)."""
    if summary["counts"]["pass"] or summary["counts"]["fail"]:
        return ""
    if summary["counts"].get("refused"):
        return f"no check passed: {summary['counts']['refused']} refused by the library, the rest skipped"
    skipped = [f"{c['name']} ({c['reason']})" for c in summary["checks"]]
    return f"no check ran: all {len(skipped)} selected check(s) were skipped: " + "; ".join(skipped)


def verify_parity(config: ParityConfig, *, results_dir: str | None = None,
                  on_record: Callable[[CheckRecord], None] | None = None,
                  decorate: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                  decorate_partial: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Validate, run, and save under results/parity/<run-id>/ (rank 0 only). Returns the summary.

    The summary's "status" is "ok" when at least one check passed and none failed, else "failed"
    (with a "reason" when every check was skipped). `decorate(summary)` may add keys before it is
    saved (the library matrix's rows); `decorate_partial` does the same for a run that ends early, over the
    checks that finished. Ctrl-C / SIGTERM write "interrupted" and propagate as KeyboardInterrupt; any other
    exception writes "failed" and propagates."""
    from moebench.models.deepspeed_moe import set_accelerator_env

    require_launch_env()  # launcher variables that cannot make a rank: refused before any folder exists
    select(list(config.checks) or None)  # unknown names fail before any folder exists
    set_accelerator_env("cuda" if config.comm_backend == "nccl" or torch.cuda.is_available() else "cpu")
    is_writer = not under_torchrun() or int(os.environ.get("RANK", "0")) == 0
    with sigterm_as_interrupt():
        return _run_and_save(config, results_dir, on_record, is_writer, decorate, decorate_partial)


def _run_and_save(config, results_dir, on_record, is_writer, decorate=None, decorate_partial=None) -> dict[str, Any]:
    run_dir = RunDir.create("parity", root=results_dir) if is_writer else None
    if run_dir is not None:
        run_dir.write_json("config.json", {"kind": "parity", **dataclasses.asdict(config)})
        run_dir.start()
    done: list[CheckRecord] = []

    def record_done(record: CheckRecord) -> None:
        done.append(record)
        if on_record is not None:
            on_record(record)

    def finish_early(status: str, **extra) -> None:
        if run_dir is not None:  # keep what finished before the interruption / error
            partial = {**extra, "checks": [dataclasses.asdict(r) for r in done]}
            with contextlib.suppress(OSError):  # unwritable: the error on its way out says more
                run_dir.finish(status, decorate_partial(partial) if decorate_partial is not None else partial)

    try:
        summary = run_checks(config, on_record=record_done)
    except KeyboardInterrupt as exc:
        finish_early(STATUS_INTERRUPTED)
        if run_dir is None:
            raise
        raise Interrupted(run_dir.path) from exc  # the CLI names the folder it marked
    except BaseException as exc:
        finish_early(STATUS_FAILED, reason=f"{type(exc).__name__}: {exc}")
        raise
    reason = no_check_ran(summary)
    status = STATUS_FAILED if summary["counts"]["fail"] or reason else STATUS_OK
    summary = {**({"reason": reason} if reason else {}), **summary}
    if decorate is not None:
        summary = decorate(summary)
    if run_dir is not None:
        try:
            return run_dir.finish(status, summary)
        except OSError as exc:  # the folder became unwritable: the verdicts are still returned whole
            return {**run_dir.envelope(status), **summary,
                    "unsaved": f"could not write {run_dir.path / 'summary.json'}: {exc.strerror or exc}"}
    return {"status": status, **summary}

"""One run driver for every variant (the training loop the variants call is moebench/loop.py).

A variant (moebench/variants/) supplies a *rank function* `rank_fn(ctx, run_path, *args) -> dict`
that builds its model and data, calls `loop.train_loop` with its own step function, and returns its
summary numbers. The driver `run_variant` / `execute_run` does everything around it, identically
for all variants:

  validated config -> results/<kind>/<run-id>/ (config.json, env.json, summary "running")
    -> rank_fn on 1 process (in-process) or N ranks (`launch`), rank 0 writing params.json and
       metrics.jsonl as it goes
    -> summary.json (ok / failed / interrupted) and loss.png

Only the writer (the parent, or rank 0 under torchrun) touches results/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

from moebench import results, signals
from moebench.distributed.launch import RankContext, launch, sigterm_as_interrupt, under_torchrun
from moebench.errors import Interrupted, RunFailed

# --------------------------------------------------------------------------- run driver


@dataclasses.dataclass(kw_only=True)
class RunOutcome:
    run_path: Path | None
    """The run folder (None on a non-writing torchrun rank)."""
    summary: dict
    """What summary.json holds."""


def run_variant(variant, config, *, results_root=None, show_progress: bool = True) -> RunOutcome:
    """Train one validated config of `variant` and record it under results/<variant>/<run-id>/."""
    from moebench import config as config_tree

    config_tree.require_launch_env()  # launcher variables that cannot make a rank: refused before the folder
    record = config_tree.as_dict(config)
    launch_cfg = config.launch
    timeout_s = launch_cfg.timeout_s if launch_cfg.timeout_s is not None else config.default_timeout_s
    record["launch"]["timeout_s"] = timeout_s
    return execute_run(kind=variant.name, name=config.preset, config=record,
                       world_size=launch_cfg.world_size, rank_fn=variant.rank_fn(),
                       rank_args=(record, show_progress), backend=launch_cfg.comm_backend, timeout_s=timeout_s,
                       results_root=results_root,
                       finish=lambda summary: with_comparison(summary, variant.published, kind=variant.name,
                                                              config=record))


def with_comparison(summary: dict, figures, *, kind: str, config: dict) -> dict:
    """The summary with its chapter comparison added: measured vs published per figure when the
    config is the chapter's experiment; else every figure `not run` and `chapter_note` saying why
    once (the same verdicts `moebench report` gives the run)."""
    from moebench import report
    from moebench.report import chapter

    differs = chapter.deviations(config, chapter.chapter_config(kind))
    if not differs:
        return {**summary, "chapter_comparable": True, "chapter_comparison": report.compare(summary, figures)}
    note = chapter.not_comparable(kind, config.get("preset"), differs)
    return {**summary, "chapter_comparable": False, "chapter_note": note,
            "chapter_comparison": report.verdicts(summary, figures, not_run_reason=note)}


def execute_run(
    *,
    kind: str,
    name: str,
    config: dict,
    world_size: int,
    rank_fn: Callable[..., dict],
    rank_args: tuple = (),
    backend: str = "auto",
    timeout_s: float = 24 * 3600.0,
    results_root: str | os.PathLike | None = None,
    env_summary: Callable[[], dict] | None = None,
    in_process: bool | None = None,
    finish: Callable[[dict], dict] | None = None,
) -> RunOutcome:
    """Create the run folder, run `rank_fn` on every rank, record the outcome. See module doc.

    `in_process`: run one rank here, without a process group (default: when world_size is 1).
    `finish(rank_summary)` adds what is computed from the summary (the chapter comparison).
    """
    writer = not under_torchrun() or int(os.environ["RANK"]) == 0
    with sigterm_as_interrupt():  # SIGTERM is recorded like Ctrl-C: "interrupted", ranks killed
        with signals.held():  # a signal now lands after the folder says "running", inside outcome_recorded
            run = results.RunDir.create(kind, name, results_root) if writer else None
            if run is not None:
                run.start()
        run_path = run.path if run else None
        with outcome_recorded(run):
            if run is not None:
                run.write_json("config.json", {"kind": kind, **config})
                run.write_json("env.json", (env_summary or default_env_summary)())
            in_process = world_size == 1 if in_process is None else in_process
            with machine_watched(in_process and not under_torchrun()) as machine:
                rank_summary = _run_ranks(rank_fn, world_size, run_path, rank_args, backend, timeout_s, kind,
                                          in_process)
            summary = finish(rank_summary) if finish else rank_summary
            summary = {**summary, "machine": machine}
            signals.check()
            if run is not None:
                _plot(run, title=f"{kind} ({summary.get('moe_impl', kind)})  {run.run_id}", summary=summary,
                      aux_coef=(config.get("train") or {}).get("aux_loss_coef"))
                final = run.finish(results.STATUS_OK, summary)
    return RunOutcome(run_path=run_path, summary=final if run is not None else summary)


@contextlib.contextmanager
def machine_watched(one_process: bool):
    """Around the timed part of a run: the CPU sampled at both ends; a one-process run takes every usable core
    as its intra-op threads, whatever the load (moebench/contention.py: the count changes the numbers), restored
    afterwards. Yields the dict summary.json records under "machine": what other processes used meanwhile, the
    threads, and a `warning` (None on a quiet machine)."""
    import torch

    from moebench import contention
    from moebench.rankenv import usable_cores

    cores = usable_cores()
    machine: dict[str, Any] = {}
    before = torch.get_num_threads()
    if one_process:
        torch.set_num_threads(contention.threads_for(cores))
    machine["threads"] = torch.get_num_threads() if one_process else None  # ranks: set by the launcher
    start = contention.sample()
    try:
        yield machine
    finally:
        torch.set_num_threads(before)
        machine.update(contention.others_between(start, contention.sample()), cores=cores)
        machine["warning"] = contention.busy_warning(machine, cores)


@contextlib.contextmanager
def outcome_recorded(run: results.RunDir | None):
    """Inside, a Ctrl-C or SIGTERM is recorded "interrupted" and re-raised; any other failure is
    recorded "failed" and raised as RunFailed naming the folder (once: a RunFailed passes through)."""
    try:
        yield
    except KeyboardInterrupt as exc:
        unwritten = record_end(run, results.STATUS_INTERRUPTED, "interrupted (Ctrl-C or SIGTERM)")
        if run is None or unwritten or isinstance(exc, Interrupted):
            raise
        raise Interrupted(run.path) from exc  # the CLI names the folder it marked
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        unwritten = record_end(run, results.STATUS_FAILED, error)
        if isinstance(exc, RunFailed) and not unwritten:
            raise
        raise RunFailed(error + (f"; {unwritten}" if unwritten else ""), run.path if run else None) from exc


def record_end(run: results.RunDir | None, status: str, error: str) -> str:
    """Write the final status, as well as can be: "" when written, else why not (a read-only or
    full disk must not turn the failure into a traceback; a later command reports the run as
    abandoned from its pid)."""
    if run is None or run.ended == results.STATUS_INTERRUPTED:  # already recorded (by `finish`)
        return ""
    try:
        run.finish(status, {"error": error})
    except OSError as exc:
        return f"could not record status {status!r} in {run.path / 'summary.json'}: {exc.strerror or exc}"
    return ""


def _run_ranks(rank_fn, world_size, run_path, rank_args, backend, timeout_s, kind, in_process) -> dict:
    """One process runs in-process (no process group); N ranks go through `launch`."""
    if in_process and not under_torchrun():
        ctx = RankContext(rank=0, world_size=1, local_rank=0, backend="none", device="cpu")
        return rank_fn(ctx, run_path, *rank_args)
    outcome = launch(rank_fn, world_size, args=(run_path, *rank_args), backend=backend,
                     timeout_s=timeout_s, label=f"run {kind}")
    if not outcome.ok:
        raise RunFailed(outcome.describe(), run_path)
    return outcome.returns[0]


def _plot(run: results.RunDir, *, title: str, summary: dict, aux_coef: float | None) -> None:
    from moebench import report

    metrics = run.path / "metrics.jsonl"
    if metrics.exists():
        report.plot_loss(results.read_back(metrics), run.path / "loss.png", title=title,
                         steps_per_epoch=summary.get("steps_per_epoch"),
                         eval_loss=(summary.get("test") or {}).get("loss"), aux_coef=aux_coef)


def default_env_summary() -> dict:
    try:
        from moebench.envcheck import summary
    except ImportError:
        import platform

        import torch

        return {"python": platform.python_version(), "torch": torch.__version__,
                "cuda_available": torch.cuda.is_available()}
    return summary()

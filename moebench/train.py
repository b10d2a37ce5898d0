"""One training loop and one run driver for every variant.

A variant (moebench/variants/) supplies a *rank function* `rank_fn(ctx, run_path, *args) -> dict`
that builds its model and data, calls `train_loop` with its own step function, and returns its
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
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from moebench import results, signals
from moebench.distributed.launch import RankContext, launch, sigterm_as_interrupt, under_torchrun
from moebench.errors import Interrupted, RunFailed

WARMUP_STEPS = 2
"""Steps left out of the steady-state tokens/s: the first allocates buffers and optimizer state,
the second still pays for allocator growth (the chapter model's first step is ~10x a later one)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepParts:
    """One training step of a variant cut into its phases, on one in-process rank, for timing
    (`moebench bench --train`). Each variant's `step_parts(config)` yields one."""

    data: Callable[[int], tuple]
    """step -> (inputs, targets) on the model's device: the batch the run would train on."""
    forward: Callable[[tuple], Any]
    """batch -> the loss the run backpropagates (MSE + aux coefficient x aux loss)."""
    backward: Callable[[Any], None]
    """loss -> gradients in place (through the engine where the variant trains through one)."""
    optimizer: Callable[[], None]
    """Apply the update and clear the gradients, as the run does."""
    trainable_params: int
    """Elements the optimizer updates (this rank's)."""
    optimizer_name: str
    """What steps, in words (e.g. "torch.optim.Adam(fused=True)")."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopSpec:
    total_steps: int
    """Optimiser steps to run."""
    steps_per_epoch: int
    """Steps in one pass over the training set; the average loss of every epoch is recorded."""
    tokens_per_step: int
    """Tokens one optimiser step consumes across all ranks (the global batch x seq_len)."""
    label: str = "train"
    """Shown beside the progress bar."""

    def __post_init__(self) -> None:
        if self.total_steps < 1 or self.steps_per_epoch < 1 or self.tokens_per_step < 1:
            raise ValueError(f"LoopSpec needs positive sizes, got {self}")


StepFn = Callable[[int], dict]
"""step_fn(step) -> {"loss": float, "aux_loss": float, **extra JSON-able fields}; step is 0-based."""


def train_loop(step_fn: StepFn, spec: LoopSpec, *, writer: results.RunDir | None,
               show_progress: bool = True) -> dict:
    """Run every step, log one metrics line per step (writer only), return the loss history."""
    losses: list[float] = []
    aux_losses: list[float] = []
    step_times: list[float] = []
    progress = _progress() if (show_progress and writer is not None) else None
    task = (progress.add_task(spec.label, total=spec.total_steps, loss=float("nan"), aux=0.0, tps=0.0)
            if progress else None)
    start = time.perf_counter()
    try:
        if progress:
            progress.start()
        for step in range(spec.total_steps):
            signals.check()  # a safe point: a Ctrl-C / SIGTERM ends the run at a step boundary
            t0 = time.perf_counter()
            record = step_fn(step)
            dt = time.perf_counter() - t0
            loss, aux = float(record["loss"]), float(record.get("aux_loss", 0.0))
            epoch = step // spec.steps_per_epoch + 1
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at epoch {epoch}, step {step + 1}")
            losses.append(loss)
            aux_losses.append(aux)
            step_times.append(dt)
            tokens_per_s = spec.tokens_per_step / dt if dt > 0 else None
            steady_so_far = steady_rate(step_times, spec.tokens_per_step)
            if writer is not None:
                writer.log_metrics({"step": step + 1, "epoch": epoch, **record, "loss": loss, "aux_loss": aux,
                                    "step_time_s": dt, "tokens_per_s": tokens_per_s})
            if progress:
                # The bar shows the summary's steady figure so far (the last step's alone jumps around).
                progress.update(task, advance=1, loss=loss, aux=aux, tps=steady_so_far or tokens_per_s or 0.0)
    finally:
        if progress:
            progress.stop()
    train_time = time.perf_counter() - start
    per_epoch = [losses[i:i + spec.steps_per_epoch] for i in range(0, len(losses), spec.steps_per_epoch)]
    first, last = losses[0], losses[-1]
    return {
        "steps": len(losses),
        "epochs": len(per_epoch),
        "steps_per_epoch": spec.steps_per_epoch,
        "loss": {"first": first, "last": last, "drop_pct": 100.0 * (first - last) / first if first else None},
        "epoch_loss": [sum(e) / len(e) for e in per_epoch],
        "losses": losses,
        "aux_losses": aux_losses,
        "train_time_s": train_time,
        "tokens_per_step": spec.tokens_per_step,
        "tokens_per_s": spec.tokens_per_step * len(losses) / train_time if train_time > 0 else None,
        "warmup_steps": min(WARMUP_STEPS, len(losses)),
        "tokens_per_s_steady": steady_rate(step_times, spec.tokens_per_step),
    }


def steady_rate(step_times: list[float], tokens_per_step: int) -> float | None:
    """Tokens per second over the steps after the WARMUP_STEPS first (summed step times; logging
    and evaluation excluded): summary.json's `tokens_per_s_steady` and the progress bar's figure.
    `tokens_per_s` ("overall") is every step's tokens over the loop's whole wall time."""
    steady = step_times[WARMUP_STEPS:]
    return tokens_per_step * len(steady) / sum(steady) if steady and sum(steady) > 0 else None


def global_mean(value, world_size: int) -> float:
    """The mean over the global batch of a per-rank mean (equal slices): one all_reduce."""
    if world_size > 1:
        import torch.distributed as dist

        value = value.detach().clone()
        dist.all_reduce(value)
        value /= world_size
    return value.item()


def rank_writer(ctx: RankContext, run_path) -> results.RunDir | None:
    """The run folder's writer on the rank that writes (rank 0 of a run that records), else None."""
    return results.RunDir(Path(run_path)) if (ctx.is_main and run_path) else None


def _progress():
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(bar_width=None), MofNCompleteColumn(),  # bar: what is left
        TextColumn("loss {task.fields[loss]:.4f} aux {task.fields[aux]:.4f} {task.fields[tps]:,.0f} tok/s"),
        TimeElapsedColumn(), transient=False, refresh_per_second=4,
        console=Console(stderr=True),  # stdout carries only the result (or the --json document)
    )


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
    from moebench.distributed.env import usable_cores

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

"""One training loop and one run driver for every variant.

A variant supplies a *rank function* `rank_fn(ctx, run_path, *args) -> dict` that builds its model
and data, calls `train_loop` with its own step function, and returns its summary numbers. The driver
`execute_run` does everything around it, identically for all variants:

  validated config -> results/<kind>/<run-id>/ (config.json, env.json, summary "running")
    -> rank_fn on 1 process (in-process) or N ranks (`launch`), rank 0 writing params.json and
       metrics.jsonl as it goes
    -> summary.json (ok / failed / interrupted) and loss.png

Only the writer (the parent, or rank 0 under torchrun) touches results/.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Callable

from moebench import results
from moebench.errors import RunFailed
from moebench.distributed.launch import RankContext, launch, sigterm_as_interrupt, under_torchrun


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopSpec:
    epochs: int
    """Passes over the data; the per-epoch average loss is recorded (DeepSpeed's chapter run: 5)."""
    steps_per_epoch: int
    """Optimiser steps in one epoch (a step-based run is one epoch of `steps` steps)."""
    tokens_per_step: int
    """Tokens one optimiser step consumes across all ranks (batch x seq x data-parallel ranks)."""
    label: str = "train"
    """Shown beside the progress bar."""

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.steps_per_epoch < 1 or self.tokens_per_step < 1:
            raise ValueError(f"LoopSpec needs positive sizes, got {self}")


StepFn = Callable[[int, int], dict]
"""step_fn(epoch, step) -> {"loss": float, "aux_loss": float, **extra JSON-able fields}."""


def train_loop(step_fn: StepFn, spec: LoopSpec, *, writer: results.RunDir | None,
               show_progress: bool = True) -> dict:
    """Run every step, log one metrics line per step (writer only), return the loss history."""
    losses: list[float] = []
    aux_losses: list[float] = []
    epoch_avg: list[float] = []
    start = time.perf_counter()
    progress = _progress(spec) if (show_progress and writer is not None) else None
    task = (progress.add_task(spec.label, total=spec.epochs * spec.steps_per_epoch, loss=float("nan"), aux=0.0, tps=0.0)
            if progress else None)
    try:
        if progress:
            progress.start()
        global_step = 0
        for epoch in range(spec.epochs):
            epoch_losses = []
            for step in range(spec.steps_per_epoch):
                t0 = time.perf_counter()
                record = step_fn(epoch, step)
                dt = time.perf_counter() - t0
                loss, aux = float(record["loss"]), float(record.get("aux_loss", 0.0))
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss became {loss} at epoch {epoch + 1}, step {step + 1}")
                losses.append(loss)
                aux_losses.append(aux)
                epoch_losses.append(loss)
                tokens_per_s = spec.tokens_per_step / dt if dt > 0 else float("inf")
                if writer is not None:
                    writer.log_metrics({"step": global_step + 1, "epoch": epoch + 1, **record,
                                        "loss": loss, "aux_loss": aux, "step_time_s": dt,
                                        "tokens_per_s": tokens_per_s})
                if progress:
                    progress.update(task, advance=1, loss=loss, aux=aux, tps=tokens_per_s)
                global_step += 1
            epoch_avg.append(sum(epoch_losses) / len(epoch_losses))
    finally:
        if progress:
            progress.stop()
    train_time = time.perf_counter() - start
    steps = len(losses)
    return {
        "losses": losses,
        "aux_losses": aux_losses,
        "epoch_avg_loss": epoch_avg,
        "steps": steps,
        "train_time_s": train_time,
        "tokens_per_s": spec.tokens_per_step * steps / train_time if train_time > 0 else None,
    }


def loss_summary(history: dict) -> dict:
    """First / last loss and the drop, the way the chapter states them."""
    first, last = history["losses"][0], history["losses"][-1]
    return {"first": first, "last": last, "drop_pct": 100.0 * (first - last) / first if first else None}


def _progress(spec: LoopSpec):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  aux {task.fields[aux]:.4f}  {task.fields[tps]:,.0f} tok/s"),
        TimeElapsedColumn(), transient=False, refresh_per_second=4,
    )


# --------------------------------------------------------------------------- run driver


@dataclasses.dataclass(kw_only=True)
class RunOutcome:
    run_path: Path | None
    """The run folder (None on a non-writing torchrun rank)."""
    summary: dict
    """What summary.json holds."""


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
    label: str | None = None,
) -> RunOutcome:
    """Create the run folder, run `rank_fn` on every rank, record the outcome. See module doc.

    `label` names the run in the plot title (e.g. "fastmoe (reference backend)"); default `kind`.
    """
    writer = not under_torchrun() or int(os.environ["RANK"]) == 0
    with sigterm_as_interrupt():  # SIGTERM is recorded like Ctrl-C: "interrupted", ranks killed
        run = results.RunDir.create(kind, name, results_root) if writer else None
        run_path = run.path if run else None
        started = time.time()
        try:
            if run is not None:
                run.write_json("config.json", config)
                run.write_json("env.json", (env_summary or _default_env_summary)())
                run.start({"kind": kind, "run_id": run.run_id})
            rank_summary = _run_ranks(rank_fn, world_size, run_path, rank_args, backend, timeout_s, kind)
        except KeyboardInterrupt:
            if run is not None:
                run.finish(results.STATUS_INTERRUPTED, {"kind": kind, "run_id": run.run_id,
                                                        "wall_time_s": time.time() - started,
                                                        "error": "interrupted (Ctrl-C or SIGTERM)"})
            raise
        except BaseException as exc:
            if run is not None:
                run.finish(results.STATUS_FAILED, {"kind": kind, "run_id": run.run_id,
                                                   "wall_time_s": time.time() - started,
                                                   "error": f"{type(exc).__name__}: {exc}"})
            if isinstance(exc, RunFailed):
                raise
            raise RunFailed(f"{type(exc).__name__}: {exc}", run_path) from exc
    summary = {"kind": kind, "run_id": run.run_id if run else None,
               "wall_time_s": time.time() - started, **rank_summary}
    if run is not None:
        _plot(run, title=f"{label or kind}  {run.run_id}")
        run.finish(results.STATUS_OK, summary)
    return RunOutcome(run_path=run_path, summary={"status": results.STATUS_OK, **summary})


def _run_ranks(rank_fn, world_size, run_path, rank_args, backend, timeout_s, kind) -> dict:
    """One process runs in-process (no process group); N ranks go through `launch`."""
    if world_size == 1 and not under_torchrun():
        ctx = RankContext(rank=0, world_size=1, local_rank=0, backend="none", device="cpu")
        return rank_fn(ctx, run_path, *rank_args)
    outcome = launch(rank_fn, world_size, args=(run_path, *rank_args), backend=backend,
                     timeout_s=timeout_s, label=f"run {kind}")
    if not outcome.ok:
        raise RunFailed(outcome.describe(), run_path)
    return outcome.returns[0]


def _plot(run: results.RunDir, *, title: str) -> None:
    from moebench import report

    metrics = run.path / "metrics.jsonl"
    if metrics.exists():
        report.plot_loss(results.read_jsonl(metrics), run.path / "loss.png", title=title)


def _default_env_summary() -> dict:
    try:
        from moebench.envcheck import summary
    except ImportError:
        import platform

        import torch

        return {"python": platform.python_version(), "torch": torch.__version__,
                "cuda_available": torch.cuda.is_available()}
    return summary()


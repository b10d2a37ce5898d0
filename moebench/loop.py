"""The training loop every variant's rank function calls (what the variants import; the run driver that starts the
ranks and records the run is moebench/train.py).

`train_loop(step_fn, spec, writer=...)` runs every step, logs one metrics line per step on the writing rank, and
returns the loss history and the tokens/s figures; a Ctrl-C or SIGTERM ends it at a step boundary.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable

from moebench import results, signals
from moebench.distributed.launch import RankContext

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

"""One `moebench bench` run: what to measure (BenchSpec), and the results folder it fills.

results/bench/<run-id>/: config.json (the spec), summary.json (rows of every section, the
envelope: ok / failed / interrupted), bench.json (the one-process sweep, raw) and the plots.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from moebench.bench.layers import LAYERS, Point, run_sweep
from moebench.bench.output import (
    format_comm,
    format_expert_parallel,
    format_table,
    format_train,
    plot,
    plot_expert_parallel,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchSpec:
    """What one `moebench bench` measures."""

    points: list[Point]
    """Every (experts, tokens, top_k, d_model, d_hidden) of the sweep; tokens are per rank."""
    layers: tuple[str, ...]
    """One-process layers (moebench.bench.layers.LAYERS)."""
    ep_layers: tuple[str, ...]
    """Expert-parallel layers timed on each of `world_sizes` (empty: none)."""
    world_sizes: list[int]
    """Local rank counts for the expert-parallel layers and --comm."""
    repeats: int
    """Timed calls per layer and point (interleaved over the layers); the median is reported."""
    warmup: int
    """Untimed calls first (first-call allocations, lazy inits)."""
    profile: bool
    """Add torch.profiler's breakdown (GEMM / gate / dispatch / combine / comm shares)."""
    comm: bool
    """Time all-to-all alone at the sizes the points exchange."""
    train: bool
    """Time one training step of each variant's `preset` instead of the layer sweep."""
    preset: str
    """The preset --train times."""
    timeout_s: float
    """Deadline of each multi-rank launch."""


def check_preset(preset: str) -> None:
    """Every variant has `preset`, and its run fits in memory (before any folder exists)."""
    from moebench import resources, variants

    for variant in variants.VARIANTS:
        resources.require_fits(variants.resolve_config(variant, preset, {}))


def run_bench(spec: BenchSpec, results_dir, *, name: str, log: Callable[[str], None] | None = None) -> dict:
    """Measure `spec` into a new results/bench/<id>/; returns the final summary."""
    from moebench import results
    from moebench.bench import parallel, train_step
    from moebench.distributed.launch import sigterm_as_interrupt
    from moebench.errors import RunFailed
    from moebench.train import record_end, signals_deferred

    with sigterm_as_interrupt():
        with signals_deferred():
            run = results.RunDir.create("bench", name, results_dir)
            run.start()
        try:
            config = dataclasses.asdict(spec)
            run.write_json("config.json", {"kind": "bench", **config})
            body: dict = {}
            if spec.train:
                body["train"] = train_step.run_train(spec.preset, steps=spec.repeats, warmup=spec.warmup, log=log)
            else:
                sweep = run_sweep(spec.points, spec.layers, repeats=spec.repeats, warmup=spec.warmup,
                                  profile=spec.profile, log=log)
                run.write_json("bench.json", sweep)
                body.update({k: sweep[k] for k in ("rows", "breakdown", "threads", "torch", "memory_method",
                                                   "grouped_mm_requirements")})
                if spec.ep_layers:
                    body["expert_parallel"] = parallel.run_expert_parallel(
                        spec.points, spec.world_sizes, spec.ep_layers, repeats=spec.repeats, warmup=spec.warmup,
                        profile=spec.profile, timeout_s=spec.timeout_s, log=log)
                if spec.comm:
                    body["comm"] = parallel.run_comm(spec.points, spec.world_sizes, timeout_s=spec.timeout_s,
                                                     log=log)
                plots = plot(body, run.path) + plot_expert_parallel(body.get("expert_parallel", []), run.path)
                body["plots"] = [os.path.basename(p) for p in plots]
            return run.finish(results.STATUS_OK, body)
        except KeyboardInterrupt:
            record_end(run, results.STATUS_INTERRUPTED, "interrupted (Ctrl-C or SIGTERM)")
            raise
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            unwritten = record_end(run, results.STATUS_FAILED, error)
            raise RunFailed(error + (f"; {unwritten}" if unwritten else ""), run.path) from exc


def format_summary(summary: dict) -> str:
    """Every section the run has, as plain text at most 80 columns wide."""
    parts = []
    if summary.get("train"):
        parts.append(format_train(summary["train"]))
    if summary.get("rows"):
        parts.append(format_table(summary))
    if summary.get("expert_parallel"):
        parts.append(format_expert_parallel(summary["expert_parallel"]))
    if summary.get("comm"):
        parts.append(format_comm(summary["comm"]))
    return "\n\n".join(parts)


__all__ = ["LAYERS", "BenchSpec", "Point", "check_preset", "format_summary", "run_bench"]

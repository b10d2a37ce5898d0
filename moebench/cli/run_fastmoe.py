"""`moebench run fastmoe`: flags -> FastMoERunConfig -> fastmoe_run.run -> tables (or JSON)."""

from __future__ import annotations

from typing import Optional

import typer

from moebench import published, report, results
from moebench.cli.common import params_table, run_and_report
from moebench.errors import UserError


def run_fastmoe(
    preset: str = typer.Option("quick", "--preset", help="experiments/fastmoe/<preset>.json: quick (seconds) or chapter (the chapter's 273 M model)."),
    backend: Optional[str] = typer.Option(None, "--backend", help="auto | fmoe | reference (auto: real fmoe where usable, else moebench's port)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Transformer blocks."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Attention heads."),
    d_model: Optional[int] = typer.Option(None, "--d-model", help="Model width."),
    d_hidden: Optional[int] = typer.Option(None, "--d-hidden", help="Hidden width of each expert."),
    experts: Optional[int] = typer.Option(None, "--experts", help="Experts per MoE layer (all ranks)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Experts per token."),
    gate: Optional[str] = typer.Option(None, "--gate", help="naive | gshard | switch | noisy."),
    aux_loss_coef: Optional[float] = typer.Option(None, "--aux-loss-coef", help="Weight of the gate's balance loss."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimiser steps."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Sequences per step (global batch)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sequence."),
    train_batches: Optional[int] = typer.Option(None, "--train-batches", help="Distinct random training batches, cycled."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Adam learning rate."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of weights and data."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda | auto."),
    world_size: Optional[int] = typer.Option(None, "--world-size", help="Expert-parallel ranks (local, gloo on CPU)."),
    results_dir: Optional[str] = typer.Option(None, "--results-dir", help="Results root (default $MOEBENCH_RESULTS or ./results)."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Hang deadline of a multi-rank run, seconds: "
                                            "its ranks are dumped and killed then (default: max(1800, steps x "
                                            "weights x 6e-7) s: 1800 for both presets)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON only."),
) -> None:
    """Train the fastmoe Transformer-MoE on random data and compare with the chapter."""
    from moebench import config as shared_config
    from moebench import fastmoe_run  # imports torch: keep `moebench --help` fast

    if timeout is not None:
        shared_config.require_finite({"--timeout": timeout})
        if not timeout > 0:
            raise UserError(f"must be positive, got {timeout}", flag="--timeout")
    config = fastmoe_run.resolve_config(preset, dict(
        backend=backend, layers=layers, heads=heads, d_model=d_model, d_hidden=d_hidden,
        experts=experts, top_k=top_k, gate=gate, aux_loss_coef=aux_loss_coef, steps=steps,
        batch_size=batch_size, seq_len=seq_len, train_batches=train_batches, lr=lr, seed=seed,
        device=device, world_size=world_size))
    results.check_root(results_dir, fastmoe_run.KIND)
    if not as_json:
        typer.echo(f"backend: {config.backend}  (device {config.device}, {config.world_size} rank(s), comm "
                   f"{fastmoe_run.comm_backend(config)}, preset {config.preset})")
    run_and_report(lambda: fastmoe_run.run(config, results_root=results_dir, timeout_s=timeout,
                                           show_progress=not as_json),
                   as_json=as_json, print_report=lambda summary, run_path: _print_report(summary, run_path, config))


def _print_report(summary: dict, run_path, config) -> None:
    from rich.console import Console

    console = Console()
    console.print(params_table(summary["params"], f"parameters ({config.backend})"))
    rows = report.compare(summary, published.FASTMOE)
    console.print(report.comparison_table(rows, "measured vs chapter 6 (fastmoe)"))
    console.print(f"eval loss {summary['eval_loss']:.4f}  steps {summary['steps']}  "
                  f"wall {summary['wall_time_s']:.1f} s  {summary['tokens_per_s']:,.0f} tokens/s")
    console.print(f"results: {run_path}")

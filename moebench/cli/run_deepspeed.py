"""`moebench run deepspeed`: flags -> DeepSpeedRunConfig -> deepspeed_run.run -> tables (or JSON)."""

from __future__ import annotations

from typing import Optional

import typer

from moebench import report, results
from moebench.cli.common import params_table, run_and_report
from moebench.errors import UserError


def _expert_counts(text: Optional[str]) -> Optional[tuple[int, ...]]:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"expected a count or a comma list of counts (e.g. 8 or 4,8), got {text!r}",
                        flag="--experts") from None


def run_deepspeed(
    preset: str = typer.Option("chapter", "--preset", help="experiments/deepspeed/<preset>.json: chapter or quick."),
    experts: Optional[str] = typer.Option(None, "--experts", help="Experts per MoE layer: one count, or one per layer (4,8: pyramid)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Transformer blocks (MoE layers)."),
    d_model: Optional[int] = typer.Option(None, "--d-model", help="Hidden size."),
    d_hidden: Optional[int] = typer.Option(None, "--d-hidden", help="Hidden width of each expert."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Attention heads."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Experts per token."),
    capacity_factor: Optional[float] = typer.Option(None, "--capacity-factor", help="Training capacity factor."),
    eval_capacity_factor: Optional[float] = typer.Option(None, "--eval-capacity-factor", help="Eval capacity factor."),
    min_capacity: Optional[int] = typer.Option(None, "--min-capacity", help="Minimum capacity per expert."),
    noisy_gate_policy: Optional[str] = typer.Option(None, "--noisy-gate-policy", help="none | Jitter | RSample (RSample: --top-k 1 only)."),
    use_residual: Optional[bool] = typer.Option(None, "--use-residual/--no-use-residual", help="Residual MoE (dense MLP beside the experts)."),
    drop_tokens: Optional[bool] = typer.Option(None, "--drop-tokens/--no-drop-tokens", help="Drop tokens beyond capacity."),
    use_rts: Optional[bool] = typer.Option(None, "--use-rts/--no-use-rts", help="Random Token Selection when dropping."),
    ep_size: Optional[int] = typer.Option(None, "--ep-size", help="Expert-parallel size (divides world size and every expert count)."),
    zero_stage: Optional[int] = typer.Option(None, "--zero-stage", help="ZeRO stage 0, 1 or 2."),
    ds_config: Optional[str] = typer.Option(None, "--ds-config", help="DeepSpeed JSON config merged under the flags."),
    aux_loss_coef: Optional[float] = typer.Option(None, "--aux-loss-coef", help="Weight of the gates' l_aux (default 0.01)."),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="Passes over the dataset."),
    batch: Optional[int] = typer.Option(None, "--batch", help="Sequences per rank per step."),
    seq: Optional[int] = typer.Option(None, "--seq", help="Tokens per sequence."),
    samples: Optional[int] = typer.Option(None, "--samples", help="Sequences in the random training set."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Adam learning rate."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of weights, data and gate noise."),
    world_size: Optional[int] = typer.Option(None, "--world-size", help="Local ranks to start (gloo on CPU)."),
    backend: Optional[str] = typer.Option(None, "--backend", help="auto | gloo | nccl."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Hang deadline of a multi-rank run, seconds: its "
                                            "ranks are dumped and killed then (default: max(1800, steps x weights x "
                                            "3e-7) s: 1800 for quick, 2140 for chapter)."),
    compiled_ops: Optional[bool] = typer.Option(None, "--compiled-ops/--no-compiled-ops", help="Allow DeepSpeed's JIT-built ops (shm comm, FusedAdam): minutes on first use."),
    results_dir: Optional[str] = typer.Option(None, "--results-dir", help="Results root (default $MOEBENCH_RESULTS or ./results)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON only."),
    _local_rank: Optional[int] = typer.Option(None, "--local_rank", "--local-rank", hidden=True,
                                              help="Passed by the `deepspeed` launcher; LOCAL_RANK is read instead."),
) -> None:
    """Train the DeepSpeed-MoE Transformer through DeepSpeed's engine and compare with the chapter."""
    from moebench import deepspeed_run  # imports torch: keep `moebench --help` fast

    config = deepspeed_run.resolve_config(preset, dict(
        experts=_expert_counts(experts), layers=layers, d_model=d_model, d_hidden=d_hidden, heads=heads,
        top_k=top_k, capacity_factor=capacity_factor, eval_capacity_factor=eval_capacity_factor,
        min_capacity=min_capacity, noisy_gate_policy=noisy_gate_policy, use_residual=use_residual,
        drop_tokens=drop_tokens, use_rts=use_rts, ep_size=ep_size, zero_stage=zero_stage,
        ds_config_path=ds_config, aux_loss_coef=aux_loss_coef, epochs=epochs, batch=batch, seq=seq,
        samples=samples, lr=lr, seed=seed, world_size=world_size, backend=backend, timeout_s=timeout,
        compiled_ops=compiled_ops))
    results.check_root(results_dir, deepspeed_run.KIND)
    if not as_json:
        typer.echo(f"deepspeed-moe: experts {list(config.experts_per_layer)}, top-{config.top_k}, "
                   f"ep_size {config.ep_size}, ZeRO {config.zero_stage}, {config.world_size} rank(s) over "
                   f"{deepspeed_run.comm_backend(config)}, {config.epochs} epochs x {config.steps_per_epoch} steps "
                   f"(preset {config.preset})")
    run_and_report(lambda: deepspeed_run.run(config, results_root=results_dir, show_progress=not as_json),
                   as_json=as_json, print_report=_print_report)

def _print_report(summary: dict, run_path) -> None:
    from rich.console import Console

    console = Console()
    console.print(params_table(summary["params"], f"parameters (global model, ep_size {summary['ep_size']})"))
    test = summary["test"]
    console.print(f"test batch: input {tuple(test['input_shape'])} -> output {tuple(test['output_shape'])}, "
                  f"loss {test['loss']:.6f}")
    routing = summary["routing"]
    per_layer = ", ".join(f"layer {r['layer']} {100 * r['dropped_route_frac']:.2f} % / "
                          f"{100 * r['dropped_token_frac']:.2f} % (capacity {r['capacity_per_expert']})"
                          for r in routing["per_layer"])
    console.print(f"dropped at capacity (training): {100 * routing['dropped_route_frac']:.2f} % of "
                  f"{routing['routes']:,} routes, {100 * routing['dropped_token_frac']:.2f} % of "
                  f"{routing['tokens']:,} tokens lost every route [routes / tokens: {per_layer}]")
    t = summary["timings"]
    console.print(f"wall {summary['wall_time_s']:.1f} s: import deepspeed {t['import_deepspeed_s']:.1f} s, "
                  f"init_distributed {t['init_distributed_s']:.2f} s, deepspeed.initialize "
                  f"{t['deepspeed_initialize_s']:.2f} s, training {t['train_s']:.1f} s")
    console.print("average loss per epoch: " + ", ".join(f"{v:.6f}" for v in summary["epoch_loss"]))
    console.print(report.comparison_table(summary["chapter_comparison"], "measured vs chapter 6 (DeepSpeed-MoE)"))
    console.print(f"results: {run_path}")

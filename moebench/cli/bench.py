"""`moebench bench`: forward + backward of one MoE layer (ideal, dense, reference, DeepSpeed,
fmoe, grouped-mm) over a sweep, with medians, spreads and same-process ratios."""

from __future__ import annotations

import json
from typing import Optional

import typer

from moebench.cli import flags

app = typer.Typer()


def _ints(text: str, flag: str) -> list[int]:
    from moebench.errors import UserError

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"needs comma-separated integers, got {text!r}", flag=flag) from None
    if not values or any(v <= 0 for v in values):
        raise UserError(f"needs positive integers, got {text!r}", flag=flag)
    return values


@app.command("bench")
def bench(
    quick: bool = typer.Option(False, "--quick", help="E 4,16; T 1024; k 2; d 256/1024; 1 repeat."),
    experts: str = typer.Option("4,16,64", "--experts", help="Comma-separated expert counts."),
    tokens: str = typer.Option("2048,8192", "--tokens", help="Comma-separated tokens per layer call."),
    top_k: str = typer.Option("2", "--top-k", help="Comma-separated k values."),
    d_model: int = typer.Option(512, "--d-model"),
    d_hidden: int = typer.Option(2048, "--d-hidden"),
    repeats: Optional[int] = typer.Option(None, "--repeats", min=1, help="Timed runs per layer [3; --quick 1]."),
    warmup: int = typer.Option(1, "--warmup", min=0),
    layers: str = typer.Option(",".join(("ideal", "dense", "reference", "deepspeed-cf1", "deepspeed-cf2",
                                         "fmoe", "grouped-mm")), "--layers", help="Comma-separated layers."),
    no_profile: bool = typer.Option(False, "--no-profile", help="Skip the torch.profiler breakdown."),
    results_dir: Optional[str] = flags.shared_option("results_dir"),
    as_json: bool = flags.shared_option("as_json"),
) -> None:
    """Time one MoE layer's forward + backward against the per-expert GEMM bound and DeepSpeed."""
    from moebench import bench as core
    from moebench import results
    from moebench.errors import UserError

    if quick:
        experts, tokens, top_k, d_model, d_hidden = "4,16", "1024", "2", 256, 1024
        repeats = repeats or 1
    repeats = repeats or 3
    names = tuple(n.strip() for n in layers.split(",") if n.strip())
    unknown = [n for n in names if n not in core.LAYERS]
    if unknown or not names:
        raise UserError(f"unknown layer(s) {unknown}; choose from {', '.join(core.LAYERS)}", flag="--layers")
    points = [core.Point(e, t, k, d_model, d_hidden) for k in _ints(top_k, "--top-k")
              for t in _ints(tokens, "--tokens") for e in _ints(experts, "--experts")]
    bad = [p for p in points if p.top_k > p.experts]
    if bad:
        raise UserError(f"k={bad[0].top_k} exceeds experts={bad[0].experts}", flag="--top-k")
    run = results.RunDir.create("bench", "quick" if quick else "sweep", results_dir)
    log = None if as_json else (lambda m: typer.echo(m, err=True))
    try:
        result = core.run_sweep(points, names, repeats=repeats, warmup=warmup, profile=not no_profile, log=log)
    except BaseException:
        run.finish("failed", {})
        raise
    run.write_json("bench.json", result)
    plots = core.plot(result, run.path)
    summary = run.finish("ok", {"rows": result["rows"], "breakdown": result["breakdown"],
                                "threads": result["threads"], "memory_method": result["memory_method"],
                                "grouped_mm_requirements": result["grouped_mm_requirements"],
                                "plots": [str(p) for p in plots]})
    if as_json:
        typer.echo(json.dumps({**summary, "run_path": str(run.path)}, indent=2, default=str))
        return
    typer.echo(core.format_table(result))
    typer.echo(f"results: {run.path}")

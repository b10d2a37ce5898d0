"""`moebench bench`: forward + backward of one MoE layer (ideal, dense, reference, DeepSpeed,
fmoe, grouped-mm) over a sweep, the expert-parallel layers on several ranks, all-to-all alone,
and (--train) one training step of each variant's preset phase by phase."""

from __future__ import annotations

import json
from typing import Optional

import typer

from moebench.cli import flags

app = typer.Typer()

QUICK = {"experts": "4,16", "tokens": "1024", "top_k": "2", "d_model": 256, "d_hidden": 1024, "world_size": "1,2"}
"""--quick: small enough to run in well under a minute on 2 cores, every section still present."""


def _ints(text: str, flag: str) -> list[int]:
    from moebench.errors import UserError

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"needs comma-separated integers, got {text!r}", flag=flag) from None
    if not values or any(v <= 0 for v in values):
        raise UserError(f"needs positive integers, got {text!r}", flag=flag)
    return values


def _names(text: str, known: tuple[str, ...], flag: str) -> tuple[str, ...]:
    from moebench.errors import UserError

    names = tuple(n.strip().lower() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UserError(f"unknown layer(s) {unknown or [text]}; choose from {', '.join(known)}", flag=flag)
    return names


EXAMPLES = """Examples:

\b
  moebench bench --quick                  every section, small, under a minute
  moebench bench --experts 8,32 --tokens 4096 --layer-kinds ideal,reference
  moebench bench --train --preset quick   one training step, phase by phase"""


@app.command("bench", epilog=EXAMPLES)
def bench(
    quick: bool = typer.Option(False, "--quick", help="E 4,16; T 1024; k 2; d 256/1024; ranks 1,2; 1 repeat."),
    experts: str = typer.Option("4,16,64", "--experts", metavar="N,N,...", help="Comma-separated expert counts."),
    tokens: str = typer.Option("2048,8192", "--tokens", metavar="N,N,...",
                               help="Comma-separated tokens per layer call (per rank)."),
    top_k: str = typer.Option("2", "--top-k", metavar="K,K,...", help="Comma-separated k values."),
    d_model: int = typer.Option(512, "--d-model", min=1, metavar="N", help="Model width: each token's size."),
    d_hidden: int = typer.Option(2048, "--d-hidden", min=1, metavar="N", help="Hidden width of each expert's MLP."),
    world_size: str = typer.Option("1,2,4", "--world-size", "-n", metavar="N,N,...",
                                   help="Comma-separated rank counts for the expert-parallel layers."),
    repeats: Optional[int] = typer.Option(None, "--repeats", min=1, metavar="N",
                                          help="Timed runs per layer [3; --quick 1]."),
    warmup: int = typer.Option(1, "--warmup", min=0, metavar="N", help="Untimed runs per layer before timing."),
    layers: str = typer.Option("ideal,dense,reference,reference-balanced,deepspeed-cf1,deepspeed-cf2,fmoe,grouped-mm",
                               "--layer-kinds", metavar="KIND,...",
                               help="Comma-separated one-process layer kinds to time (not `run`'s --layers, "
                                    "a count of Transformer blocks)."),
    layers_old: Optional[str] = typer.Option(None, "--layers", hidden=True, help="Old spelling of --layer-kinds."),
    ep_layers: str = typer.Option("reference-ep,deepspeed-ep-cf1", "--ep-layer-kinds", metavar="KIND,...|none",
                                  help="Comma-separated expert-parallel layer kinds ('none' to skip them)."),
    ep_layers_old: Optional[str] = typer.Option(None, "--ep-layers", hidden=True,
                                                help="Old spelling of --ep-layer-kinds."),
    comm: bool = typer.Option(False, "--comm", help="Also time the all-to-all exchange alone (gloo; NCCL too "
                              "where every rank has a GPU)."),
    train: bool = typer.Option(False, "--train", help="Instead of the layer sweep: one training step of each "
                               "variant's --preset, phase by phase, against FLOP and bandwidth bounds."),
    preset: str = typer.Option("chapter", "--preset", metavar="NAME", help="The preset --train times."),
    no_profile: bool = typer.Option(False, "--no-profile", help="Skip the torch.profiler breakdowns."),
    timeout: float = typer.Option(900.0, "--timeout", metavar="SECONDS",
                                  help="Hang deadline of each multi-rank launch: hung ranks are dumped and killed."),
    results_dir: Optional[str] = flags.shared_option("results_dir"),
    as_json: bool = flags.shared_option("as_json"),
) -> None:
    """Time one MoE layer's forward + backward against the per-expert GEMM bound and DeepSpeed."""
    from moebench.bench import core
    from moebench.bench.parallel import EP_LAYERS
    from moebench.config import require_positive, require_world_size
    from moebench.distributed.env import is_launched_rank
    from moebench.errors import UserError

    if is_launched_rank():  # it times one process, then starts its own ranks: one rank of a job cannot
        raise UserError("bench times one process, then starts its own local ranks, but RANK and WORLD_SIZE say "
                        "this process is one rank of a torchrun / deepspeed launch; run `moebench bench` "
                        "without a launcher")
    if quick:
        experts, tokens, top_k, d_model, d_hidden, world_size = (QUICK[k] for k in (
            "experts", "tokens", "top_k", "d_model", "d_hidden", "world_size"))
        repeats = repeats or 1
    require_positive({"--timeout": timeout})
    if not preset.strip():
        raise UserError("must name a preset, e.g. chapter", flag="--preset")
    kinds_flag, ep_flag = "--layer-kinds", "--ep-layer-kinds"
    if layers_old is not None:  # an error names the spelling the user typed
        layers, kinds_flag = layers_old, "--layers"
    if ep_layers_old is not None:
        ep_layers, ep_flag = ep_layers_old, "--ep-layers"
    names = _names(layers, core.LAYERS, kinds_flag)
    ep_names = () if ep_layers.strip().lower() == "none" else _names(ep_layers, EP_LAYERS, ep_flag)
    worlds = _ints(world_size, "--world-size")
    for w in worlds:
        require_world_size(w)
    points = [core.Point(e, t, k, d_model, d_hidden) for k in _ints(top_k, "--top-k")
              for t in _ints(tokens, "--tokens") for e in _ints(experts, "--experts")]
    bad = [p for p in points if p.top_k > p.experts]
    if bad:
        raise UserError(f"k={bad[0].top_k} exceeds experts={bad[0].experts}", flag="--top-k")
    spec = core.BenchSpec(points=points, layers=names, ep_layers=ep_names, world_sizes=worlds,
                          repeats=repeats or 3, warmup=warmup, profile=not no_profile, comm=comm,
                          train=train, preset=preset, timeout_s=timeout)
    if train:
        core.check_preset(preset)
    summary = core.run_bench(spec, results_dir, name="train" if train else ("quick" if quick else "sweep"),
                             log=None if as_json else (lambda m: typer.echo(m, err=True)))
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    typer.echo(core.format_summary(summary))
    typer.echo(f"results: {summary['run_path']}")

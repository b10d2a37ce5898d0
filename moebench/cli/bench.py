"""`moebench bench`: forward + backward of one MoE layer (ideal, dense, reference, DeepSpeed,
fmoe, grouped-mm) over a sweep, the expert-parallel layers on several ranks, all-to-all alone,
and (--train) one training step of each variant's preset phase by phase."""

from __future__ import annotations

import json
from typing import Optional

import typer

from moebench import config as config_tree
from moebench.bounds import Items, Name, Number
from moebench.cli import flags
from moebench.cli.help import LISTS, PanelCommand

app = typer.Typer()

MAX_TOKENS = 2**24
"""Tokens per layer call: 16 M (the memory estimate refuses far fewer at any real width)."""
MAX_REPEATS = 1000
"""Timed calls per layer and point."""


def _layer_names() -> list[str]:
    from moebench.bench.core import LAYERS

    return list(LAYERS)


def _ep_layer_names() -> list[str]:
    from moebench.bench.parallel import EP_LAYERS

    return list(EP_LAYERS)


def _common_presets() -> list[str]:
    from moebench import variants

    names = [set(config_tree.preset_names(v.name)) for v in variants.VARIANTS]
    return sorted(set.intersection(*names))


BOUNDS = {
    "--experts": Items(item=config_tree.positive(config_tree.MAX_EXPERTS, "512x Switch's 2048"), example="4,16"),
    "--tokens": Items(item=config_tree.positive(MAX_TOKENS, "16 M"), example="1024"),
    "--top-k": Items(item=config_tree.positive(config_tree.MAX_TOP_K), example="2"),
    "--d-model": config_tree.positive(config_tree.MAX_WIDTH, "85x GPT-3's width"),
    "--d-hidden": config_tree.positive(config_tree.MAX_HIDDEN, "4x the --d-model bound"),
    "--world-size": Items(item=config_tree.WORLD_SIZE_BOUND, example="1,2"),
    "--repeats": config_tree.positive(MAX_REPEATS),
    "--warmup": Number(integer=True, min=0, max=MAX_REPEATS, why="0: no warm-up"),
    "--layer-kinds": Items(item=Name(what="layer", choices=_layer_names), example="reference"),
    "--ep-layer-kinds": Items(item=Name(what="layer", choices=_ep_layer_names), example="reference-ep",
                              keywords=("none",)),
    "--preset": Name(what="preset", choices=_common_presets),
    "--timeout": config_tree.TIMEOUT_BOUND,
}
BOUNDS["--layers"] = BOUNDS["--layer-kinds"]  # the old spellings, hidden
BOUNDS["--ep-layers"] = BOUNDS["--ep-layer-kinds"]
"""Every valued option of bench: its bound (moebench.bounds), read through it before anything runs."""


def _opt(default, *names, **kwargs):
    return flags.bounded_option(default, *names, bound=BOUNDS[names[0]], **kwargs)


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
  moebench bench --train --preset quick   one training step, phase by phase

-n/--world-size here is a list of rank counts to sweep (run and verify-parity take one count).

""" + LISTS

WHAT = "What to time"
SWEEP = "The sweep"


@app.command("bench", epilog=EXAMPLES, cls=PanelCommand)
def bench(
    ctx: typer.Context,
    quick: bool = typer.Option(False, "--quick", rich_help_panel=WHAT, help="E 4,16; T 1024; k 2; d 256/1024; "
                               "ranks 1,2; 1 repeat (a flag given beside it wins)."),
    experts: str = _opt("4,16,64", "--experts", rich_help_panel=SWEEP, metavar="N,N,...", help="Expert counts."),
    tokens: str = _opt("2048,8192", "--tokens", rich_help_panel=SWEEP, metavar="N,N,...",
                       help="Tokens per layer call (per rank)."),
    top_k: str = _opt("2", "--top-k", rich_help_panel=SWEEP, metavar="K,K,...", help="k values."),
    d_model: int = _opt(512, "--d-model", rich_help_panel=SWEEP, metavar="N", help="Model width: each token's size."),
    d_hidden: int = _opt(2048, "--d-hidden", rich_help_panel=SWEEP, metavar="N",
                         help="Hidden width of each expert's MLP."),
    world_size: str = _opt("1,2,4", "--world-size", "-n", rich_help_panel=SWEEP, metavar="N,N,...",
                           help="Rank counts for the expert-parallel layers."),
    repeats: Optional[int] = _opt(None, "--repeats", rich_help_panel=SWEEP, metavar="N",
                                  help="Timed runs per layer [default: 3; --quick 1]."),
    warmup: int = _opt(1, "--warmup", rich_help_panel=SWEEP, metavar="N",
                       help="Untimed runs per layer before timing."),
    layers: str = _opt("ideal,dense,reference,reference-balanced,deepspeed-cf1,deepspeed-cf2,fmoe,grouped-mm",
                       "--layer-kinds", rich_help_panel=SWEEP, metavar="KIND,...",
                       help="One-process layer kinds to time (not `run`'s --layers, a count of Transformer "
                            "blocks)."),
    layers_old: Optional[str] = _opt(None, "--layers", hidden=True, help="Old spelling of --layer-kinds."),
    ep_layers: str = _opt("reference-ep,deepspeed-ep-cf1", "--ep-layer-kinds", rich_help_panel=SWEEP,
                          metavar="KIND,...|none", help="Expert-parallel layer kinds ('none' to skip them)."),
    ep_layers_old: Optional[str] = _opt(None, "--ep-layers", hidden=True, help="Old spelling of --ep-layer-kinds."),
    comm: bool = typer.Option(False, "--comm", rich_help_panel=WHAT, help="Also time the all-to-all exchange alone "
                              "(gloo; NCCL too where every rank has a GPU)."),
    train: bool = typer.Option(False, "--train", rich_help_panel=WHAT, help="Instead of the layer sweep: one "
                               "training step of each variant's --preset, phase by phase, against FLOP and bandwidth "
                               "bounds."),
    preset: str = _opt("chapter", "--preset", rich_help_panel=WHAT, metavar="NAME", help="The preset --train times."),
    no_profile: bool = typer.Option(False, "--no-profile", rich_help_panel=WHAT,
                                    help="Skip the torch.profiler breakdowns."),
    timeout: float = _opt(900.0, "--timeout", metavar="SECONDS",
                          help="Hang deadline of each multi-rank launch: hung ranks are dumped and killed."),
    force: bool = typer.Option(False, "--force", help="Run even when the memory or work estimate refuses."),
    results_dir: Optional[str] = flags.shared_option("results_dir"),
    as_json: bool = flags.shared_option("as_json"),
) -> None:
    """Time one MoE layer's forward + backward against the per-expert GEMM bound and DeepSpeed."""
    from typer._click.core import ParameterSource

    from moebench import resources
    from moebench.bench import core
    from moebench.bench.parallel import EP_LAYERS
    from moebench.config import require_positive, require_world_size
    from moebench.errors import UserError
    from moebench.rankenv import is_launched_rank

    if is_launched_rank():  # it times one process, then starts its own ranks: one rank of a job cannot
        raise UserError("bench times one process, then starts its own local ranks, but RANK and WORLD_SIZE say "
                        "this process is one rank of a torchrun / deepspeed launch; run `moebench bench` "
                        "without a launcher")
    given = {"--" + name.replace("_", "-") for name in ctx.params
             if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE}
    if quick:  # the quick sizes fill what was not given: an explicit flag always wins
        values = {"experts": experts, "tokens": tokens, "top_k": top_k, "d_model": d_model, "d_hidden": d_hidden,
                  "world_size": world_size}
        values.update({k: v for k, v in QUICK.items() if "--" + k.replace("_", "-") not in given})
        experts, tokens, top_k, d_model, d_hidden, world_size = (values[k] for k in (
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
    else:  # memory and work before the results folder exists
        resources.require_bench_fits(points, layers=len(names), ep_layers=len(ep_names), world_sizes=worlds,
                                     calls=spec.repeats + spec.warmup, force=force, given=given)
    from moebench.results import check_root

    check_root(results_dir, "bench")  # the folder it will write, before the first measurement
    summary = core.run_bench(spec, results_dir, name="train" if train else ("quick" if quick else "sweep"),
                             log=None if as_json else (lambda m: typer.echo(m, err=True)))
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    typer.echo(core.format_summary(summary))
    typer.echo(f"results: {summary['run_path']}")

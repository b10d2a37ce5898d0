"""`moebench run <variant>`: one sub-command per registered variant, every flag derived from its
config (moebench/cli/flags.py). Flags -> config (preset <- flags) -> `train.run_variant` -> report."""

from __future__ import annotations

import json
import textwrap

import typer

from moebench import config as config_tree
from moebench import variants
from moebench.cli import flags
from moebench.cli.common import run_and_report

app = typer.Typer(help="Train a Transformer-MoE variant on random data and record the results.",
                  no_args_is_help=True)


@app.callback(invoke_without_command=True)
def _run(ctx: typer.Context, list_names: bool = flags.shared_option("list_names"),
         list_old: bool = typer.Option(False, "--list-names", hidden=True, help="Old spelling of --list.")) -> None:
    """Train a registered variant (see `moebench run --list`)."""
    if list_names or list_old:
        for variant in variants.VARIANTS:
            typer.echo(variant.name)
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit()


def _command(variant: variants.Variant):
    defaults = config_tree.load_preset(variant.name, variant.default_preset)
    params, to_overrides = flags.config_parameters(variant.config_cls, defaults)
    presets = ", ".join(config_tree.preset_names(variant.name))
    common = [
        flags._param("preset", str | None, typer.Option(
            None, "--preset", metavar="NAME", show_default=variant.default_preset,
            help=f"experiments/{variant.name}/<NAME>.json: {presets}. Flags override it.")),
        flags._param("show_config", bool, typer.Option(
            False, "--show-config", help="Print the resolved config (flags over preset) as JSON and exit.")),
        flags._param("force", bool, typer.Option(
            False, "--force", help="Run even when the memory estimate exceeds the available memory.")),
        flags._param("results_dir", str | None, flags.shared_option("results_dir")),
        flags._param("as_json", bool, flags.shared_option("as_json")),
    ]

    def command(preset, show_config, force, results_dir, as_json, **values) -> None:
        run_variant_command(variant, preset, to_overrides(values), show_config=show_config, force=force,
                            results_dir=results_dir, as_json=as_json)

    command.__doc__ = variant.description
    return flags.with_signature(command, common[:1] + params + common[1:])


def run_variant_command(variant, preset, overrides, *, show_config: bool, force: bool, results_dir,
                        as_json: bool) -> None:
    from moebench import resources, results, train
    from moebench.distributed.env import is_printer

    results.check_root(results_dir, variant.name)
    notes: list[str] = []
    config = variants.resolve_config(variant, preset, overrides, notes=notes)
    if is_printer():
        for note in notes:  # a file's value that replaced the preset's: said, never silent
            typer.echo(textwrap.fill(note, width=80, subsequent_indent="  "), err=True)
    if show_config:
        if is_printer():
            typer.echo(json.dumps(config_tree.as_dict(config), indent=2))
        return
    resources.require_fits(config, force=force)
    if is_printer() and not as_json:
        typer.echo(variant.headline(config), err=True)
    run_and_report(lambda: train.run_variant(variant, config, results_root=results_dir, show_progress=not as_json),
                   as_json=as_json, print_report=lambda summary, run_path: _print_report(variant, summary, run_path))


def _print_report(variant, summary: dict, run_path) -> None:
    from rich.console import Console

    from moebench import report
    from moebench.cli.common import params_table

    console = Console(highlight=False)
    params = summary["params"]
    console.print(params_table({"total": params["total"], **params["by_category"]},
                               f"parameters ({summary['moe_impl']}, ep_size {params['ep_size']})"))
    console.print(report.comparison_table(summary["chapter_comparison"], f"measured vs chapter 6 ({variant.name})"))
    steady = summary.get("tokens_per_s_steady")
    console.print(f"moe_impl {summary['moe_impl']}; loss per epoch: "
                  + ", ".join(f"{v:.6f}" for v in summary["epoch_loss"][:8])
                  + (" ..." if len(summary["epoch_loss"]) > 8 else ""))
    console.print(f"test loss {summary['test']['loss']:.4f}; {summary['steps']} steps in "
                  f"{summary['train_time_s']:.1f} s; {summary['tokens_per_s']:,.0f} tokens/s overall"
                  + (f", {steady:,.0f} steady (after {summary['warmup_steps']} warm-up steps)" if steady else ""))
    for line in variant.report_lines(summary):
        console.print(line)
    console.print(f"results: {run_path}")


for _variant in variants.VARIANTS:
    app.command(_variant.name, help=_variant.description)(_command(_variant))

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
from moebench.cli.help import LISTS, PanelCommand, WholeSentenceGroup

app = typer.Typer(help="Train a Transformer-MoE variant on random data and record the results.",
                  no_args_is_help=True, cls=WholeSentenceGroup)


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
        flags._param("preset", str | None, flags.bounded_option(
            None, "--preset", bound=preset_bound(variant.name), metavar="NAME", show_default=variant.default_preset,
            rich_help_panel=flags.PANELS["preset"],
            help=f"experiments/{variant.name}/<NAME>.json: {presets}. Flags override it.")),
        flags._param("show_config", bool, typer.Option(
            False, "--show-config", help="Print the resolved config (flags over preset) as JSON and exit.")),
        flags._param("force", bool, typer.Option(
            False, "--force", help="Run even when the memory estimate exceeds the available memory, or the work "
            "estimate a week.")),
        flags._param("results_dir", str | None, flags.shared_option("results_dir")),
        flags._param("as_json", bool, flags.shared_option("as_json")),
    ]

    def command(preset, show_config, force, results_dir, as_json, **values) -> None:
        run_variant_command(variant, preset, to_overrides(values), show_config=show_config, force=force,
                            results_dir=results_dir, as_json=as_json)

    command.__doc__ = variant.description
    return flags.with_signature(command, common[:1] + params + common[1:])


def preset_bound(variant_name: str):
    """--preset: a preset name of this variant (checked for length and kind before any file is opened)."""
    from moebench.bounds import Name

    return Name(what="preset", choices=lambda: config_tree.preset_names(variant_name))


def run_variant_command(variant, preset, overrides, *, show_config: bool, force: bool, results_dir,
                        as_json: bool) -> None:
    from moebench import train
    from moebench.rankenv import is_printer

    notes: list[str] = []
    config = variants.checked_config(variant, preset, overrides, results_dir=results_dir, force=force, notes=notes)
    if is_printer():
        for note in notes:  # a file's value that replaced the preset's: said, never silent
            typer.echo(textwrap.fill(note, width=80, subsequent_indent="  "), err=True)
    if show_config:
        if is_printer():
            typer.echo(json.dumps(config_tree.as_dict(config), indent=2))
        return
    config_tree.require_launch_env()  # before the headline: a refused run says one line only
    if is_printer() and not as_json:
        from moebench.console import terminal_console

        terminal_console(stderr=True).print(variant.headline(config), markup=False)  # wrapped at words
    run_and_report(lambda: train.run_variant(variant, config, results_root=results_dir, show_progress=not as_json),
                   as_json=as_json, print_report=lambda summary, run_path: _print_report(variant, summary, run_path))


def _print_report(variant, summary: dict, run_path) -> None:
    from moebench import report
    from moebench.cli.common import params_table
    from moebench.console import print_fitting, terminal_console

    console = terminal_console()
    params = summary["params"]
    console.print(params_table({"total": params["total"], **params["by_category"]},
                               f"parameters ({summary['moe_impl']}, ep_size {params['ep_size']})"))
    if summary.get("chapter_comparable", True):
        rows, title = summary["chapter_comparison"], f"measured vs chapter 6 ({variant.name})"
        print_fitting(console, report.comparison_table(rows, title),
                      report.comparison_table(rows, title, stacked=True))
    else:  # said once: a table of "-99.9 %" rows would compare two different experiments
        from moebench.report.chapter import note_lines

        for line in note_lines(summary["chapter_note"]):
            console.print(line)
    steady = summary.get("tokens_per_s_steady")
    console.print(f"moe_impl {summary['moe_impl']}; loss per epoch: "
                  + ", ".join(f"{v:.6f}" for v in summary["epoch_loss"][:8])
                  + (" ..." if len(summary["epoch_loss"]) > 8 else ""))
    console.print(f"test loss {summary['test']['loss']:.4f}; {summary['steps']} steps in "
                  f"{summary['train_time_s']:.1f} s; {summary['tokens_per_s']:,.0f} tokens/s overall"
                  + (f", {steady:,.0f} steady (after {summary['warmup_steps']} warm-up steps; the progress "
                     "bar's figure)" if steady else ""))
    machine = summary.get("machine") or {}
    if machine.get("warning"):
        console.print(f"[yellow]warning: {machine['warning']}[/]", highlight=False)
    for line in variant.report_lines(summary):
        console.print(line)
    console.print(f"results: {run_path}")


def _examples(variant: variants.Variant) -> str:
    """The help's examples: the default run, the other presets, two ranks (from the registry)."""
    name, default = variant.name, variant.default_preset
    others = [p for p in config_tree.preset_names(name) if p != default]
    lines = [(f"moebench run {name}", f"the {default} preset")]
    lines += [(f"moebench run {name} --preset {p}", "") for p in others]
    lines += [(f"moebench run {name} -n 2 --steps 20", "two local ranks, 20 steps")]
    lines += [(f"moebench run {name} --show-config", "the resolved config; runs nothing")]
    return ("Examples:\n\n\b\n" + "\n".join(f"  {cmd:<40} {what}".rstrip() for cmd, what in lines)
            + f"\n\n{LISTS}")


for _variant in variants.VARIANTS:
    app.command(_variant.name, help=_variant.description, epilog=_examples(_variant), cls=PanelCommand)(
        _command(_variant))

"""`moebench run <variant>`: one sub-command per registered variant."""

from __future__ import annotations

import typer

from moebench import variants

app = typer.Typer(help="Train a Transformer-MoE variant on random data and record the results.",
                  no_args_is_help=True)


@app.callback(invoke_without_command=True)
def _run(
    ctx: typer.Context,
    list_names: bool = typer.Option(False, "--list-names", help="Print the registered variant names, one a line."),
) -> None:
    """Train a registered variant (see `moebench run --list-names`)."""
    if list_names:
        for v in variants.VARIANTS:
            typer.echo(v.name)
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit()


for _variant in variants.VARIANTS:
    app.command(_variant.name, help=_variant.description)(variants.load_command(_variant))

"""The `moebench` command: one Typer app per command group, composed here with `add_typer`."""

from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup

from moebench import __version__
from moebench.errors import RunFailed, UserError


class _Group(TyperGroup):
    """Root group: the one place errors meant for users become messages and exit codes.

    UserError (bad input) -> one line, exit 2. RunFailed (a run started and failed; its folder
    says so) -> the reason and the folder, exit 1.
    """

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=exc.exit_code) from None
        except RunFailed as exc:
            where = f"\nresults: {exc.run_path}" if exc.run_path else ""
            typer.echo(f"run failed: {exc}{where}", err=True)
            raise typer.Exit(code=exc.exit_code) from None


app = typer.Typer(
    cls=_Group,
    name="moebench",
    help="Reproduce and verify the Mixture-of-Experts experiments of chapter 6 "
    "(fastmoe and DeepSpeed-MoE in a Transformer), on CPU or GPU.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"moebench {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """moebench: env-check, run <variant>, verify-parity."""


def _compose() -> None:
    from moebench.cli import envcheck, parity, run

    app.add_typer(envcheck.app, name="env-check")
    app.add_typer(run.app, name="run")
    app.add_typer(parity.app, name="verify-parity")


_compose()


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)

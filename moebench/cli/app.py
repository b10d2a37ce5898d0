"""The `moebench` command: one Typer app per command group, composed here with `add_typer`."""

from __future__ import annotations

import sys

import typer

# typer >= 0.29 vendors click; its usage errors live here (pyproject pins typer>=0.29)
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
from typer.core import TyperGroup

from moebench import __version__, signals
from moebench.errors import RunFailed, UserError


class _Group(TyperGroup):
    """Root group: the one place errors meant for users become messages and exit codes.

    - UserError (bad input) and flag-parsing errors -> one line `error: ...`, exit 2;
    - RunFailed (a run started and failed; its folder says so) -> the reason and the folder, exit 1;
    - Ctrl-C / SIGTERM -> `interrupted`, exit 130 (the run's files say "interrupted").
    """

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                              standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except NoArgsIsHelpError as exc:  # `moebench` alone: the help, not an error line
            typer.echo(exc.ctx.get_help() if exc.ctx else str(exc), err=True)
            code = exc.exit_code
        except UsageError as exc:
            where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
            typer.echo(f"error: {exc.format_message()}{where}", err=True)
            code = exc.exit_code
        except ClickException as exc:
            exc.show()
            code = exc.exit_code
        except typer.Abort:
            typer.echo("interrupted", err=True)
            code = 130
        if signals.pending():  # a Ctrl-C / SIGTERM not acted on: 130 (after a commit, the files decide)
            code = 130
        if standalone_mode:
            sys.exit(code)
        return code

    def invoke(self, ctx):
        try:
            signals.check()  # a safe point: a signal during the start-up imports stops here
            return super().invoke(ctx)
        except UserError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=exc.exit_code) from None
        except RunFailed as exc:
            where = f"\nresults: {exc.run_path}" if exc.run_path else ""
            typer.echo(f"run failed: {exc}{where}", err=True)
            raise typer.Exit(code=exc.exit_code) from None
        except KeyboardInterrupt:
            typer.echo(signals.interrupted_message(), err=True)
            raise typer.Exit(code=130) from None


app = typer.Typer(
    cls=_Group,
    name="moebench",
    help="Reproduce and verify the Mixture-of-Experts experiments of chapter 6 "
    "(fastmoe and DeepSpeed-MoE in a Transformer), on CPU or GPU.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # plain click help: wraps at any width, no <bool> placeholders
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"moebench {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Let every rank print (otherwise only rank 0 talks)."),
) -> None:
    """moebench: env-check, run <variant>, verify-parity."""
    import os

    from moebench.distributed.env import DEBUG_ENV

    if debug:
        os.environ[DEBUG_ENV] = "1"  # read by every rank, forked or started by torchrun


def _compose() -> None:
    from moebench.cli import bench, envcheck, parity, report, run, runs

    app.add_typer(envcheck.app)  # a Typer with one command: merged, so `env-check` is a leaf command
    app.add_typer(run.app, name="run")
    app.add_typer(parity.app)
    app.add_typer(runs.app)
    app.add_typer(bench.app)
    app.add_typer(report.app)


_compose()


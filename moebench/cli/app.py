"""The `moebench` command: one Typer app per command group, composed here with `add_typer`."""

from __future__ import annotations

import re
import sys
import time

import typer

# typer >= 0.29 vendors click; its usage errors live here (pyproject pins typer>=0.29)
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError

from moebench import bounds, signals
from moebench.cli.help import CONTEXT_SETTINGS, WholeSentenceGroup
from moebench.errors import RendezvousFailed, RunFailed, UserError
from moebench.version import __version__

PEER_REFUSAL_GRACE_S = 3.0
"""A rank other than 0 that refuses bad input waits this long before exiting, so that rank 0,
refusing the same input, prints its error first (torchrun stops every rank at the first exit, and
rank 0 would otherwise print "interrupted" instead of the reason)."""


class _Group(WholeSentenceGroup):
    """Root group: the one place errors meant for users become messages and exit codes.

    - UserError (bad input) and flag-parsing errors -> one line `error: ...`, exit 2;
    - RunFailed (a run started and failed; its folder says so) -> the reason and the folder, exit 1;
    - Ctrl-C / SIGTERM -> `interrupted`, exit 130 (the run's files say "interrupted").
    """

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = list(sys.argv[1:] if args is None else args)
        bounds.remember_argv(args)  # a refusal names the spelling typed (-n or --world-size)
        try:
            if "--version" in args and args[0].startswith("-") and len(args) > 1:  # `moebench --version extra`
                raise UsageError(f"--version: takes no other argument, got "
                                 f"{' '.join(a for a in args if a != '--version')[:60]!r}")
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                              standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except NoArgsIsHelpError as exc:  # `moebench` alone: the help, not an error line
            typer.echo(exc.ctx.get_help() if exc.ctx else str(exc), err=True)
            code = exc.exit_code
        except UsageError as exc:
            where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
            message = re.sub(r"'([^']{40})[^']{8,}'", r"'\1...'", exc.format_message())  # a 5000-char value: cut
            typer.echo(f"error: {message}{where}", err=True)
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
        except UserError as exc:  # every rank of a launched job refuses the same input: rank 0 says it
            if _talks():
                text, typed = str(exc), bounds.as_typed(exc.flag)
                if exc.flag and typed != exc.flag and text.startswith(f"{exc.flag}: "):  # `-n 3` -> -n/--world-size
                    text = f"{typed}: {text[len(exc.flag) + 2:]}"
                typer.echo(f"error: {text}", err=True)
            else:  # exit after rank 0, so that the launcher tears the job down once rank 0 has said why
                time.sleep(PEER_REFUSAL_GRACE_S)
            raise typer.Exit(code=exc.exit_code) from None
        except RunFailed as exc:
            where = f"\nresults: {exc.run_path}" if exc.run_path else ""
            typer.echo(f"run failed: {exc}{where}", err=True)
            raise typer.Exit(code=exc.exit_code) from None
        except RendezvousFailed as exc:  # every rank says it: each waited for the others on its own
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=exc.exit_code) from None
        except KeyboardInterrupt as exc:  # on a launched job's other ranks, the launcher's SIGTERM: rank 0 says why
            if _talks():
                typer.echo(signals.interrupted_message(getattr(exc, "run_path", None)), err=True)
            raise typer.Exit(code=130) from None


def _talks() -> bool:
    """Only rank 0 of a launched job prints (`moebench --debug` lets every rank talk)."""
    from moebench.rankenv import debug, is_printer

    return is_printer() or debug()


app = typer.Typer(
    cls=_Group,
    name="moebench",
    help="Is expert parallelism right? moebench checks Mixture-of-Experts layers on several ranks against one "
    "process: DeepSpeed, transformers, torchtitan, NeMo Automodel, Megatron-core, fairscale, or your own. It also "
    "reproduces the fastmoe and DeepSpeed-MoE experiments of a book's chapter 6, on CPU or GPU.",
    no_args_is_help=True,
    context_settings=CONTEXT_SETTINGS,
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

    from moebench.rankenv import DEBUG_ENV

    if debug:
        os.environ[DEBUG_ENV] = "1"  # read by every rank, forked or started by torchrun


def _compose() -> None:
    from moebench.cli import bench, checkpoint, envcheck, gpucheck, parity, report, run, runs

    app.add_typer(envcheck.app)  # a Typer with one command: merged, so `env-check` is a leaf command
    app.add_typer(run.app, name="run")
    app.add_typer(parity.app)
    app.add_typer(runs.app)
    app.add_typer(bench.app)
    app.add_typer(report.app)
    app.add_typer(gpucheck.app)
    app.add_typer(checkpoint.app)


_compose()


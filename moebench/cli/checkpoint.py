"""`moebench checkpoint PATH`: audit an expert-parallel checkpoint on disk (one core call; print; exit code)."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from typing import Optional

import typer

from moebench import bounds
from moebench.checkpoint_audit.limits import EXPERTS_BOUND, FILE_BOUND, PATH_BOUND
from moebench.cli import flags
from moebench.cli.help import PanelCommand

app = typer.Typer()

PROGRESS_AFTER_S = 1.0
"""A progress line appears once an audit has read for this long (on a terminal only)."""
WIDTH = 80

EXAMPLES = """Examples:

\b
  moebench checkpoint ckpt/step-1000            DCP, DeepSpeed, safetensors
  moebench checkpoint ckpt/global_step10 --experts 64
  moebench checkpoint hf-export --against ckpt/step-1000"""


@app.command("checkpoint", epilog=EXAMPLES, cls=PanelCommand)
def checkpoint(
    path: str = typer.Argument(..., metavar="PATH", parser=bounds.Parser(PATH_BOUND, ("PATH",)),
                               help="The checkpoint's folder (DCP, DeepSpeed regular or universal, Megatron "
                               "torch_dist, safetensors)."),
    hf_config: Optional[str] = flags.bounded_option(
        None, "--hf-config", bound=FILE_BOUND, metavar="FILE",
        help="The model's config.json: its expert count must agree with the checkpoint's."),
    experts: Optional[int] = flags.bounded_option(
        None, "--experts", bound=EXPERTS_BOUND, metavar="N", help="Experts per MoE layer, over all ranks."),
    against: Optional[str] = flags.bounded_option(
        None, "--against", bound=PATH_BOUND, metavar="PATH2",
        help="The same model in another layout or format: every expert compared by global index."),
    as_json: bool = flags.shared_option("as_json"),
    results_dir: Optional[str] = flags.shared_option("results_dir"),
) -> None:
    """Audit a MoE checkpoint on disk, on CPU, one tensor at a time: every expert present once, counts
    that agree, chunks that tile, no replica, optimizer state whole; what it loads as.

    Exit code 0 sound, 1 a problem found, 2 bad input (nothing written).
    """
    from moebench.checkpoint_audit.run import audit_checkpoint
    from moebench.errors import UserError

    if hf_config is not None and experts is not None:
        raise UserError("cannot be combined with --experts (pick one source of the count)", flag="--hf-config")
    document, code = audit_checkpoint(path, hf_config=hf_config, experts=experts, against=against,
                                      results_dir=results_dir, progress=_progress() if not as_json else None)
    if as_json:
        typer.echo(json.dumps(document))
    else:
        _print(document)
    raise typer.Exit(code)


def _progress():
    """A progress line on stderr, on a terminal only, once the audit has taken more than a moment."""
    if not sys.stderr.isatty():
        return None
    start = time.monotonic()

    def show(done: int, total: int, name: str) -> None:
        if time.monotonic() - start < PROGRESS_AFTER_S:
            return
        line = f"reading {done / 2**20:,.0f} / {total / 2**20:,.0f} MiB  {name}"[:WIDTH - 1]
        sys.stderr.write("\r" + line.ljust(WIDTH - 1) if name else "\r" + " " * (WIDTH - 1) + "\r")
        sys.stderr.flush()
    return show


def _print(document: dict) -> None:
    def say(text: str) -> None:
        typer.echo(textwrap.fill(text, width=WIDTH, subsequent_indent="    ", break_on_hyphens=False,
                                 break_long_words=False))

    saved = ", ".join(f"{k} {v}" for k, v in document["saved"].items() if v is not None)
    say(f"{document['format']}: {document['tensors']} tensors, {document['bytes'] / 2**20:,.1f} MiB"
        + (f"; saved at {saved}" if saved else ""))
    for layer in document["layers"]:
        say(f"layer {layer['layer'] or '(top)'}: {layer['experts']} experts ({layer['stored']})")
    for line in document["loads"]:
        say(f"loads: {line}")
    for record in (document.get("against") or {}).get("layers", []):
        say(f"against layer {record['against_layer']}: {record['matched']} of {record['against_experts']} "
            "experts in place")
    for line in document["lines"]:
        say(line)
    say(f"{'sound' if not document['lines'] else str(len(document['lines'])) + ' problem(s)'}; "
        f"{document['elapsed_s']:.1f} s")
    typer.echo(f"saved {document['results_path']}")

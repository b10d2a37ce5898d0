"""The checkpoint-audit section: the `moebench checkpoint` audits, read from each run's checkpoint.json only.

One audit per checkpoint folder (the newest), newest first: the folder, its format, what it was saved at, the
verdict (sound / problems found) and every problem line in the audit's own words, the loads its framework supports
and the known traps, and the `--against` comparison where there is one. No audit: no section. A run whose file is
unreadable (damaged) is one line, and is named under the console's table like any damaged run.

The console form (`console_lines`) fits 80 columns: a folder's path is printed whole on a line of its own (folded, it
could not be copied); the loads, which never signal a problem, are in REPORT.md only.
"""

from __future__ import annotations

import dataclasses
import textwrap

from moebench.report import collect
from moebench.report.numbers import real
from moebench.report.render import Block, Bullets, Heading, Para, Table, clean

KIND = collect.CHECKPOINT_KIND
REPORT_FILE = "checkpoint.json"
"""moebench.checkpoint_audit.run.REPORT_FILE (the report does not import the audit)."""
HEADING = "Checkpoint audits (moebench checkpoint)"
SOUND, PROBLEMS = "sound", "problems found"
"""The verdicts, as the section words them (the document's `status`: "sound" / "problems")."""
TRAP = "trap:"
"""A line of the document's `loads` that starts so is a known trap, not a load."""
WIDTH = 80
CONSOLE_PROBLEMS = 8
"""Problem lines shown per audit on the console (REPORT.md has every one)."""


@dataclasses.dataclass(frozen=True)
class Audit:
    """One audit run, as the section shows it: either the document's fields, or why there is none (`unread`)."""

    run: collect.Run
    unread: str = ""
    """Why the run's checkpoint.json is not shown ("" when it is): the one line said in its place."""
    path: str = ""
    format: str = ""
    saved: str = ""
    verdict: str = ""
    lines: tuple[str, ...] = ()
    loads: tuple[str, ...] = ()
    traps: tuple[str, ...] = ()
    layers: str = ""
    optimizer: str = ""
    against: str = ""
    """--against's folder and format ("" without --against)."""
    against_layers: tuple[str, ...] = ()

    @property
    def sound(self) -> bool:
        return self.verdict == SOUND


def read(run: collect.Run) -> Audit:
    """What the section shows of one audit run (never raises: a damaged or missing file is `unread`)."""
    if run.damage:  # none of its files is used
        return Audit(run=run, unread=f"it is damaged ({run.damage})")
    doc = run.documents.get(REPORT_FILE)
    if doc is None:
        return Audit(run=run, unread=f"its folder has no {REPORT_FILE} (status {run.status})")
    loads = [str(line) for line in doc["loads"]]
    against = doc.get("against")
    return Audit(
        run=run, path=str(doc["path"]), format=str(doc["format"]), saved=saved_words(doc["saved"]),
        verdict=SOUND if doc["status"] == "sound" else PROBLEMS, lines=tuple(str(line) for line in doc["lines"]),
        loads=tuple(line for line in loads if not line.startswith(TRAP)),
        traps=tuple(line for line in loads if line.startswith(TRAP)),
        layers=_layer_words(doc["layers"]), optimizer=_optimizer_words(doc["optimizer"]),
        against=f"{against['path']} ({against['format']})" if isinstance(against, dict) else "",
        against_layers=tuple(_against_words(r) for r in against["layers"]) if isinstance(against, dict) else ())


def saved_words(saved: dict) -> str:
    """"ep_size 2, zero_stage 0" (the document's own keys, as `moebench checkpoint` prints them)."""
    return ", ".join(f"{key} {value}" for key, value in saved.items() if value is not None)


def _layer_words(layers: list) -> str:
    counts = list(dict.fromkeys("?" if layer["experts"] is None else str(layer["experts"]) for layer in layers))
    if not layers:
        return "no MoE layer found"
    each = f"{counts[0]} experts each" if len(counts) == 1 else f"experts {', '.join(counts)}"
    return f"{len(layers)} MoE layer(s), {each}"


def _optimizer_words(optimizer: dict) -> str:
    if not optimizer.get("present"):
        return "no optimizer state"
    steps = [s for s in (real(x) for x in optimizer.get("steps") or []) if s is not None]
    return "optimizer state" + (f" (step {', '.join(f'{s:g}' for s in steps)})" if steps else "")


def _against_words(record: dict) -> str:
    """One `--against` layer as `moebench checkpoint` prints it."""
    slots = record.get("slots")
    total = record.get("against_experts", len(slots) if isinstance(slots, list) else "?")
    layer = record.get("against_layer", record["layer"])
    return f"against layer {layer}: {record['matched']} of {total} experts in place"


def _verdict(audit: Audit) -> str:
    return SOUND if audit.sound else f"{PROBLEMS} ({len(audit.lines)})"


def blocks(runs: list[collect.Run]) -> list[Block]:
    """The section for the audits (newest first; none: no section)."""
    if not runs:
        return []
    audits = [read(run) for run in runs]
    shown = [a for a in audits if not a.unread]
    out: list[Block] = [Heading(HEADING), Para(
        f"{len(runs)} audit(s), newest first, the newest of each checkpoint folder: each read on CPU from the files "
        "alone by `moebench checkpoint` (docs/checkpoint.md) and shown from its checkpoint.json. A problem line is "
        "the audit's own, word for word.")]
    if shown:
        out.append(Table(headers=("checkpoint", "format", "saved at", "verdict", "audit"),
                         rows=tuple((a.path, a.format, a.saved or "-", _verdict(a), a.run.run_id) for a in shown),
                         classes=tuple("pass" if a.sound else "fail" for a in shown)))
    for audit in audits:
        out += _audit_blocks(audit)
    return out


def _audit_blocks(audit: Audit) -> list[Block]:
    if audit.unread:  # one line in the audit's place
        return [Para(f"Audit {audit.run.run_id} not shown: {audit.unread}.")]
    started = audit.run.summary.get("started_at", "?")
    saved = f"saved at {audit.saved}" if audit.saved else "no EP degree or ZeRO stage recorded by the format"
    out: list[Block] = [Heading(audit.path, 3), Para(
        f"Audit {audit.run.run_id} (started {started}): {audit.format}; {saved}; {audit.layers}; "
        f"{audit.optimizer}. Verdict: {_verdict(audit)}.")]
    if audit.lines:
        out += [Para(f"Problems ({len(audit.lines)}):"), Bullets(audit.lines)]
    if audit.loads:
        out += [Para("Loads its framework supports:"), Bullets(audit.loads)]
    if audit.traps:
        out += [Para("Known traps:"), Bullets(audit.traps)]
    if audit.against:
        out += [Para(f"Compared with --against {audit.against}, expert by expert:"),
                Bullets(audit.against_layers or ("no MoE layer paired",))]
    return out


def records(runs: list[collect.Run]) -> list[dict]:
    """The audits for the report's JSON (summary.json and `--json`): per run what the section shows."""
    out = []
    for audit in map(read, runs):
        record = {"run_id": audit.run.run_id, "run_path": str(audit.run.path)}
        if audit.unread:
            out.append({**record, "verdict": "not shown", "reason": audit.unread})
            continue
        out.append({**record, "path": audit.path, "format": audit.format, "verdict": audit.verdict,
                    "problems": list(audit.lines), "traps": list(audit.traps),
                    **({"against": audit.against} if audit.against else {})})
    return out


def console_lines(runs: list[collect.Run], width: int = WIDTH) -> list[str]:
    """The section on a terminal: per audit a line beside the library runs' (`checkpoint <run-id>: <verdict>,
    <format>`; a damaged run's `checkpoint <run-id> (damaged)`, its damage said under the table), the folder whole
    on its own line, then what it was saved at, its problem lines (the first CONSOLE_PROBLEMS), traps and
    --against, each folded to `width`."""
    out: list[str] = []

    def say(text: str, indent: str = "  ") -> None:  # a file's control characters written out, never sent
        out.extend(textwrap.wrap(clean(text), width=width, initial_indent=indent, subsequent_indent=indent + "    ",
                                 break_long_words=False, break_on_hyphens=False) or [indent])

    for audit in map(read, runs):
        if audit.run.damage:  # why: under the table, with every damaged run's
            out.append(f"{KIND:<10} {audit.run.run_id} (damaged)")
            continue
        if audit.unread:
            out.append(f"{KIND:<10} {audit.run.run_id} ({audit.run.status}): no {REPORT_FILE}")
            continue
        out.append(f"{KIND:<10} {audit.run.run_id}: {_verdict(audit)}, {clean(audit.format)}")
        out.append(f"  {clean(audit.path)}")  # whole: a folded path could not be copied
        if audit.saved:
            say(f"saved at {audit.saved}")
        for line in audit.lines[:CONSOLE_PROBLEMS]:
            say(line)
        if len(audit.lines) > CONSOLE_PROBLEMS:
            say(f"... and {len(audit.lines) - CONSOLE_PROBLEMS} more problem line(s): every one is in REPORT.md")
        for line in audit.traps:
            say(line)
        if audit.against:
            say(f"--against {audit.against}")
            for line in audit.against_layers:
                say(line, "    ")
    return out

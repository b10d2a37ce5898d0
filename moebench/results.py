"""The one results writer: `results/<kind>/<run-id>/`, atomic JSON, a line-flushed JSONL log.

Layout of a run folder (every command that records anything uses this and nothing else):
  config.json    the resolved configuration (with the backend that actually ran)
  env.json       env-check's summary of the machine
  params.json    parameter counts by category
  metrics.jsonl  one JSON object per line, flushed as it is written (a crash keeps every line)
  summary.json   status ("running" -> "ok" / "failed" / "interrupted"), headline numbers
  *.png          plots

Every JSON file is written to a temporary name in the same folder and renamed into place, so a
reader never sees half a file. The folder is created only when a run really starts: commands
validate their input first, so bad input leaves nothing under results/.

Over 400 lines: the one results writer and its reader (atomic files, the run folder's lifetime, read-back
through the schemas), kept together so a written file and its reading cannot drift apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from moebench.rankenv import launcher

RESULTS_ENV = "MOEBENCH_RESULTS"
"""Environment variable that moves the results root (default: ./results)."""

SCHEMAS = {
    "summary.json": "moebench.summary/1",
    "config.json": "moebench.config/1",
    "params.json": "moebench.params/1",
    "env.json": "moebench.env/1",
}
"""The `schema` key every JSON file of a run folder starts with; the JSON Schema of each is
moebench/schemas/<name>.schema.json (metrics.jsonl lines: metrics.schema.json)."""

STATUS_RUNNING = "running"
STATUS_OK = "ok"
STATUS_FAILED = "failed"
STATUS_INTERRUPTED = "interrupted"
STATUS_ABANDONED = "abandoned"
"""A run whose writer died without recording an end (SIGKILL, power loss): it said "running", and
its pid on its host is gone (or is another, younger process)."""


def results_root(root: str | os.PathLike | None = None) -> Path:
    """--results-dir, else $MOEBENCH_RESULTS, else ./results (an empty value counts as unset)."""
    chosen = root if root is not None and str(root) != "" else os.environ.get(RESULTS_ENV) or "results"
    return Path(chosen)


def check_root(root: str | os.PathLike | None, kind: str) -> Path:
    """Validate `--results-dir` before anything runs, so a run never fails half-way on it: the
    first existing part of <root>/<kind> must be a writable folder. Returns <root>/<kind>."""
    from moebench.errors import UserError

    if root is not None and str(root) == "":
        raise UserError("is empty; pass a folder (or leave it out for ./results)", flag="--results-dir")
    base = results_root(root).absolute()
    target = base / kind
    try:
        base.resolve()
    except (OSError, RuntimeError):  # RuntimeError before Python 3.13
        raise UserError(f"{base} cannot be resolved (a link loop); pass a folder", flag="--results-dir") from None
    folder = nearest_existing(target)
    if not folder.is_dir():
        raise UserError(f"{folder} exists and is not a folder; pass a folder", flag="--results-dir")
    run = run_folder_around(base)
    if run is not None:
        raise UserError(f"{base} is {'' if run == base.resolve() else 'inside '}the run folder {run}; pass the "
                        "results folder that holds <kind>/<run-id> folders (default ./results)", flag="--results-dir")
    if base.is_dir() and any(run_folder_around(child) == child.resolve() for child in _subfolders(base)):
        raise UserError(f"{base} is a folder of runs of one kind, not a results folder; pass the folder above it "
                        f"({base.parent})", flag="--results-dir")
    why = cannot_write_in(folder)
    if why is not None:
        raise UserError(f"cannot create {target}: {why}; pass a writable folder", flag="--results-dir")
    return target


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists (a link counts, even one that leads nowhere)."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def run_folder_around(path: Path) -> Path | None:
    """The run folder (a folder with a summary.json) that `path` is, or is inside; None when neither. Links are
    followed: a link to a run folder is that run folder."""
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):  # a link loop: no run folder can be found through it
        return None
    for folder in (resolved, *resolved.parents):
        try:
            if (folder / "summary.json").is_file():
                return folder
        except OSError:
            return None
    return None


def _subfolders(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.is_dir()][:64]  # a results folder's kinds are few
    except OSError:
        return []


def cannot_write_in(folder: Path) -> str | None:
    """Why nothing can be created in `folder` (None: something can): tried, not guessed from permission bits,
    which say "writable" for root in /proc or on a read-only mount."""
    import tempfile

    try:
        probe = tempfile.mkdtemp(prefix=".moebench-probe-", dir=folder)
    except OSError as exc:
        return f"{folder} is not writable ({exc.strerror or exc})"
    os.rmdir(probe)
    return None


def new_run_id(name: str = "") -> str:
    """Sortable to the microsecond: 20261122-015355-quick-421337 (the last part: the microseconds; two runs
    made in the same one are told apart by RunDir.create, which draws again)."""
    now = datetime.datetime.now()
    return "-".join([now.strftime("%Y%m%d-%H%M%S")] + ([name] if name else []) + [f"{now.microsecond:06d}"])


def run_order(path: Path) -> tuple[str, str]:
    """A run folder's place in time: its id's second, then what follows the name (microseconds; a random
    suffix for ids made before they carried them)."""
    return path.name[:15], path.name.rsplit("-", 1)[-1]


def to_jsonable(value: Any) -> Any:
    """Plain JSON types only; NaN / Inf become strings so the files stay strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # torch / numpy scalars and arrays
        return to_jsonable(value.tolist())
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return to_jsonable(dataclasses.asdict(value))
    return value


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _atomic(path, lambda f: (json.dump(to_jsonable(data), f, indent=2, sort_keys=False, allow_nan=False),
                                    f.write("\n")))


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write a text file so that a reader sees the old file or the whole new one, never half."""
    return _atomic(Path(path), lambda f: f.write(text))


def _atomic(path: Path, write: Callable[[Any], Any]) -> Path:
    """`write(file)` into a temporary name beside `path`, then rename it into place; when anything fails (a full
    disk), the temporary file is removed before the error goes on: nothing is left filling the disk."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_json(path: str | os.PathLike) -> Any:
    """Raw JSON, unchecked (tests; moebench itself reads results files back through `read_back`)."""
    with open(path) as f:
        return json.load(f)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Raw JSON lines, unchecked (tests; moebench itself reads them through `read_back`)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Damaged(ValueError):
    """A results file that cannot be trusted: unreadable, not text, not strict JSON, or not what its
    JSON Schema (moebench/schemas/) says. str() is "<file name>: <reason>", one line."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path.name}: {reason}")


def _not_strict(constant: str):
    raise ValueError(f"{constant} is not strict JSON (moebench writes non-finite numbers as strings)")


def _parse(text: str, path: Path, where: str = "") -> Any:
    try:
        return json.loads(text, parse_constant=_not_strict)
    except RecursionError:
        raise Damaged(path, f"{where}nested too deeply to be a moebench file") from None
    except ValueError as exc:
        cut = " (cut short?)" if not text.rstrip().endswith(("}", "]")) else ""
        raise Damaged(path, f"{where}not JSON{cut}: {str(exc).splitlines()[0]}") from None


def _check(path: Path, document: Any, where: str = "") -> None:
    from moebench import schemas

    try:
        error = schemas.first_error(path.name, document)
    except RecursionError:
        error = "nested too deeply to be a moebench file"
    if error is not None:
        raise Damaged(path, f"{where}{error}")


def read_back(path: str | os.PathLike, *, cut_tail_ok: bool = False) -> Any:
    """The one way moebench reads a results file back (summary, config, params, env, envcheck
    JSON; metrics.jsonl as a list of its lines): parsed as strict JSON and validated against the
    file's JSON Schema. Raises `Damaged` naming the file and what is wrong with it, and
    FileNotFoundError when it is absent (whether that matters is the caller's to judge).

    `cut_tail_ok`: a metrics.jsonl whose last line has no newline and does not parse is the
    cut of a writer that was killed mid-line; that line is left out instead of being damage
    (for runs that did not end "ok")."""
    from moebench import schemas

    path = Path(path)
    if path.name not in schemas.SCHEMA_FILES:
        raise ValueError(f"{path}: moebench has no schema for a file named {path.name!r}")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise Damaged(path, "is a folder, not a file") from None
    except OSError as exc:
        raise Damaged(path, f"cannot be read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Damaged(path, "is not UTF-8 text (binary?)") from None
    if path.name not in schemas.JSONL_FILES:
        document = _parse(text, path)
        _check(path, document)
        return document
    lines = text.splitlines(keepends=True)
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"line {number}: "
        if cut_tail_ok and number == len(lines) and not line.endswith("\n"):
            try:
                record = json.loads(line, parse_constant=_not_strict)
            except ValueError:
                break  # a killed writer's last line
        else:
            record = _parse(line, path, where)
        _check(path, record, where)
        records.append(record)
    return records


RUN_FILES = ("summary.json", "config.json", "params.json", "env.json", "envcheck.json", "gpucheck.json",
             "checkpoint.json", "metrics.jsonl")
"""The files of a run folder that have a schema, in the order `read_run` checks them."""


@dataclasses.dataclass(kw_only=True)
class RunFiles:
    """A run folder as read back: every file with a schema that it holds, each validated."""

    path: Path
    documents: dict[str, Any]
    """File name -> its validated content (metrics.jsonl: the list of its lines); damaged or
    absent files are not in it."""
    damage: str = ""
    """"<file>: <reason>" for the first damaged file ("" when none is)."""

    @property
    def summary(self) -> dict | None:
        return self.documents.get("summary.json")

    @property
    def config(self) -> dict | None:
        return self.documents.get("config.json")

    @property
    def status(self) -> str:
        """The run's status as a reader should see it: "damaged" when any of its files is,
        "abandoned" for a "running" run whose writer died, else what summary.json says."""
        if self.damage:
            return STATUS_DAMAGED
        return STATUS_ABANDONED if writer_gone(self.summary) else self.summary["status"]


STATUS_DAMAGED = "damaged"
"""A reader's status (never written): a file of the run folder is not what its schema says."""


def read_run(path: str | os.PathLike) -> RunFiles:
    """Read back every file with a schema in a run folder (see `read_back`); a missing
    summary.json is damage, the other files are optional."""
    path = Path(path)
    documents: dict[str, Any] = {}
    damage = ""
    for name in RUN_FILES:
        try:
            ended_ok = (documents.get("summary.json") or {}).get("status") == STATUS_OK
            documents[name] = read_back(path / name, cut_tail_ok=not ended_ok)
        except FileNotFoundError:
            if name == "summary.json":
                damage = "summary.json: missing (every run folder has one)"
        except Damaged as exc:
            damage = damage or str(exc)
    summary, metrics = documents.get("summary.json") or {}, documents.get("metrics.jsonl")
    if not damage and metrics is not None and summary.get("status") == STATUS_OK and "steps" in summary \
            and len(metrics) != summary["steps"]:  # one line per step: a file cut at a line's end
        damage = f"metrics.jsonl: {len(metrics)} line(s) for the {summary['steps']} steps summary.json counts"
    return RunFiles(path=path, documents=documents, damage=damage)


class RunDir:
    """One run's folder. Create it only after the input has been validated."""

    def __init__(self, path: Path, started: float | None = None) -> None:
        self.path = path
        self._metrics = None
        self._started = time.time() if started is None else started
        self.ended: str | None = None
        """The final status written by `finish` (None until then)."""

    @classmethod
    def create(cls, kind: str, name: str = "", root: str | os.PathLike | None = None,
               run_id: str | None = None, started: float | None = None) -> "RunDir":
        """`started` (time.time()): when the work began, for a command that creates its folder only once
        the work is done (env-check); default now."""
        from moebench import signals

        check_root(root, kind)
        signals.check()  # a Ctrl-C swallowed on the way here: nothing is created
        mark_abandoned(results_root(root) / kind)
        for attempt in range(8):  # a fresh id for a run started in the same microsecond as another
            path = results_root(root) / kind / (run_id or new_run_id(name))
            try:
                path.mkdir(parents=True, exist_ok=False)
                break
            except FileExistsError:
                if run_id is not None or attempt == 7:
                    from moebench.errors import UserError

                    raise UserError(f"cannot create {path}: it exists", flag="--results-dir") from None
            except OSError as exc:  # a file system that refuses (read-only, /proc, full)
                from moebench.errors import UserError

                raise UserError(f"cannot create {path}: {exc.strerror or exc}", flag="--results-dir") from None
        return cls(path, started)

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def kind(self) -> str:
        return self.path.parent.name

    def write_json(self, name: str, data: Any) -> Path:
        """Atomically write `name`; the files with a schema start with their `schema` key."""
        if name in SCHEMAS:
            data = {"schema": SCHEMAS[name], **{k: v for k, v in data.items() if k != "schema"}}
        return write_json_atomic(self.path / name, data)

    def log_metrics(self, record: dict) -> None:
        """Append one line to metrics.jsonl and flush it to the OS at once."""
        if self._metrics is None:
            self._metrics = open(self.path / "metrics.jsonl", "a", buffering=1)
        self._metrics.write(json.dumps(to_jsonable(record), allow_nan=False) + "\n")
        self._metrics.flush()

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def _write_unsaved(self, exc: OSError) -> None:
        """After summary.json could not be written whole: a short one saying the run failed and why (its
        measurements were not saved), when even that fits; the caller raises the error on."""
        why = f"could not write summary.json: {exc.strerror or exc}; what the run measured was not saved"
        with contextlib.suppress(OSError):
            lists = {"checks": []} if self.kind == "parity" else {}  # what its schema asks of a failed parity run
            self.write_json("summary.json", {**self.envelope(STATUS_FAILED), "error": why, "reason": why, **lists})
            self.ended = STATUS_FAILED

    def envelope(self, status: str) -> dict:
        """The keys every summary.json has, whatever its kind."""
        return {"kind": self.kind, "run_id": self.run_id, "run_path": str(self.path.absolute()), "status": status,
                "started_at": datetime.datetime.fromtimestamp(self._started).isoformat(timespec="seconds"),
                "wall_time_s": time.time() - self._started, "pid": os.getpid(), "host": socket.gethostname(),
                "launcher": launcher()}

    def start(self, summary: dict | None = None) -> None:
        self.write_json("summary.json", {**self.envelope(STATUS_RUNNING), **(summary or {})})

    def finish(self, status: str, summary: dict) -> dict:
        """Write the final summary.json (ok / failed / interrupted) and return what it holds.

        This is where the exit code and the file are made to agree (see signals.py): a signal
        recorded and not yet acted on turns any status into "interrupted" (what was measured is
        kept), written, then raised as KeyboardInterrupt; once written, the command is committed
        to the status and later signals are ignored."""
        from moebench import signals

        self.close()
        with signals.held():
            converted = signals.pending() and status != STATUS_INTERRUPTED
            if converted:
                was = f"; it would have ended {status!r}" + (f" ({summary['error']})" if summary.get("error") else "")
                status, summary = STATUS_INTERRUPTED, {**summary, "error": f"interrupted ({signals.describe()}){was}"}
            document = {**self.envelope(status), **summary}
            try:
                self.write_json("summary.json", document)
            except OSError as exc:  # a full disk: the few bytes that say so may still fit, never "running"
                self._write_unsaved(exc)
                raise
            self.ended = status
            signals.commit()
        if status == STATUS_INTERRUPTED:
            signals.note_interrupted(self.path.absolute())
        if converted:
            raise KeyboardInterrupt(signals.describe())
        return {"schema": SCHEMAS["summary.json"], **document}


def writer_gone(summary: dict) -> bool:
    """True when a "running" summary's writer (pid, host) is no longer alive on this host."""
    import psutil

    if summary.get("status") != STATUS_RUNNING or summary.get("host") != socket.gethostname():
        return False
    pid = summary.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        started = datetime.datetime.fromisoformat(summary["started_at"]).timestamp()
        # A pid reused by a process started after the run is not the writer.
        return psutil.Process(pid).create_time() > started + 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return True
    except (KeyError, ValueError, TypeError):
        return not psutil.pid_exists(pid)


def status_of(run_path: Path) -> str:
    """A run folder's status as a reader should see it (running -> abandoned when its writer died,
    "damaged" when a file of it is)."""
    return read_run(run_path).status


def mark_abandoned(kind_dir: Path) -> list[Path]:
    """Rewrite the summary of every run under results/<kind>/ whose writer died while it said
    "running", to "abandoned" with the reason. Returns the runs marked."""
    marked = []
    if not kind_dir.is_dir():
        return marked
    for run in kind_dir.iterdir():
        path = run / "summary.json"
        try:
            summary = read_back(path)
            if writer_gone(summary):
                error = (f"the writer (pid {summary['pid']} on {summary['host']}) ended without recording how "
                         "the run ended (killed with SIGKILL, or the machine went down)")
                write_json_atomic(path, {**summary, "status": STATUS_ABANDONED, "error": error})
                marked.append(run)
        except (OSError, ValueError, KeyError):
            continue  # unreadable or read-only: `status_of` still reports it
    return marked


def latest_runs(kind: str, root: str | os.PathLike | None = None) -> Iterable[Path]:
    """Run folders of one kind, newest first (run ids sort by time)."""
    base = results_root(root) / kind
    if not base.is_dir():
        return []
    return sorted((p for p in base.iterdir() if p.is_dir()), key=run_order, reverse=True)

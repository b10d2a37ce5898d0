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
"""

from __future__ import annotations

import datetime
import json
import math
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any, Iterable

from moebench.distributed.env import launcher

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
    target = results_root(root).absolute() / kind
    folder = target
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"{folder} exists and is not a folder; pass a folder", flag="--results-dir")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"cannot create {target}: {folder} is not writable; pass a writable folder",
                        flag="--results-dir")
    return target


def new_run_id(name: str = "") -> str:
    """Sortable, unique even for two runs started in the same second: 20261122-015355-quick-3f9a."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    parts = [stamp] + ([name] if name else []) + [secrets.token_hex(2)]
    return "-".join(parts)


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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(to_jsonable(data), f, indent=2, sort_keys=False, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write a text file so that a reader sees the old file or the whole new one, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as f:
        return json.load(f)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class RunDir:
    """One run's folder. Create it only after the input has been validated."""

    def __init__(self, path: Path, started: float | None = None) -> None:
        self.path = path
        self._metrics = None
        self._started = time.time() if started is None else started

    @classmethod
    def create(cls, kind: str, name: str = "", root: str | os.PathLike | None = None,
               run_id: str | None = None, started: float | None = None) -> "RunDir":
        """`started` (time.time()): when the work began, for a command that creates its folder only once
        the work is done (env-check); default now."""
        from moebench import signals

        check_root(root, kind)
        signals.check()  # a Ctrl-C swallowed on the way here: nothing is created
        mark_abandoned(results_root(root) / kind)
        path = results_root(root) / kind / (run_id or new_run_id(name))
        try:
            path.mkdir(parents=True, exist_ok=False)
        except OSError as exc:  # a race, or a file system that refuses (read-only, /proc, full)
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

    def _envelope(self, status: str) -> dict:
        """The keys every summary.json has, whatever its kind."""
        return {"kind": self.kind, "run_id": self.run_id, "run_path": str(self.path.absolute()), "status": status,
                "started_at": datetime.datetime.fromtimestamp(self._started).isoformat(timespec="seconds"),
                "wall_time_s": time.time() - self._started, "pid": os.getpid(), "host": socket.gethostname(),
                "launcher": launcher()}

    def start(self, summary: dict | None = None) -> None:
        self.write_json("summary.json", {**self._envelope(STATUS_RUNNING), **(summary or {})})

    def finish(self, status: str, summary: dict) -> dict:
        """Write the final summary.json (ok / failed / interrupted) and return what it holds."""
        self.close()
        document = {**self._envelope(status), **summary}
        self.write_json("summary.json", document)
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
    """A run folder's status as a reader should see it (running -> abandoned when its writer died)."""
    try:
        summary = read_json(run_path / "summary.json")
    except (OSError, ValueError):
        return "unreadable"
    return STATUS_ABANDONED if writer_gone(summary) else summary.get("status", "unknown")


def mark_abandoned(kind_dir: Path) -> list[Path]:
    """Rewrite the summary of every run under results/<kind>/ whose writer died while it said
    "running", to "abandoned" with the reason. Returns the runs marked."""
    marked = []
    if not kind_dir.is_dir():
        return marked
    for run in kind_dir.iterdir():
        path = run / "summary.json"
        try:
            summary = read_json(path)
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
    return sorted((p for p in base.iterdir() if p.is_dir()), reverse=True)

"""Run gpu-check's steps (moebench.gpucheck.steps) into results/gpu-check/<run-id>/.

Each command of a step is a child process in its own session, killed with its whole group at the
step's deadline (SIGTERM, then SIGKILL after `KILL_GRACE_S`), on Ctrl-C / SIGTERM (the run is
recorded "interrupted"), and by the kernel if gpu-check itself dies (PR_SET_PDEATHSIG). Its stdout
(the one JSON document of a `--json` command) and stderr are kept under steps/; gpucheck.json keeps
each step's digest (moebench.gpucheck.judge) and is rewritten after every step, so an interrupted
run keeps what it measured.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from moebench import results, signals
from moebench.gpucheck import judge, steps
from moebench.gpucheck.preflight import Gpus
from moebench.orphans import die_with_parent
from moebench.version import __version__

SCHEMA = "moebench.gpu-check/1"
REPORT_FILE = "gpucheck.json"
KILL_GRACE_S = 5.0
"""After SIGTERM at a deadline, the step's group gets this long to end before SIGKILL."""
POLL_S = 0.2
PASS, FAIL, SKIP, TIMEOUT = "pass", "fail", "skip", "timeout"


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def run_command(argv: list[str], *, env: dict, timeout_s: float, out: Path, err: Path) -> tuple[int | None, bool]:
    """Run one command with a hard deadline: (exit code, timed out). Ctrl-C / SIGTERM kill it and raise."""
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True,
                                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            signals.check()  # a safe point every POLL_S: Ctrl-C stops the step now
            if time.monotonic() > deadline:
                _kill_group(proc, signal.SIGTERM)
                try:
                    proc.wait(KILL_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
                _kill_group(proc, signal.SIGKILL)
                proc.wait()
                return proc.returncode, True
            time.sleep(POLL_S)
    except BaseException:
        _kill_group(proc, signal.SIGKILL)
        proc.wait()
        raise
    _kill_group(proc, signal.SIGKILL)  # whatever the step left running in its group
    return proc.returncode, False


def _last_json(path: Path) -> dict | None:
    """The JSON document a command printed: the whole stdout, else the last object that starts a line
    and runs to the end (a library's stray print before it), else its last line."""
    text = path.read_text(encoding="utf-8", errors="replace").strip()
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("{")]
    for candidate in (text, *("\n".join(lines[i:]) for i in starts), lines[-1] if lines else ""):
        with contextlib.suppress(ValueError):
            doc = json.loads(candidate)
            if isinstance(doc, dict):
                return doc
    return None


def _tail(path: Path) -> str:
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


def child_env(root: Path, extra_path: str | None = None) -> dict:
    env = {**os.environ, results.RESULTS_ENV: str(root), "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # each step launches its own ranks
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([extra_path, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def run_step(step: steps.Step, ctx: steps.Context, env: dict, done: dict[str, dict], docs: dict[str, list],
             skip: tuple[str, ...]) -> dict:
    """One step's record: status, reason, elapsed, and the digest of what its commands printed."""
    record = {"name": step.name, "title": step.title, "budget_s": step.budget_s, "elapsed_s": 0.0,
              "commands": [], "status": SKIP, "reason": ""}
    blocked = [n for n in step.needs if done.get(n, {}).get("status") != PASS]
    if step.name in skip:
        return {**record, "reason": "skipped by --skip"}
    if step.min_gpus > ctx.gpu_count:
        return {**record, "reason": f"needs {step.min_gpus}+ GPUs, this machine has {ctx.gpu_count}"}
    if blocked:
        return {**record, "reason": "needs " + ", ".join(f"{n} ({done.get(n, {}).get('status', 'not run')})"
                                                         for n in blocked)}
    if step.derived:
        body = (judge.compare_runs(done["run-fmoe"]["result"], done["run-reference"]["result"])
                if step.name == "runs-compare" else judge.nccl_probe((docs.get("env-check") or [None])[0]))
        return {**record, **body}
    start = time.monotonic()
    folder = ctx.run_path / "steps"
    folder.mkdir(exist_ok=True)
    statuses, reasons, digests = [], [], []
    for i, argv in enumerate(step.commands(ctx)):
        stem = step.name + (f"-{i + 1}" if i else "")
        out, err = folder / f"{stem}.stdout", folder / f"{stem}.stderr"
        code, timed_out = run_command(argv, env=env, timeout_s=step.budget_s, out=out, err=err)
        doc = _last_json(out)
        docs.setdefault(step.name, []).append(doc)
        digest = judge.DIGESTS[step.name](doc) if doc is not None and step.name in judge.DIGESTS else None
        digests.append(digest)
        record["commands"].append({"argv": argv, "exit_code": code, "timed_out": timed_out,
                                   "stdout": str(out.relative_to(ctx.run_path)),
                                   "stderr": str(err.relative_to(ctx.run_path))})
        if timed_out:
            statuses.append(TIMEOUT)
            reasons.append(f"killed at its {step.budget_s:.0f} s deadline")
        else:
            statuses.append(PASS if code == 0 else FAIL)
            said = (doc or {}).get("reason") or (doc or {}).get("error") or ("" if code == 0 else _tail(err))
            reasons.append(f"exit {code}" + (f": {said}" if said else ""))
    status = next((s for s in (TIMEOUT, FAIL) if s in statuses), PASS)
    result = digests[0] if len(digests) == 1 else digests
    return {**record, "status": status, "elapsed_s": round(time.monotonic() - start, 2),
            "reason": "; ".join(reasons), "result": result}


def document(gpus: Gpus, records: list[dict], started: float, ctx: steps.Context) -> dict:
    counts = {s: sum(r["status"] == s for r in records) for s in (PASS, FAIL, SKIP, TIMEOUT)}
    return {"schema": SCHEMA, "moebench_version": __version__,
            "created": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "python": gpus.python, "torch": gpus.torch, "torch_cuda": gpus.torch_cuda,
            "gpu_count": gpus.count, "gpus": list(gpus.names), "fastmoe_src": ctx.fastmoe_src,
            "budget_s": steps.TOTAL_BUDGET_S, "elapsed_s": round(time.time() - started, 2),
            "status": FAIL if counts[FAIL] or counts[TIMEOUT] else PASS, "counts": counts, "steps": records}


def run_gpu_check(gpus: Gpus, *, fastmoe_src: str | None, fastmoe_build: str | None, results_dir: str | None,
                  skip: tuple[str, ...] = (), log: Callable[[dict], None] | None = None) -> tuple[dict, int]:
    """Every step, recorded in a new results/gpu-check/<id>/; returns (gpucheck.json's document, exit code)."""
    from moebench.train import outcome_recorded

    root = results.results_root(results_dir).absolute()
    started = time.time()
    with signals.held():
        run = results.RunDir.create("gpu-check", root=results_dir, started=started)
        run.start({"report": REPORT_FILE})
    ctx = steps.Context(python=sys.executable, results_root=root, run_path=run.path.absolute(), gpu_count=gpus.count,
                        fastmoe_src=os.path.abspath(fastmoe_src) if fastmoe_src else None,
                        fastmoe_build=(Path(fastmoe_build) if fastmoe_build else run.path / "fastmoe").absolute())
    env = child_env(root)
    done: dict[str, dict] = {}
    docs: dict[str, list] = {}
    records: list[dict] = []
    with outcome_recorded(run):
        for step in steps.STEPS:
            signals.check()
            record = run_step(step, ctx, env, done, docs, skip)
            done[step.name] = record
            records.append(record)
            if step.name == "fastmoe-build" and record["status"] == PASS and (record.get("result") or {}).get("site"):
                env = child_env(root, record["result"]["site"])  # every later step imports this fmoe
            run.write_json(REPORT_FILE, document(gpus, records, started, ctx))
            if log:
                log(record)
        doc = document(gpus, records, started, ctx)
        doc["results_path"] = str(run.path / REPORT_FILE)
        run.write_json(REPORT_FILE, doc)
        failed = [r["name"] for r in records if r["status"] in (FAIL, TIMEOUT)]
        code = 1 if failed else 0
        extra = {"error": f"{len(failed)} step(s) failed: {', '.join(failed)}"} if failed else {}
        run.finish(results.STATUS_FAILED if failed else results.STATUS_OK,
                   {"counts": doc["counts"], "exit_code": code, "report": REPORT_FILE, **extra})
    return doc, code

"""`python -m moebench ARGS` for tests, started from an interpreter that has imported torch and moebench's CLI
already: each command is a fork of that interpreter (a "warm" one, one per test process), which then runs
`python -m moebench` exactly as a fresh one does (runpy: the same __main__, signal handlers, exit code, exit
handlers, stdout and stderr). A fresh interpreter spends about 1.3 s of CPU importing torch before the command
starts, and the default suite starts many commands.

What a fork cannot give is kept for fresh interpreters: whatever acts at interpreter start-up. A call whose
environment differs from the warm interpreter's in what is read at start-up or at torch's import (PYTHON*, LD_*,
TORCH_*, OMP_*, MKL_*, KMP_*, CUDA_*), or whose PYTHONPATH holds a sitecustomize (fault injection), runs in a
fresh interpreter; so does every call with `fresh=True` (tests of start-up, signals, imports, timing), and every
call when MOEBENCH_TEST_FRESH_CLI=1 (`make test-all` sets it: the slow tier runs every command fresh).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

FRESH_ENV = "MOEBENCH_TEST_FRESH_CLI"
START_UP_PREFIXES = ("PYTHON", "LD_", "TORCH_", "OMP_", "MKL_", "KMP_", "CUDA_")
"""Environment variables read when an interpreter starts or torch is imported: a difference needs a fresh one."""
CUSTOMIZE = ("sitecustomize.py", "usercustomize.py")
MOEBENCH = [sys.executable, "-m", "moebench"]

_server: subprocess.Popen | None = None
_replies: _Lines | None = None
"""The warm interpreter of this test process and what it answers (started on first use)."""


def server_pid() -> int | None:
    """The warm interpreter of this test process (not a process a test left behind), or None."""
    return _server.pid if _server is not None and _server.poll() is None else None


def children_left() -> list:
    """This test process's live descendants, the warm interpreter aside (it stays, by design)."""
    import psutil

    return [p for p in psutil.Process().children(recursive=True)
            if p.pid != server_pid() and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def run(args, *, env: dict | None = None, cwd=None, timeout: float = 300,
        fresh: bool = False) -> subprocess.CompletedProcess:
    """What `subprocess.run([python, "-m", "moebench", *args], capture_output=True, text=True, ...)` returns."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    if fresh or os.environ.get(FRESH_ENV) == "1" or _needs_fresh(env):
        return subprocess.run([*MOEBENCH, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    return _run_warm(args, env, os.path.abspath(cwd or os.getcwd()), timeout)


def _needs_fresh(env: dict) -> bool:
    warm = _SERVER_ENV if server_pid() is not None else _start_up_env(os.environ)
    ours = _start_up_env(env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return ours != warm or any(os.path.exists(os.path.join(p, name)) for p in paths for name in CUSTOMIZE)


def _start_up_env(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(START_UP_PREFIXES) and k != "PYTHONPATH"}


_SERVER_ENV: dict = {}
"""The start-up variables the warm interpreter began with."""


def _ensure_server() -> _Lines:
    global _server, _replies, _SERVER_ENV
    if _server is None or _server.poll() is not None:
        _SERVER_ENV = _start_up_env(os.environ)
        env = {**os.environ}
        env.pop("PYTHONPATH", None)  # a fresh `python -m moebench` of a test gets the call's own PYTHONPATH
        _server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   env=env, cwd=Path(__file__).parents[2])
        _replies = _Lines(_server.stdout.fileno())
        ready = _replies.next(timeout=120)
        assert ready == b"ready", f"the warm interpreter did not start: {ready!r}"
    return _replies


def stop() -> None:
    """End this test process's warm interpreter and reap it (at the end of the session): nothing the suite started
    outlives it, not even for the moment its parent's death takes to reach it."""
    global _server, _replies
    if _server is None:
        return
    server, _server, _replies = _server, None, None
    try:
        server.stdin.close()  # end of requests: it leaves its loop and exits
        server.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        server.kill()
        server.wait()
    server.stdout.close()


def _run_warm(args: list[str], env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
    replies = _ensure_server()
    with tempfile.TemporaryDirectory(prefix="warmcli") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        request = {"args": args, "env": env, "cwd": cwd, "stdout": out, "stderr": err}
        _server.stdin.write(json.dumps(request).encode() + b"\n")
        _server.stdin.flush()
        pid = json.loads(replies.next(timeout=60))["pid"]
        reply = replies.next(timeout=timeout)
        timed_out = reply is None
        if timed_out:  # the command and whatever it started are killed, as subprocess.run's timeout kills
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            reply = replies.next(timeout=60)
        returncode = json.loads(reply)["returncode"]
        stdout, stderr = (Path(p).read_text(errors="replace") for p in (out, err))
    if timed_out:
        raise subprocess.TimeoutExpired([*MOEBENCH, *args], timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess([*MOEBENCH, *args], returncode, stdout, stderr)


class _Lines:
    """Lines from the warm interpreter's replies, each within a timeout (None: none came in time)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending = b""  # what came after the last line returned

    def next(self, *, timeout: float) -> bytes | None:
        import time

        end = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise RuntimeError("the warm interpreter ended")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line


# --------------------------------------------------------------------------- the warm interpreter


def _serve() -> None:
    import torch  # noqa: F401 - what the commands would each import

    import moebench.cli.app  # noqa: F401
    import moebench.entry  # noqa: F401
    from moebench.orphans import die_with_parent

    die_with_parent()
    requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # the interpreter's own stdout is the command's, never the protocol
    os.close(null)
    base_path = sys.path[1:]  # without this file's folder: a command's sys.path starts with its cwd
    replies.write(b"ready\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _command(request, base_path)  # never returns
        replies.write(json.dumps({"pid": pid}).encode() + b"\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        replies.flush()


def _command(request: dict, base_path: list[str]) -> None:
    """In the fork: become `python -m moebench ARGS` started by the test, then run it."""
    import atexit
    import runpy
    import traceback

    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills what the command started too
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *map(os.path.abspath, extra), *base_path]
        sys.argv = [str(Path(sys.modules["moebench"].__file__).with_name("__main__.py")), *request["args"]]
        runpy.run_module("moebench", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


if __name__ == "__main__":
    _serve()

"""scripts/gpu-device-run.sh, the one prepared command for a lent GPU machine (issue 42), on CPU: it says in
one line why it cannot run here (with make, and through the Makefile's lines without make), passes
`make gpu-check`'s exit status through, stays within GPU_CHECK_LIMIT_S, and leaves under OUT what docs/gpu.md's
table is filled from. `make` is a stand-in in the cases that need a GPU run's files (it writes what
`moebench gpu-check` and `moebench report` would); the script itself is the real one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-device-run.sh"
RECORDED = Path(__file__).parent / "recorded" / "gpucheck.json"
"""A schema-valid gpucheck.json (what the stand-in make leaves as the run's)."""
TOOLS = ("bash", "head", "tail", "nproc", "tee", "timeout", "date", "ls", "sort", "cp", "tar", "gzip", "sed",
         "mkdir", "tr", "cat", "sleep", "env", "dirname", "cut")
"""What the script calls besides make, nvidia-smi and nvcc (a PATH without make is built from these)."""

STUB_MAKE = """#!/usr/bin/env bash
# a stand-in for `make gpu-check` on a GPU: the files moebench gpu-check and moebench report write
echo "stub make $*"
sleep "${STUB_SLEEP:-0}"
run="$MOEBENCH_RESULTS/gpu-check/20261128-000000-000001"
mkdir -p "$run/steps" "$run/fastmoe" "$MOEBENCH_RESULTS/report/20261128-000001-000001"
cp "$STUB_JSON" "$run/gpucheck.json"
echo "layers: ok" > "$run/steps/layers.stdout"
echo "built" > "$run/fastmoe/build.log"
printf '# Report\\n\\n## On a GPU\\n\\nH200 row\\n\\n## Libraries\\n\\nnot this\\n' \\
    > "$MOEBENCH_RESULTS/report/20261128-000001-000001/REPORT.md"
exit "${STUB_RC:-0}"
"""


def _bin(tmp_path: Path, *, make: str | None) -> Path:
    """A PATH folder: the tools the script calls, and make (the real one, a stand-in, or none)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in TOOLS + (("make",) if make == "real" else ()):
        found = shutil.which(tool)
        if found:
            (folder / tool).symlink_to(found)
    if make == "stub":
        (folder / "make").write_text(STUB_MAKE)
        (folder / "make").chmod(0o755)
    return folder


def _run(tmp_path: Path, *, make: str | None, timeout: float = 120, **env: str) -> tuple[subprocess.CompletedProcess,
                                                                                         Path, Path]:
    out, results = tmp_path / "out", tmp_path / "results"
    (tmp_path / "wheels").mkdir()
    (tmp_path / "fastmoe").mkdir()
    full = {**os.environ, "PATH": str(_bin(tmp_path, make=make)), "PYTHON": sys.executable,
            "MOEBENCH_RESULTS": str(results), "STUB_JSON": str(RECORDED), **env}
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "wheels"), str(tmp_path / "fastmoe"), str(out)],
                          cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout)
    return done, out, results


def test_on_a_cpu_machine_it_says_why_in_one_line_and_exits_2(tmp_path):
    done, out, results = _run(tmp_path, make="real")
    assert done.returncode == 2, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert "no CUDA GPU: " in said and "Traceback" not in said  # preflight's line (a CPU build of torch here)
    assert "== make gpu-check: exit 2" in done.stdout
    assert (out / "gpu-check.log").exists() and "no CUDA GPU" in (out / "gpu-check.log").read_text()
    assert not results.exists()  # nothing half-written: preflight stops before anything is created


def test_without_make_the_makefiles_lines_say_the_same(tmp_path):
    done, out, results = _run(tmp_path, make=None)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA GPU: " in (out / "gpu-check.log").read_text()
    assert "Traceback" not in done.stdout + done.stderr and not results.exists()


def test_a_gpu_runs_files_land_under_out_and_its_exit_status_passes_through(tmp_path):
    done, out, _ = _run(tmp_path, make="stub", STUB_RC="1")
    assert done.returncode == 1, done.stdout + done.stderr  # a failing step's exit reaches the caller (tee)
    assert "stub make gpu-check" in done.stdout and f"WHEELS={tmp_path / 'wheels'}" in done.stdout
    assert json.loads((out / "gpucheck.json").read_text()) == json.loads(RECORDED.read_text())
    assert "## On a GPU" in (out / "REPORT.md").read_text()
    with tarfile.open(out / "gpu-check-logs.tar.gz") as archive:
        assert {"steps/layers.stdout", "fastmoe/build.log"} <= set(archive.getnames())
    section = done.stdout.split("== the report's GPU section", 1)[1]
    assert "H200 row" in section and "not this" not in section  # the GPU section alone


def test_make_gpu_check_is_bounded_by_its_limit(tmp_path):
    start = time.monotonic()
    done, out, _ = _run(tmp_path, make="stub", STUB_SLEEP="60", GPU_CHECK_LIMIT_S="2", timeout=60)
    assert time.monotonic() - start < 30
    assert done.returncode == 124, done.stdout + done.stderr  # timeout's status: the limit ended it
    assert "== make gpu-check: exit 124" in done.stdout and (out / "gpu-check.log").exists()

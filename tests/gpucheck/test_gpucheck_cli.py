"""`moebench gpu-check` and `make gpu-check` on this CPU machine: refused in one line with exit 2 and
nothing created; `--list`; the step table's budget; and the runner itself, on stand-in steps (a pass,
a failure, a hang killed at its deadline with its children, skips), recorded like any run."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.userenv import outside_make
from typer.testing import CliRunner

from moebench import results
from moebench.cli.app import app
from moebench.gpucheck import preflight, runner, steps
from moebench.schemas import validate_file

REPO = Path(__file__).resolve().parents[2]
CLI_TIMEOUT_S = 120
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: nothing to refuse")
FAKE_GPUS = preflight.Gpus(python=sys.executable, torch="2.11.0+cu130", torch_cuda="13.0", count=1,
                           names=("Stand-in GPU",))


def _refusal_here() -> str:
    """What the refusal says on this machine: a CPU build of torch, or a CUDA build that sees no GPU."""
    if torch.version.cuda is None:
        return f"no CUDA GPU: torch {torch.__version__} is a CPU build; pass PYTHON= one with a CUDA torch"
    return f"no CUDA GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none; check nvidia-smi"


def test_the_refusals_are_one_line_each():
    cases = {preflight.Gpus(python="/x/python3", torch=None, torch_cuda=None, count=0, import_error="No module"):
             "no CUDA GPU: /x/python3 has no torch; pass PYTHON= one with a CUDA torch",
             dataclasses.replace(FAKE_GPUS, torch="2.13.0+cpu", torch_cuda=None, count=0):
             "no CUDA GPU: torch 2.13.0+cpu is a CPU build; pass PYTHON= one with a CUDA torch",
             dataclasses.replace(FAKE_GPUS, count=0): "no CUDA GPU: torch 2.11.0+cu130 (CUDA 13.0) sees none; "
                                                      "check nvidia-smi"}
    for gpus, line in cases.items():
        assert preflight.refusal(gpus) == line
    assert preflight.refusal(FAKE_GPUS) is None
    assert preflight.describe(FAKE_GPUS).startswith("1 CUDA GPU(s) (Stand-in GPU); torch 2.11.0+cu130")


@no_gpu
def test_the_command_refuses_without_a_gpu_and_creates_nothing(tmp_path):
    root = tmp_path / "r"
    done = subprocess.run([sys.executable, "-m", "moebench", "gpu-check", "--results-dir", str(root)],
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [f"error: {_refusal_here()}"]
    assert list(tmp_path.iterdir()) == []


def _make(tmp_path: Path, **variables: str) -> subprocess.CompletedProcess:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    args = ["make", "-s", "gpu-check", f"GPU_VENV={tmp_path / 'venv'}", *(f"{k}={v}" for k, v in variables.items())]
    env = {**outside_make(os.environ), results.RESULTS_ENV: str(tmp_path / "results")}
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=env)


@no_gpu
def test_make_gpu_check_refuses_in_one_line_with_exit_2_and_creates_nothing(tmp_path):
    before = sorted(p.name for p in REPO.iterdir())
    done = _make(tmp_path, PYTHON=sys.executable)
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2 and len(lines) == 1, lines
    assert _refusal_here() in lines[0]
    assert sorted(p.name for p in REPO.iterdir()) == before and list(tmp_path.iterdir()) == []


def test_make_gpu_check_with_an_interpreter_that_does_not_run(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    done = _make(tmp_path, PYTHON=str(fake))
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2 and len(lines) == 1 and f"no CUDA GPU: PYTHON={fake} does not run" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["python"]


def test_list_names_every_step_without_a_gpu():
    out = CliRunner().invoke(app, ["gpu-check", "--list"])
    assert out.exit_code == 0, out.output
    assert all(name in out.output for name in steps.NAMES)
    assert all(len(line) <= 80 for line in out.output.splitlines())
    doc = json.loads(CliRunner().invoke(app, ["gpu-check", "--list", "--json"]).output)
    assert [s["name"] for s in doc["steps"]] == list(steps.NAMES)


def test_the_one_gpu_steps_fit_the_eight_minute_budget():
    assert steps.one_gpu_budget_s() <= steps.TOTAL_BUDGET_S == 480.0
    assert len(set(steps.NAMES)) == len(steps.NAMES)
    for i, step in enumerate(steps.STEPS):  # a step needs only steps that come before it
        assert set(step.needs) <= set(steps.NAMES[:i]), step.name
    ctx = steps.Context(python="py", results_root=Path("/r"), run_path=Path("/r/g/1"), gpu_count=4,
                        fastmoe_src="/src", fastmoe_build=Path("/b"))
    for step in steps.STEPS:
        for argv in (step.commands(ctx) if step.commands else []):
            assert argv[:2] == ["py", "-m"]
            if argv[2] == "moebench":  # the runner reads the one JSON document each command prints
                assert "--json" in argv and argv[argv.index("--results-dir") + 1] == "/r"
    sizes = [c[c.index("--world-size") + 1] for c in steps.by_name("verify-parity-nccl").commands(ctx)]
    assert sizes == ["2", "3", "4"]  # every world size the machine has


def test_a_folder_that_is_not_fastmoe_is_refused_naming_the_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "probe", lambda: FAKE_GPUS)
    out = CliRunner().invoke(app, ["gpu-check", "--fastmoe-src", str(tmp_path), "--results-dir", str(tmp_path / "r")])
    assert out.exit_code == 2 and out.output.startswith("error: --fastmoe-src: ")
    assert "not a fastmoe source" in out.output
    assert not (tmp_path / "r").exists()


PRINT_JSON = "import json; print(json.dumps({'status': 'ok', 'reason': 'stand-in'}))"
HANG = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"


def _stand_in_steps(ctx_python: str) -> tuple[steps.Step, ...]:
    def cmd(code):
        return lambda ctx: [[ctx_python, "-c", code]]
    return (
        steps.Step(name="good", title="prints its JSON", budget_s=30, commands=cmd(PRINT_JSON)),
        steps.Step(name="bad", title="exits 3", budget_s=30, commands=cmd("import sys; sys.exit(3)")),
        steps.Step(name="after-bad", title="needs bad", budget_s=30, needs=("bad",), commands=cmd(PRINT_JSON)),
        steps.Step(name="hang", title="hangs with a child", budget_s=1.5, commands=cmd(HANG)),
        steps.Step(name="two-gpus", title="needs 2 GPUs", budget_s=30, min_gpus=2, commands=cmd(PRINT_JSON)),
        steps.Step(name="skipped", title="--skip", budget_s=30, commands=cmd(PRINT_JSON)),
    )


def test_the_runner_records_every_outcome_and_leaves_no_process(tmp_path, monkeypatch, no_leftover_children):
    monkeypatch.setattr(steps, "STEPS", _stand_in_steps(sys.executable))
    root = tmp_path / "results"
    doc, code = runner.run_gpu_check(FAKE_GPUS, fastmoe_src=None, fastmoe_build=None, results_dir=str(root),
                                     skip=("skipped",))
    status = {s["name"]: (s["status"], s["reason"]) for s in doc["steps"]}
    assert code == 1 and doc["status"] == "fail"
    assert status["good"] == ("pass", "exit 0: stand-in")
    assert status["bad"][0] == "fail" and status["bad"][1].startswith("exit 3")
    assert status["after-bad"] == ("skip", "needs bad (fail)")
    assert status["hang"] == ("timeout", "killed at its 2 s deadline")
    assert status["two-gpus"] == ("skip", "needs 2+ GPUs, this machine has 1")
    assert status["skipped"] == ("skip", "skipped by --skip")
    assert doc["counts"] == {"pass": 1, "fail": 1, "skip": 3, "timeout": 1}
    (run,) = (root / "gpu-check").iterdir()
    validate_file(run / "gpucheck.json")
    summary = results.read_back(run / "summary.json")
    assert summary["status"] == "failed" and summary["exit_code"] == 1 and summary["error"] == \
        "2 step(s) failed: bad, hang"
    assert (run / "steps" / "good.stdout").read_text().startswith("{")


def test_the_command_prints_a_line_per_step_within_80_columns(tmp_path, monkeypatch, no_leftover_children):
    monkeypatch.setattr(steps, "STEPS", _stand_in_steps(sys.executable)[:3])
    monkeypatch.setattr(preflight, "probe", lambda: FAKE_GPUS)
    out = CliRunner().invoke(app, ["gpu-check", "--results-dir", str(tmp_path / "results")])
    lines = out.output.splitlines()
    assert out.exit_code == 1, out.output
    assert lines[0].startswith("1 CUDA GPU(s) (Stand-in GPU)") and lines[-1].startswith("saved ")
    assert any(line.startswith("bad ") and "fail" in line for line in lines)
    assert "gpu-check: 1 pass, 1 fail, 0 timeout, 1 skip in" in out.output
    assert all(len(line) <= 80 for line in lines if not line.startswith(("saved ", "python: ")))  # paths: whole


def test_a_document_after_stray_output_is_still_read(tmp_path):
    out = tmp_path / "x.stdout"
    out.write_text('[WARNING] a library printed this\n{\n  "status": "ok",\n  "n": 1\n}\n')
    assert runner._last_json(out) == {"status": "ok", "n": 1}
    out.write_text("no document at all\n")
    assert runner._last_json(out) is None


def test_every_step_has_a_gpu_test():
    text = (Path(__file__).parent / "test_gpucheck_gpu.py").read_text()
    missing = [name for name in steps.NAMES if f'"{name}"' not in text]
    assert not missing, f"steps without a test in test_gpucheck_gpu.py: {missing}"


def test_ctrl_c_stops_the_running_step_and_records_interrupted(tmp_path, monkeypatch, no_leftover_children):
    import signal
    import threading
    import time

    from moebench import signals
    from moebench.errors import Interrupted

    hang = steps.Step(name="hang", title="hangs", budget_s=60, commands=lambda ctx: [[sys.executable, "-c", HANG]])
    monkeypatch.setattr(steps, "STEPS", (hang,))
    timer = threading.Timer(1.0, signals.on_signal, args=(signal.SIGINT, None))  # as the handler records Ctrl-C
    timer.start()
    start = time.monotonic()
    with pytest.raises(Interrupted):
        runner.run_gpu_check(FAKE_GPUS, fastmoe_src=None, fastmoe_build=None, results_dir=str(tmp_path / "r"))
    timer.join()
    assert time.monotonic() - start < 10  # at the next safe point, not at the 60 s deadline
    (run,) = (tmp_path / "r" / "gpu-check").iterdir()
    assert results.read_back(run / "summary.json")["status"] == "interrupted"

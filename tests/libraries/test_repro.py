"""`verify-parity --library NAME --repro DIR`: the standalone reproduction scripts and their writer.

A script is run as a user runs it: `python SCRIPT` from another folder, with a poisoned `moebench`
first on the path (any moebench import in it fails), a fault injected through
tests/faults/inject/sitecustomize.py or none. It must exit 1 and name the diverging
quantity with the fault, 0 without, and end a hang by its deadline.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moebench.cli.app import app
from moebench.libraries import repro
from moebench.libraries.deepspeed import repro as ds_repro
from moebench.libraries.matrix import RowCheck
from moebench.libraries.spec import Adapter, Row

REPO = Path(__file__).resolve().parents[2]
INJECT = REPO / "tests" / "faults" / "inject"
STANDALONE_MODULES = {"torch", "deepspeed", "fairscale", "transformers"}
"""What a script may import besides the standard library."""
SCRIPT_TIMEOUT_S = 240.0
"""A script's own deadline is DEADLINE_S (600 s); the tests' runs take ~15 s, so this only bounds a broken test."""


def ds_row(**params) -> Row:
    """An engine row as the DeepSpeed adapter builds them."""
    from moebench.libraries.deepspeed.engine import EngineSettings, row_of

    world = params.pop("world_size", 2)
    return row_of(EngineSettings(**{"zero_stage": 1, "ep_size": 2, **params}), world)


def _poisoned_path(tmp_path: Path) -> Path:
    """A folder whose `moebench` package raises on import: first on PYTHONPATH, it catches any moebench import."""
    poison = tmp_path / "poison" / "moebench"
    poison.mkdir(parents=True, exist_ok=True)
    (poison / "__init__.py").write_text("raise ImportError('a repro script must not import moebench')\n")
    return poison.parent


def run_script(path: Path, tmp_path: Path, *, fault: str | None = None, deadline: float | None = None):
    """`python path` from an unrelated folder, as a user runs it; (completed process, tag in its children's env)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MOEBENCH_INJECT_FAULT")}
    env.update(PYTHONPATH=os.pathsep.join([str(_poisoned_path(tmp_path)), str(INJECT)]), REPRO_TEST_TAG=tag,
               DS_ACCELERATOR="cpu")
    if fault:
        env["MOEBENCH_INJECT_FAULT"] = fault
    args = [sys.executable, str(path)] + (["--deadline", str(deadline)] if deadline else [])
    done = subprocess.run(args, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
    return done, tag


def _survivors(tag: str) -> list[int]:
    """Processes still running with the run's tag in their environment (ranks the script left behind)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f"REPRO_TEST_TAG={tag}".encode() in environ.split(b"\0"):
            found.append(int(pid))
    return found


def _imports(source: str) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            tops.add((node.module or "").split(".")[0])
    return tops


def _settings(source: str) -> dict:
    line = next(line for line in source.splitlines() if line.startswith("SETTINGS = json.loads("))
    return json.loads(ast.literal_eval(line[len("SETTINGS = json.loads("):-1]))


# ------------------------------------------------------------------------------------ the scripts' text


@pytest.mark.parametrize("make", ["deepspeed", "fairscale", "transformers"])
def test_a_script_imports_only_the_stdlib_torch_and_the_library(make):
    if make == "deepspeed":
        source = ds_repro.script(ds_row(zero_stage=2, ep_size=1, world_size=4, clip=0.05), 7)
    elif make == "transformers":
        from moebench.libraries.transformers import ADAPTER

        source = ADAPTER.repro_script(ADAPTER.rows(4)[0], 7)
    else:
        from moebench.libraries.fairscale import ADAPTER

        source = ADAPTER.repro_script(ADAPTER.rows(2)[0], 7)
    foreign = {m for m in _imports(source) if m not in sys.stdlib_module_names} - STANDALONE_MODULES
    assert not foreign, foreign
    assert "@HARNESS@" not in source and "from harness" not in source and "@SETTINGS@" not in source
    compile(source, "repro.py", "exec")
    settings = _settings(source)
    assert settings["seed"] == 7
    if make == "deepspeed":
        engine = dataclasses.asdict(ds_row(zero_stage=2, ep_size=1, clip=0.05).settings)
        assert settings == {**engine, "world_size": 4, "seed": 7}


def test_rows_without_an_engine_script_get_none():
    plain = Row(library="deepspeed", model="engine", backend="zero0-2", ep_mode="ep=2", world_size=2)
    assert ds_repro.script(plain, 0) is None  # the wrapped check's row
    half = ds_repro.script(ds_row(precision="bf16"), 0)  # judged by the noise model, as the tool does
    assert half is not None and "def judge_results(results):" in half
    assert repro.script_name(ds_row().key()) == "deepspeed__engine__zero1__ep=2__w2.py"
    if importlib.util.find_spec("transformers") is not None:  # bf16 rows are judged by a noise model, not per element
        from moebench.libraries.transformers import ADAPTER

        bf16 = [r for r in ADAPTER.rows(2) if "bf16" in r.features]
        assert bf16 and all(ADAPTER.repro_script(r, 0) is None for r in bf16)


# ------------------------------------------------------------------------------------ the writer


class _Scripted(Adapter):
    def repro_script(self, row, seed):
        return f"print({row.key()!r}, {seed})\n"


class _Unscripted(Adapter):
    pass


def _rows(**by_name) -> dict:
    """check name -> a RowCheck of (adapter, row), as the matrix hands write_scripts its rows."""
    return {name: RowCheck(check=None, adapter=adapter, row=row) for name, (adapter, row) in by_name.items()}


def test_write_scripts_writes_one_per_failing_row_and_lists_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the console shows the path relative to here: short wherever tmp_path is
    rows = _rows(**{"a/x": (_Scripted(), ds_row()), "b/y": (_Scripted(), ds_row(zero_stage=2)),
                    "c/z": (_Unscripted(), ds_row(zero_stage=0))})
    summary = {"checks": [{"name": "a/x", "status": "fail"}, {"name": "b/y", "status": "pass"},
                          {"name": "c/z", "status": "fail"}]}
    out = repro.write_scripts(str(tmp_path / "new" / "dir"), summary, rows, seed=3)
    path = tmp_path / "new" / "dir" / "a__x.py"
    assert out["repro"] == [{"check": "a/x", "path": str(path)}]
    assert out["no_repro"] == ["c/z"]
    assert path.read_text() == f"print({ds_row().key()!r}, 3)\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["a__x.py"]  # no temporary left behind
    shown = repro.lines(out)
    assert any(str(path) in line or os.path.relpath(path) in line for line in shown)
    assert shown[-1] == "no reproduction script for c/z"
    assert all(len(line) <= 80 for line in shown)


def test_an_unwritable_repro_dir_is_named_and_the_verdicts_kept(tmp_path):
    (tmp_path / "afile").write_text("")
    summary = {"checks": [{"name": "a/x", "status": "fail"}]}
    rows = _rows(**{"a/x": (_Scripted(), ds_row())})
    out = repro.write_scripts(str(tmp_path / "afile" / "sub"), summary, rows, seed=0)
    assert out["checks"] == summary["checks"] and out["repro"] == []
    assert out["repro_error"].startswith(f"could not write {tmp_path / 'afile' / 'sub' / 'a__x.py'}: ")
    assert repro.lines(out) == [f"error: --repro: {out['repro_error']}"]


def test_repro_without_library_is_one_line(tmp_path):
    result = CliRunner().invoke(app, ["verify-parity", "--repro", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert result.output.strip() == "error: --repro: writes scripts for failing library rows; add --library NAME"
    assert not (tmp_path / "r").exists()


def test_repro_into_a_file_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    result = CliRunner().invoke(app, ["verify-parity", "--library", "fairscale", "--repro", str(afile)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"error: --repro: {afile} is not a folder; pass a folder"]


# ------------------------------------------------------------------------------------ running the scripts

DS_ROW = dict(zero_stage=1, ep_size=2, world_size=2)
"""A DeepSpeed engine row with expert parallelism and ZeRO's partitioned reduction (ZeRO 1)."""
DEFAULT_SUITE = 2
"""The first cases run in the default suite (~12 s each); the rest in the slow tier."""
FAULT_CASES = [
    # (fault "<module in tests/faults>:<name>" or None, row settings, exit status, a line the output holds)
    (None, DS_ROW, 0, "OK: 112 quantities agree with the one-process reference (exit 0)."),
    ("repro_faults:expert-grad-x2", DS_ROW, 1, "The reduced gradients of the expert group(s) differ (scaled by 2)."),
    ("repro_faults:expert-grad-x2", dict(zero_stage=2, ep_size=2, world_size=2), 1,
     "The reduced gradients of the expert group(s) differ (scaled by 2)."),
    (None, dict(zero_stage=2, ep_size=1, world_size=2, grad_accum=2, clip=0.05, top_k=2), 0, "OK: "),
    (None, dict(zero_stage=1, ep_size=2, world_size=2, drop_tokens=True, use_residual=True), 0, "OK: "),
    # ds-matrix's faults (tests/faults/ds_faults.py)
    ("ds_faults:expert-grad-wrong-group", dict(zero_stage=1, ep_size=2, world_size=2), 1, "BUG: "),
    ("ds_faults:local-global-norm", dict(zero_stage=1, ep_size=2, world_size=2, clip=0.05), 1, "BUG: "),
    ("ds_faults:accum-boundary-skip", dict(zero_stage=0, ep_size=2, world_size=2, grad_accum=2), 1, "BUG: "),
    ("ds_faults:copy-back-wrong-param", dict(zero_stage=2, ep_size=2, world_size=2), 1, "BUG: "),
    # A finding on DeepSpeed 0.19.8 (deepspeedai/DeepSpeed#8475, open): ZeRO 0 clips by the MEAN of the ranks'
    # norms, each over its own experts, not by the norm of every parameter counted once.
    (None, dict(zero_stage=0, ep_size=2, world_size=2, clip=0.05), 1,
     "(1.081): the global gradient norm or the clip coefficient differs; the engine's norm 0.2143 is the MEAN over "
     "ranks of each rank's own-parameter norm (its own experts only), not the norm over every parameter (0.2316"),
    # the same through a user's --ds-config clip of 1.0: the script multiplies the loss as the row did
    (None, dict(zero_stage=0, ep_size=2, world_size=2, clip=1.0, loss_multiplier=20.0), 1,
     "clip 1 binds at every step"),
]


def _case_id(fault, settings) -> str:
    """e.g. "expert-grad-x2-zero_stage1-ep_size2-world_size2"."""
    name = fault.partition(":")[2] if fault else "unbroken"
    return f"{name}-" + "-".join(f"{k}{v}" for k, v in settings.items())


@pytest.mark.multirank
@pytest.mark.faults
@pytest.mark.parametrize("fault,settings,status,expected", [
    pytest.param(*case, id=_case_id(*case[:2]), marks=[pytest.mark.slow] if i >= DEFAULT_SUITE else [])
    for i, case in enumerate(FAULT_CASES)])
def test_deepspeed_script_reproduces_the_fault_and_passes_unbroken(tmp_path, fault, settings, status, expected):
    path = tmp_path / "scripts" / repro.script_name(ds_row(**settings).key())
    path.parent.mkdir()
    path.write_text(ds_repro.script(ds_row(**settings), 0))
    done, tag = run_script(path, tmp_path, fault=fault)
    out = done.stdout
    assert done.returncode == status, out + done.stderr[-3000:]
    assert expected in " ".join(out.split()), out
    if status == 1:
        assert "BUG: first divergence at ZeRO" in out
        assert "max abs diff" in out and "actual/expected ratio" in out and "expected [" in out
    assert all(len(line) <= 80 for line in out.splitlines()), out
    assert not _survivors(tag)


@pytest.mark.multirank
@pytest.mark.faults
@pytest.mark.slow
def test_a_hanging_rank_is_ended_by_the_deadline(tmp_path):
    path = tmp_path / "repro.py"
    path.write_text(ds_repro.script(ds_row(zero_stage=0, ep_size=2, world_size=2), 0))
    deadline = 30.0
    start = time.monotonic()
    done, tag = run_script(path, tmp_path, fault="repro_faults:rank-sleeps", deadline=deadline)
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert "rank 1 did not finish: killed" in done.stdout
    assert elapsed < deadline + 20, elapsed  # the deadline, plus the children's start and the kill
    assert not _survivors(tag)


@pytest.mark.multirank
@pytest.mark.faults
@pytest.mark.parametrize("signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_an_interrupted_script_kills_every_rank(tmp_path, signum):
    """Ctrl-C (or SIGTERM) to the script alone, while its ranks run: exit 130, no rank left behind."""
    path = tmp_path / "repro.py"
    path.write_text(ds_repro.script(ds_row(), 0))
    tag = uuid.uuid4().hex
    env = {**{k: v for k, v in os.environ.items() if k != "MOEBENCH_INJECT_FAULT"}, "REPRO_TEST_TAG": tag,
           "PYTHONPATH": str(_poisoned_path(tmp_path))}
    proc = subprocess.Popen([sys.executable, str(path)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        start = time.monotonic()
        while len(_survivors(tag)) < 1 + 3 and time.monotonic() - start < 60:  # the script, 2 ranks, the reference
            time.sleep(0.1)
        assert len(_survivors(tag)) >= 4, "the ranks never started"
        proc.send_signal(signum)
        _out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted: every process of the run killed" in err
    assert not _survivors(tag)


@pytest.mark.multirank
@pytest.mark.faults
@pytest.mark.slow  # the default suite runs the fairscale script through the CLI test below
@pytest.mark.parametrize("fault,status", [(None, 0), ("repro_faults:fairscale-backward-local", 1)])
def test_fairscale_script_reproduces_the_fault_and_passes_unbroken(tmp_path, fault, status):
    from moebench.libraries.fairscale import ADAPTER

    path = tmp_path / "repro.py"
    path.write_text(ADAPTER.repro_script(ADAPTER.rows(2)[1], 0))
    done, tag = run_script(path, tmp_path, fault=fault)
    assert done.returncode == status, done.stdout + done.stderr[-3000:]
    if status:
        assert "BUG: first divergence, step 1, gradient of the input group (rank 0)" in done.stdout
        assert "the backward all-to-all or the gradient" in done.stdout
    assert not _survivors(tag)


TRANSFORMERS_CASES = [
    # (fault, exit status, the first-divergence line's start); the row: mixtral, eager, all_to_all, W = 2
    (None, 0, "OK: 126 quantities agree"),
    ("repro_faults:transformers-expert-grad-x-world", 1,
     "BUG: first divergence, step 1, gradient of the expert group (rank 0):"),
]


@pytest.mark.multirank
@pytest.mark.faults
@pytest.mark.parametrize("fault,status,expected", [
    pytest.param(*case, id=(case[0] or ":unbroken").partition(":")[2],
                 marks=[pytest.mark.slow] if case[0] is None else []) for case in TRANSFORMERS_CASES])
def test_transformers_script_reproduces_the_fault_and_passes_unbroken(tmp_path, fault, status, expected):
    from moebench.libraries.transformers import ADAPTER

    row = next(r for r in ADAPTER.rows(2) if r.key() == "transformers/mixtral/eager/all_to_all/w2")
    path = tmp_path / "repro.py"
    path.write_text(ADAPTER.repro_script(row, 0))
    done, tag = run_script(path, tmp_path, fault=fault)
    assert done.returncode == status, done.stdout + done.stderr[-3000:]
    assert any(line.startswith(expected) for line in done.stdout.splitlines()), done.stdout
    if status:
        assert "actual/expected ratio 2" in done.stdout  # summed over 2 ranks instead of averaged
    assert all(len(line) <= 80 for line in done.stdout.splitlines()), done.stdout
    assert not _survivors(tag)


@pytest.mark.multirank
@pytest.mark.faults
def test_cli_writes_the_script_of_each_failing_row_and_lists_it(tmp_path):
    """verify-parity --library fairscale with fairscale's backward exchange broken: every row fails, each
    gets its script (printed, in summary.json), and the script written reproduces the failure standalone."""
    results, scripts = tmp_path / "results", tmp_path / "scripts"
    env = {k: v for k, v in os.environ.items() if k != "MOEBENCH_INJECT_FAULT"}
    env.update(PYTHONPATH=os.pathsep.join([str(INJECT), str(REPO)]),
               MOEBENCH_INJECT_FAULT="repro_faults:fairscale-backward-local", COLUMNS="80")
    done = subprocess.run([sys.executable, "-m", "moebench", "verify-parity", "--library", "fairscale", "-n", "2",
                           "--results-dir", str(results), "--repro", str(scripts)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    written = sorted(scripts.iterdir())
    assert [p.name for p in written] == ["fairscale__top2gate__-__a2a-E=2W__w2.py",
                                         "fairscale__top2gate__-__a2a-E=W__w2.py"]
    ours = done.stdout[done.stdout.index("reproduction script(s), 2 (run each: python PATH):"):].splitlines()
    assert len(ours) == 3 and all(len(line) <= 80 for line in ours), ours
    for p in written:
        assert f"  {os.path.relpath(p, tmp_path)}" in done.stdout.splitlines()
    (run,) = (results / "parity").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert sorted(item["path"] for item in summary["repro"]) == [str(p) for p in written]
    again, _ = run_script(written[0], tmp_path, fault="repro_faults:fairscale-backward-local")
    assert again.returncode == 1, again.stdout + again.stderr[-3000:]


def _figures(text: str) -> list[str]:
    """The figures of a finding, in order: of a global-norm finding from "reduced gradients right" to the norm over
    every parameter (the common factors or the engine's norms, the norm it used, the reference's); of a
    half-precision one from "every" (reported gradient, update) to the end of its sentence (the factor, the loss
    scale, the norms and the factor they predict)."""
    flat = " ".join(text.split())
    if "reduced gradients right" in flat.lower():
        start = flat.lower().index("reduced gradients right")
        end = flat.index(")", flat.index("every parameter (", start))
    else:
        start = flat.index("every ", flat.index("first divergence"))
        end = min(i for i in (flat.find("; 4 other", start), flat.find("; 8 other", start), flat.find("(exit", start),
                              len(flat)) if i >= 0)
    return re.findall(r"\d+(?:\.\d+)?(?:e[-+]\d+)?", flat[start:end])


@pytest.mark.multirank
@pytest.mark.faults
@pytest.mark.parametrize("key,fault", [
    ("deepspeed/engine/zero0/ep=2/w2/clip", None),  # DeepSpeed#8475 on the pinned release
    ("deepspeed/engine/zero0/ep=2/w2/clip+bf16", None),  # PR #8613: the clip norm without the expert gradients
    pytest.param("deepspeed/engine/zero0/ep=2/w2/fp16+static-scale", None, marks=pytest.mark.slow),  # PR #8393
    pytest.param("deepspeed/engine/zero1/ep=2/w2/clip", "ds_faults:local-global-norm", marks=pytest.mark.slow),
    pytest.param("deepspeed/engine/zero2/ep=2/w2/fp16+static-scale", "ds_half_faults:loss-scale-twice",
                 marks=pytest.mark.slow),
])
def test_the_tool_and_its_script_print_the_same_figures(tmp_path, key, fault):
    """One source of numbers: `--row KEY --repro DIR` and the script it writes, run standalone, name the same
    common factor and norms to 4 digits (the script pastes the tool's model, data and reading of an update)."""
    env = {**os.environ, "MOEBENCH_RESULTS": str(tmp_path / "results")}
    if fault:  # DS_ACCELERATOR: the fault imports DeepSpeed at start-up, before moebench names its accelerator
        env.update(PYTHONPATH=os.pathsep.join([str(INJECT), str(REPO)]), MOEBENCH_INJECT_FAULT=fault,
                   DS_ACCELERATOR="cpu")
    tool = subprocess.run([sys.executable, "-m", "moebench", "verify-parity", "--library", "deepspeed", "-n", "2",
                           "--row", key, "--repro", str(tmp_path / "scripts"), "--json"], env=env, text=True,
                          capture_output=True, timeout=SCRIPT_TIMEOUT_S)
    assert tool.returncode == 1, tool.stderr[-3000:]
    (row,) = json.loads(tool.stdout)["rows"]
    assert row["diagnosis_name"] in ("global-norm", "clip-norm-without-group", "loss-scale-never-applied",
                                     "loss-scale-twice") and row["rerun"].endswith(f"--row {key}")
    script = tmp_path / "scripts" / repro.script_name(key)
    done, tag = run_script(script, tmp_path, fault=fault)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    tool_figures, script_figures = _figures(row["diagnosis"]), _figures(done.stdout)
    assert len(tool_figures) >= 3 and tool_figures == script_figures, (row["diagnosis"], done.stdout)
    assert not _survivors(tag)

"""Dying ranks, grandchildren, a SIGKILLed parent and a read-only run folder: named, bounded, and
nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from moebench import results, tempdirs
from moebench.distributed.launch import launch

pytestmark = pytest.mark.faults


def _spawn_child_and_hang(ctx, pid_file):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(f"{pid_file}.{ctx.rank}").write_text(str(child.pid))
    time.sleep(600)


def _raise(ctx):
    raise RuntimeError(f"rank {ctx.rank} raised on purpose")


def _exit(ctx):
    os._exit(3)


def _segfault(ctx):
    import ctypes

    ctypes.string_at(0)


def test_a_ranks_children_die_with_it_at_the_deadline(tmp_path, no_leftover_children):
    pid_file = tmp_path / "grandchild"
    result = launch(_spawn_child_and_hang, 2, args=(str(pid_file),), timeout_s=4)
    assert result.status == "hung" and result.stuck_ranks == [0, 1]
    time.sleep(0.3)
    for rank in (0, 1):
        pid = int(Path(f"{pid_file}.{rank}").read_text())
        alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        assert not alive, f"rank {rank}'s child {pid} outlived it"


@pytest.mark.parametrize("fn,words", [(_raise, "raised on purpose"), (_exit, "exit code 3"),
                                      (_segfault, "SIGSEGV")])
def test_failing_ranks_are_named(fn, words, no_leftover_children):
    result = launch(fn, 2, timeout_s=30)
    assert result.status == "failed" and set(result.errors) == {0, 1}
    assert words in result.describe(), result.describe()


def test_a_sigkilled_parent_is_reported_abandoned_and_leaves_no_temp_folders(tmp_path):
    root = tmp_path / "results"
    env = {**os.environ, "MOEBENCH_RESULTS": str(root)}
    proc = subprocess.Popen([sys.executable, "-m", "moebench", "run", "fastmoe", "--steps", "100000",
                             "--world-size", "2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    metrics = None
    while time.monotonic() < deadline and metrics is None:  # wait until training is under way
        found = list(root.glob("fastmoe/*/metrics.jsonl"))
        metrics = found[0] if found and found[0].stat().st_size else None
        time.sleep(0.2)
    assert metrics is not None, proc.stderr.read() if proc.poll() is not None else "no metrics"
    ours = [p for p in tempdirs.root().glob(f"{proc.pid}-*")]
    assert ours, "the launcher's folder lives under the known prefix"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    time.sleep(1.0)  # the ranks die with their parent (PR_SET_PDEATHSIG)
    run = metrics.parent
    assert json.loads((run / "summary.json").read_text())["status"] == "running"
    listing = subprocess.run([sys.executable, "-m", "moebench", "runs", "--json"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    (row,) = json.loads(listing.stdout)["runs"]
    assert row["status"] == "abandoned"
    assert not [p for p in ours if p.exists()], "the next command removes a dead process's temp folders"
    # The next run of the kind rewrites the files too.
    results.mark_abandoned(root / "fastmoe")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "abandoned" and str(proc.pid) in summary["error"]


def test_a_run_folder_that_cannot_be_written_at_the_end_is_one_line_and_exit_1(tmp_path, monkeypatch):
    """The folder turns unwritable mid-run (simulated: every atomic write after training fails the
    way a read-only folder does, since root ignores permission bits)."""
    from typer.testing import CliRunner

    from moebench.cli.app import app
    from moebench.variants.fastmoe import rank as fastmoe_rank

    real_rank = fastmoe_rank.train_rank

    def rank_then_read_only(*args, **kwargs):
        summary = real_rank(*args, **kwargs)

        def refuse(path, data):
            raise PermissionError(13, "Permission denied", str(path))

        monkeypatch.setattr(results, "write_json_atomic", refuse)
        return summary

    monkeypatch.setattr(fastmoe_rank, "train_rank", rank_then_read_only)
    result = CliRunner().invoke(app, ["run", "fastmoe", "--steps", "3", "--results-dir", str(tmp_path / "r")])
    lines = [line for line in result.output.splitlines() if line.startswith("run failed")]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert "Permission denied" in lines[0] and "could not record status 'failed'" in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("body,words", [
    ("import sys\nsys.exit(7)\n", "called sys.exit(7) while importing"),
    ("import os\nos._exit(4)\n", "exit code 4"),
    ("import time\ntime.sleep(600)\n", "did not finish importing within 3 s"),
    ("raise ValueError('broken module')\n", "ValueError: broken module"),
])
def test_an_impl_that_exits_raises_or_hangs_at_import_is_one_line(tmp_path, monkeypatch, body, words):
    from typer.testing import CliRunner

    from moebench.cli.app import app

    (tmp_path / "user_impl.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    start = time.monotonic()
    result = CliRunner().invoke(app, ["verify-parity", "-n", "2", "--timeout", "3", "--impl",
                                      "experts=user_impl:Experts", "--results-dir", str(tmp_path / "r")])
    assert time.monotonic() - start < 30  # bounded by --timeout, not by the module
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "--impl" in lines[0] and words in lines[0], result.output
    assert not (tmp_path / "r").exists()


def _checkpoint_and_hang(ctx, marker):
    """A rank that writes a checkpoint folder under moebench-tmp (as a resume row does), then never ends."""
    folder = tempdirs.make("resume-ckpt")
    (folder / "state.pt").write_bytes(b"x" * 4096)
    Path(f"{marker}.{ctx.rank}").write_text(str(folder))
    time.sleep(600)


def test_a_killed_ranks_checkpoint_folders_go_with_it(tmp_path, monkeypatch, no_leftover_children):
    """Issue 32: an interrupted resume row left its DeepSpeed checkpoint folder in <tmp>/moebench-tmp until the
    next command. The launcher removes what its ranks made once they have ended, however they ended."""
    monkeypatch.setattr(tempdirs.tempfile, "gettempdir", lambda: str(tmp_path))
    marker = tmp_path / "made"
    result = launch(_checkpoint_and_hang, 2, args=(str(marker),), timeout_s=2)
    assert result.status == "hung"
    made = [Path(Path(f"{marker}.{rank}").read_text()) for rank in (0, 1)]
    assert all(p.parent == tmp_path / "moebench-tmp" for p in made)
    assert not any(p.exists() for p in made) and list((tmp_path / "moebench-tmp").iterdir()) == []


INTERRUPTED_LAUNCH = """
import sys
sys.path.insert(0, {tests!r})
from faults.test_processes import _checkpoint_and_hang
from moebench import signals
from moebench.distributed.launch import launch
signals.install()
launch(_checkpoint_and_hang, 2, args=({marker!r},), timeout_s=120)
"""


def test_ctrl_c_during_a_ranks_checkpoint_removes_it(tmp_path):
    marker = tmp_path / "made"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    code = INTERRUPTED_LAUNCH.format(tests=str(Path(__file__).parents[1]), marker=str(marker))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all(Path(f"{marker}.{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        made = [Path(Path(f"{marker}.{rank}").read_text()) for rank in (0, 1)]
        assert all(p.exists() for p in made)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert not any(p.exists() for p in made), [str(p) for p in made]


def test_the_sweep_removes_what_dead_processes_left_and_nothing_of_the_living(tmp_path, monkeypatch):
    monkeypatch.setattr(tempdirs.tempfile, "gettempdir", lambda: str(tmp_path))
    mine = tempdirs.make("alive")
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
    dead = tempdirs.root() / f"{dead_pid}-ds-resume-x"
    dead.mkdir()
    assert tempdirs.sweep() == [dead] and mine.exists() and not dead.exists()
    assert tempdirs.remove_owned_by([os.getpid()]) == [mine] and not mine.exists()

"""A signal is recorded by its handler and acted on at safe points, so it cannot be swallowed; the
exit code and summary.json always agree (signals.py).

Before: the handler raised KeyboardInterrupt wherever the interpreter was. Landing in a finaliser
or logging's `_releaseLock`, Python printed "Exception ignored in ..." and dropped it: the run went
on, wrote "ok", and the command exited 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from moebench import results, signals

pytestmark = pytest.mark.faults


class _SignalInAFinaliser:
    """Sends `sig` to this process from inside `__del__`, and runs Python code there, so that the
    handler runs inside the finaliser (where an exception it raises is printed and dropped)."""

    def __init__(self, sig: int) -> None:
        self.sig = sig

    def __del__(self) -> None:
        os.kill(os.getpid(), self.sig)
        sum(range(10_000))


@pytest.mark.multirank
def test_a_signal_landing_in_a_finaliser_stops_parity_at_the_next_check(tmp_path, capfd):
    from moebench.parity.runner import ParityConfig, verify_parity

    def on_record(record) -> None:
        _SignalInAFinaliser(signal.SIGTERM)  # finalised at once, with the signal inside

    config = ParityConfig(world_size=2, checks=("all-gather-variable", "experts"), timeout_s=60)
    with pytest.raises(KeyboardInterrupt):
        verify_parity(config, results_dir=str(tmp_path / "r"), on_record=on_record)
    (run,) = (tmp_path / "r" / "parity").iterdir()
    summary = results.read_back(run / "summary.json")
    assert summary["status"] == "interrupted", summary["status"]
    assert [c["name"] for c in summary["checks"]] == ["all-gather-variable"]  # what passed is kept
    assert "Exception ignored" not in capfd.readouterr().err


def test_the_final_status_and_the_exit_code_agree(tmp_path):
    """Recorded before the final summary: "interrupted" is written and KeyboardInterrupt raised.
    After it: the command is committed, the signal ignored (no exit 130 over an "ok")."""
    signals.install()
    try:
        run = results.RunDir.create("demo", root=tmp_path)
        run.start()
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(10_000))  # the handler runs: it records, never raises
        assert signals.pending() and signals.received() == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            run.finish(results.STATUS_OK, {"answer": 42})
        written = results.read_back(run.path / "summary.json")
        assert written["status"] == "interrupted" and written["answer"] == 42
        assert written["error"] == "interrupted (SIGTERM); it would have ended 'ok'"
        assert signals.interrupted_run() == str(run.path.absolute())

        signals.reset()
        run = results.RunDir.create("demo", root=tmp_path)
        run.finish(results.STATUS_OK, {})
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(10_000))
        assert not signals.pending()  # committed: the exit code follows summary.json's "ok"
        signals.check()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


PLOT_INTERRUPTED = """
import os, signal, sys
from moebench import report

real = report.plot_loss

class Finalised:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(10_000))

def plot_loss(*args, **kwargs):
    Finalised()  # the Ctrl-C lands in a finaliser during the final plot
    return real(*args, **kwargs)

report.plot_loss = plot_loss
sys.argv = ["moebench", "run", "fastmoe", "--steps", "3"]
from moebench.entry import main
main()
"""


def test_sigint_during_the_final_plot_is_recorded_interrupted_with_exit_130(tmp_path):
    env = {**os.environ, results.RESULTS_ENV: str(tmp_path / "r")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(PLOT_INTERRUPTED)], env=env, capture_output=True,
                          text=True, timeout=300)
    (run,) = (tmp_path / "r" / "fastmoe").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert (done.returncode, summary["status"]) == (130, "interrupted"), done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "Axes3D" not in done.stderr
    said = "interrupted (SIGINT): every rank was stopped; its summary.json says \"interrupted\"\nresults: "
    assert f"{said}{run.absolute()}" in done.stderr or f"{said}{run}" in done.stderr, done.stderr


@pytest.mark.multirank
def test_a_parity_folder_unwritable_at_the_end_prints_every_verdict_and_one_line(tmp_path, monkeypatch):
    """The folder turns unwritable while the checks run (simulated: root ignores permission bits,
    so every atomic write after the checks fails as a read-only folder does)."""
    from typer.testing import CliRunner

    from moebench.cli.app import app
    from moebench.parity import runner

    real_run_checks = runner.run_checks

    def checks_then_read_only(*args, **kwargs):
        summary = real_run_checks(*args, **kwargs)

        def refuse(path, data):
            raise PermissionError(13, "Permission denied", str(path))

        monkeypatch.setattr(results, "write_json_atomic", refuse)
        return summary

    monkeypatch.setattr(runner, "run_checks", checks_then_read_only)
    done = CliRunner().invoke(app, ["verify-parity", "-n", "2", "--checks", "all-gather-variable,experts",
                                    "--results-dir", str(tmp_path / "r")])
    assert done.exit_code == 1 and "Traceback" not in done.output, done.output
    assert "all-gather-variable" in done.output and "experts" in done.output
    assert "2 passed, 0 failed, 0 skipped" in done.output and "not saved" in done.output
    errors = [line for line in done.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Permission denied; the verdicts above are not saved" in errors[0], done.output


def test_a_signal_with_no_safe_point_in_sight_is_raised_after_the_grace(tmp_path):
    """Inside a blocking call (here a sleep) no safe point comes: after SAFE_POINT_GRACE_S the
    signal is delivered again and raised, and the run is recorded "interrupted"."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import time
        from moebench import signals
        from moebench.train import execute_run
        signals.install()
        def blocked(ctx, run_path):
            print("running", flush=True)
            time.sleep(600)
        execute_run(kind="toy", name="blocked", config={}, world_size=1, rank_fn=blocked)
    """))
    env = {**os.environ, results.RESULTS_ENV: str(tmp_path / "r")}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout.readline().strip() == "running"
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert signals.SAFE_POINT_GRACE_S <= took < signals.SAFE_POINT_GRACE_S + 10, took
    (run,) = (tmp_path / "r" / "toy").iterdir()
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted", err


def test_the_graces_raise_waits_until_the_main_thread_leaves_a_finaliser(tmp_path):
    """The grace's re-delivery found the main thread inside a finaliser (seen: logging's lock release, a fork
    hook, 8 s into a torchtitan row: "Exception ignored in: <function _releaseLock> ... KeyboardInterrupt"). Raised
    there it is printed and dropped, and nothing raises it again: the command then sleeps on. Now it is tried
    again every RETRY_S until the main thread is out, and raised there."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from moebench import signals
        signals.install()
        class Slow:
            def __del__(self):  # 1.5 s longer than the grace, inside a finaliser
                end = time.monotonic() + signals.SAFE_POINT_GRACE_S + 1.5
                while time.monotonic() < end:
                    time.sleep(0.01)
        print("running", flush=True)
        try:
            Slow()
            time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(130)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "running"
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the signal was dropped; the command slept on: {err[-2000:]}")
    took = time.monotonic() - sent
    assert proc.returncode == 130 and out.strip() == "interrupted", (proc.returncode, out, err)
    assert "Exception ignored" not in err, err
    assert signals.SAFE_POINT_GRACE_S + 1.0 <= took < signals.SAFE_POINT_GRACE_S + 8, took


def test_a_frame_in_logging_or_a_finaliser_is_where_exceptions_are_dropped():
    import logging

    namespace: dict = {}
    exec(compile("import sys\nframe = sys._getframe()", logging.__file__, "exec"), namespace)
    assert signals._drops_exceptions(namespace["frame"])

    class Finalised:
        def __del__(self):
            namespace["del_frame"] = sys._getframe()

    Finalised()
    assert signals._drops_exceptions(namespace["del_frame"])
    assert not signals._drops_exceptions(sys._getframe())

"""A torchrun rank ends without interpreter finalisation, after its exit handlers ran.

Finalisation is where a late-freed gloo / DeepSpeed object can abort a rank that ran cleanly
(CI saw SIGABRT, "terminate called without an active exception", after a passing run). The
stand-in here is an object that aborts the process when finalisation frees it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.faults

SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    import torch.distributed  # a rank that used torch
    from moebench import entry

    class AbortsWhenFinalised:
        def __del__(self):
            os.abort()

    KEEP = AbortsWhenFinalised()  # freed at finalisation only
    atexit.register(lambda: open(sys.argv[1], "w").write("exit handlers ran"))
    print("said before exit", end="")  # buffered: must still reach the pipe
    entry.finish_rank(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])
""")


@pytest.mark.parametrize("code,expected", [("0", 0), ("3", 3), ("bad thing", 1)])
def test_rank_exit_skips_finalisation(tmp_path, code, expected):
    marker = tmp_path / "marker"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(marker), code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == expected, out.stderr
    assert marker.read_text() == "exit handlers ran"
    assert out.stdout == "said before exit"
    if expected == 1:
        assert "bad thing" in out.stderr


def test_the_stand_in_does_abort_without_it(tmp_path):
    """The stand-in is real: a plain sys.exit finalises and aborts."""
    script = SCRIPT.replace("entry.finish_rank(", "sys.exit(")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m"), "0"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == -6


def test_an_interrupted_command_also_skips_finalisation(tmp_path):
    """A signal handled by the console script: exit 130, and nothing freed at finalisation can
    change that (the stand-in aborts when freed)."""
    script = textwrap.dedent("""
        import os, signal, sys, time, types

        class AbortsWhenFinalised:
            def __del__(self):
                os.abort()

        KEEP = AbortsWhenFinalised()
        fake = types.ModuleType("moebench.cli.app")

        def app():
            os.kill(os.getpid(), signal.SIGTERM)  # the console script's handler raises KeyboardInterrupt
            time.sleep(30)

        fake.app = app
        sys.modules["moebench.cli.app"] = fake
        from moebench import entry
        entry.main()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 130, out.stderr
    assert "interrupted" in out.stderr

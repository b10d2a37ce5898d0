"""moebench.console: where output goes."""

from __future__ import annotations

import os
import subprocess
import sys

from moebench.console import output_captured


def test_output_captured_takes_python_c_level_and_child_output_off_the_console(capfd):
    """A library's banner and progress bars (DeepSpeed's universal-checkpoint converter prints both, from
    Python and from worker processes) never reach moebench's console; the caller gets the text."""
    print("before")
    with output_captured() as text:
        print("a print")
        sys.stderr.write("a progress bar\r")
        os.write(1, b"a C-level write\n")
        subprocess.run([sys.executable, "-c", "import sys; print('a child'); print('its stderr', file=sys.stderr)"],
                       check=True)
    print("after")
    out, err = capfd.readouterr()
    assert out == "before\nafter\n" and err == ""
    assert all(piece in text[0] for piece in ("a print", "a progress bar", "a C-level write", "a child",
                                               "its stderr"))


def test_output_captured_restores_the_console_when_the_body_raises(capfd):
    try:
        with output_captured():
            print("swallowed")
            raise ValueError("the converter refused")
    except ValueError:
        pass
    print("visible")
    assert capfd.readouterr().out == "visible\n"

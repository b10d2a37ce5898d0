"""Fault injection into a subprocess (the CLI, a --repro script, the ranks they start).

Put this folder first on PYTHONPATH (`PYTHONPATH=<repo>/tests/faults/inject:<repo>`) and set
MOEBENCH_INJECT_FAULT="<module>:<name>" (module importable from tests/faults, e.g. "ds_faults:local-global-norm").
At interpreter start this imports the module and calls `FAULTS[name](setattr)`, which patches the library's own
objects in this process; processes it starts (spawned ranks) inherit the environment and patch themselves.
A fault that cannot be applied ends the process (exit 97) with one line: a test must never run unbroken code
believing it injected a fault.
"""

import os
import sys

INJECT_FAILED = 97
"""Exit status of a process whose fault could not be injected (apart from every status a run uses)."""


def _inject(spec: str) -> None:
    module_name, _, name = spec.partition(":")
    faults_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if faults_dir not in sys.path:
        sys.path.append(faults_dir)
    try:
        import importlib

        faults = importlib.import_module(module_name).FAULTS
        faults[name](setattr)
    except BaseException as exc:  # noqa: BLE001 - site would swallow it; the run must not go on unbroken
        print(f"sitecustomize: cannot inject fault {spec!r}: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(INJECT_FAILED)


if os.environ.get("MOEBENCH_INJECT_FAULT"):
    _inject(os.environ["MOEBENCH_INJECT_FAULT"])

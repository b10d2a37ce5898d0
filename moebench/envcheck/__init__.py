"""env-check's core: probes that each return a `Check`, collected into a `Report` (no CLI code here).

    from moebench.envcheck import run_all, summary
    report = run_all(probe=True, probe_timeout_s=30)   # everything, incl. the live collective probe
    env = summary()                                     # fast dict for a training run's env.json

Names are resolved lazily so that `python -m moebench.envcheck._deepspeed_import` (DeepSpeed's import
timed in a child process) does not import torch through this package first.
"""

from __future__ import annotations

_EXPORTS = {
    "Check": "check", "Report": "check", "OK": "check", "WARN": "check", "FAIL": "check", "SKIP": "check",
    "STATUSES": "check", "SCHEMA": "check", "run_all": "runner", "summary": "runner",
    "DEFAULT_PROBE_TIMEOUT_S": "runner",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"moebench.envcheck.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

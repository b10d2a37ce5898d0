"""Whether NeMo Automodel's parallelizer runs on the installed torch: 0.7.0's FSDP patch reads a method torch 2.15
removed (moebench.libraries.automodel.compat.fsdp_patch_breaks), and its rows then skip with that reason. Tests that
run those rows and expect a verdict skip the same way."""

from __future__ import annotations

import importlib.util

import pytest


def parallelizer_breaks() -> str | None:
    if importlib.util.find_spec("nemo_automodel") is None:
        return None
    from moebench.libraries.automodel import compat

    return compat.fsdp_patch_breaks()


BREAKS = parallelizer_breaks()
runs_its_parallelizer = pytest.mark.skipif(BREAKS is not None, reason=f"these rows skip on this torch: {BREAKS}")

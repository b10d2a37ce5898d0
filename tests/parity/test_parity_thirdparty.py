"""What verify-parity finds on the real st-moe-pytorch / soft-moe-pytorch (docs/verify-parity.md).

Skipped unless those packages import (install them with `pip install --no-deps --target DIR ...`
and put DIR on PYTHONPATH: never let them pull a torch)."""

from __future__ import annotations

import importlib.util

import pytest

from moebench.parity.runner import ParityConfig, run_checks

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


@pytest.mark.skipif(not _importable("soft_moe_pytorch.soft_moe"), reason="soft-moe-pytorch is not installed")
def test_soft_moe_experts_strict_fails_seed_passes_vacuously():
    impls = {"experts": "soft_moe_pytorch.soft_moe:Experts"}
    strict = run_checks(ParityConfig(world_size=9, checks=("experts",), impls=impls))["checks"][0]
    seed = run_checks(ParityConfig(world_size=9, checks=("experts",), impls=impls, tolerance="seed"))["checks"][0]
    assert strict["status"] == "fail" and "input grad" in strict["reason"]
    outputs = [c for c in strict["comparisons"] if c["name"].endswith("output")]
    assert outputs and all(c["passed"] for c in outputs)  # the forward is right; the backward is not
    assert seed["status"] == "pass" and seed["vacuous"] > 0


@pytest.mark.skipif(not _importable("st_moe_pytorch.distributed"), reason="st-moe-pytorch is not installed")
def test_st_moe_all_gather_is_not_differentiable():
    impls = {"all-gather": "st_moe_pytorch.distributed:all_gather_variable_dim"}
    record = run_checks(ParityConfig(world_size=4, checks=("all-gather-variable",), impls=impls))["checks"][0]
    assert record["status"] == "fail" and "differentiable" in record["reason"]


@pytest.mark.skipif(not _importable("st_moe_pytorch.distributed"), reason="st-moe-pytorch is not installed")
def test_st_moe_all_gather_function_strict_fails_seed_passes_vacuously():
    """st-moe's autograd AllGatherFunction (through tests/parity_broken.py's 3-line adapter): its
    backward is the local slice. Strict catches it; seed mode passes, flagged vacuous, because the
    seed asserts nothing about the backward."""
    impls = {"all-gather": "parity_broken:st_moe_all_gather_function"}
    strict = run_checks(ParityConfig(world_size=4, checks=("all-gather-variable",), impls=impls))["checks"][0]
    seed = run_checks(ParityConfig(world_size=4, checks=("all-gather-variable",), impls=impls,
                                   tolerance="seed"))["checks"][0]
    assert strict["status"] == "fail" and "input grad" in strict["reason"]
    assert seed["status"] == "pass" and seed["vacuous"] > 0 and seed["unasserted_outside"] > 0

"""loss-curve: equal curves at ep W and ep 1 for both variants; a summed expert sync fails it."""

from __future__ import annotations

import pytest

from moebench.parity.runner import ParityConfig, run_checks

pytestmark = pytest.mark.multirank


def _record(impls=None):
    summary = run_checks(ParityConfig(world_size=3, checks=("loss-curve",), impls=impls or {}, timeout_s=40.0))
    return summary["checks"][0]


def test_curves_equal_for_both_variants():
    record = _record()
    assert record["status"] == "pass", record["reason"]
    assert record["vacuous"] == 0 and record["diagnosis"] is None
    names = [c["name"] for c in record["comparisons"]]
    assert any(n.startswith("fastmoe: loss curve, ep 3 vs ep 1") for n in names)
    pytest.importorskip("deepspeed")
    assert any(n.startswith("deepspeed: loss curve, ep 3 vs ep 1") for n in names)


@pytest.mark.parametrize("impl", ["unscaled_expert_sync", "no_moe_sync"])
def test_a_wrong_sync_bends_the_curve(impl):
    record = _record({"moe-sync": f"parity_broken:{impl}"})
    assert record["status"] == "fail"
    failed = [c for c in record["comparisons"] if c["asserted"] and not c["passed"]]
    assert any("loss curve" in c["name"] for c in failed), [c["name"] for c in failed]
    curve = next(c for c in failed if "loss curve" in c["name"])
    # the first step's loss is computed before any update: only later steps differ
    assert curve["diagnosis"]["name"] in ("partial", "unexplained"), curve["diagnosis"]
    if curve["diagnosis"]["name"] == "partial":
        assert 0 not in curve["diagnosis"]["details"]["indices"]

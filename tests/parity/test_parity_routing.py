"""routing-invariants: passes on fastmoe's and DeepSpeed's gates, fails on broken Switch gates."""

from __future__ import annotations

import pytest

from moebench.parity.runner import ParityConfig, run_checks

pytestmark = pytest.mark.multirank


def _record(world_size=3, impls=None):
    summary = run_checks(ParityConfig(world_size=world_size, checks=("routing-invariants",), impls=impls or {},
                                      timeout_s=30.0))
    return summary["checks"][0]


def test_passes_on_the_real_gates_and_is_never_vacuous():
    record = _record()
    assert record["status"] == "pass", record["reason"]
    assert record["vacuous"] == 0 and record["diagnosis"] is None
    names = [c["name"] for c in record["comparisons"]]
    for gate in ("fastmoe naive", "fastmoe gshard", "fastmoe switch", "fastmoe noisy"):
        assert any(gate in n for n in names), gate
    assert any("adversarial" in n and "keeps exactly capacity" in n for n in names)
    assert any("switch capacity shared by 3 ranks" in n for n in names)
    pytest.importorskip("deepspeed")
    assert any("deepspeed top1gating" in n for n in names) and any("deepspeed top2gating" in n for n in names)


@pytest.mark.parametrize("impl", ["NoDivisionSwitchGate", "IgnoresCapacitySwitchGate"])
def test_a_switch_gate_with_the_wrong_capacity_fails(impl):
    record = _record(impls={"switch-gate": f"parity_broken:{impl}"})
    assert record["status"] == "fail"
    failed = [c["name"] for c in record["comparisons"] if c["asserted"] and not c["passed"]]
    assert any("keeps exactly capacity" in n for n in failed), failed
    assert any("no expert keeps more than capacity" in n for n in failed), failed
    assert all("switch" in n for n in failed), failed  # the other gates are untouched
    assert record["diagnosis"]["details"]["wrong"] == ["gate/router"]

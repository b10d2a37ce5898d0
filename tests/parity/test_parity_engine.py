"""deepspeed-engine-ep: ep_size = W through deepspeed.initialize (ZeRO 0/1/2) equals ep_size = 1."""

from __future__ import annotations

import pytest

from moebench.parity.runner import ParityConfig, run_checks

pytestmark = pytest.mark.multirank


def test_engine_ep_passes_for_every_zero_stage():
    pytest.importorskip("deepspeed")
    record = run_checks(ParityConfig(world_size=2, checks=("deepspeed-engine-ep",), timeout_s=60.0))["checks"][0]
    assert record["status"] == "pass", record["reason"]
    assert record["vacuous"] == 0
    names = [c["name"] for c in record["comparisons"]]
    for stage in (0, 1, 2):
        assert any(n.startswith(f"ZeRO {stage}, step 2: loss") for n in names)
        assert any(n.startswith(f"ZeRO {stage}, step 2: expert") and "after the step" in n for n in names)
    assert any("ZeRO 0, step 1: expert" in n and "grad after the engine's reduction" in n for n in names)

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


class _ExpertGradsSummed:
    """A broken engine path (DeepSpeed #5618's class): at ep_size = W the expert gradients come out
    W x too large, as if summed over the expert-parallel group instead of averaged."""

    def __new__(cls, moe, experts, seed, ep_rank, **kwargs):
        from moebench.models.deepspeed_moe import TinyMoENet

        net = TinyMoENet(moe, experts, seed, ep_rank, **kwargs)
        if moe.ep_size > 1:
            for name, p in net.named_parameters():
                if "deepspeed_experts" in name:
                    p.register_hook(lambda g, n=moe.ep_size: g * n)
        return net


def test_engine_ep_diagnoses_expert_gradients_summed_over_the_ep_group(monkeypatch):
    """The ranks are forked from this process, so they build the broken model; each ZeRO stage must
    fail on the expert updates, diagnosed as a scale of the ep size, with the loss still right."""
    pytest.importorskip("deepspeed")
    from moebench.parity import checks_engine

    monkeypatch.setattr(checks_engine, "TinyMoENet", _ExpertGradsSummed)
    record = run_checks(ParityConfig(world_size=2, checks=("deepspeed-engine-ep",), timeout_s=60.0))["checks"][0]
    assert record["status"] == "fail"
    failed = [c for c in record["comparisons"] if not c["passed"]]
    for stage in (0, 1, 2):
        updates = [c for c in failed if c["name"].startswith(f"ZeRO {stage}, step 1: expert")
                   and "update applied" in c["name"]]
        assert updates, f"ZeRO {stage}: a 2x expert gradient went unnoticed"
        for c in updates:
            assert c["diagnosis"]["name"] == "uniform-scale" and c["diagnosis"]["details"]["integer"] == 2
    step1_losses = [c for c in record["comparisons"] if "step 1: loss" in c["name"]]
    assert step1_losses and all(c["passed"] for c in step1_losses)  # the loss alone would not tell

"""deepspeed-moe-ep fed broken expert-parallel layers: each is caught, and said for what it is."""

from __future__ import annotations

import pytest

from moebench.parity.runner import ParityConfig, run_checks

pytestmark = pytest.mark.multirank


def _run(monkeypatch, broken) -> dict:
    pytest.importorskip("deepspeed")
    from moebench.parity import checks_deepspeed

    monkeypatch.setattr(checks_deepspeed, "build_layer", broken(checks_deepspeed.build_layer))
    # The ranks are forked from this process: they build the broken layer.
    record = run_checks(ParityConfig(world_size=2, checks=("deepspeed-moe-ep",), timeout_s=60.0))["checks"][0]
    assert record["status"] == "fail"
    return record


def test_experts_placed_on_the_wrong_rank_fail_the_placement_and_the_outputs(monkeypatch):
    def broken(build):
        def build_layer(moe, *, experts, seed, ep_rank):  # rank r holds rank r+1's experts
            return build(moe, experts=experts, seed=seed, ep_rank=(ep_rank + 1) % moe.ep_size)
        return build_layer

    record = _run(monkeypatch, broken)
    failed = {c["name"] for c in record["comparisons"] if not c["passed"]}
    assert any("local expert 0 holds global expert" in n for n in failed)
    assert any(n.endswith(": output") for n in failed)


def test_expert_gradients_summed_over_ranks_are_diagnosed_as_a_scale(monkeypatch):
    def broken(build):
        def build_layer(moe, *, experts, seed, ep_rank):
            layer = build(moe, experts=experts, seed=seed, ep_rank=ep_rank)
            if moe.ep_size > 1:
                for name, p in layer.named_parameters():
                    if ".deepspeed_experts." in name:
                        p.register_hook(lambda g, n=moe.ep_size: g * n)
            return layer
        return build_layer

    record = _run(monkeypatch, broken)
    grads = [c for c in record["comparisons"] if not c["passed"] and c["name"].split(": ", 1)[1].startswith("expert")]
    assert grads and all(c["diagnosis"]["name"] == "uniform-scale" and c["diagnosis"]["details"]["integer"] == 2
                         for c in grads)
    outputs = [c for c in record["comparisons"] if c["name"].endswith(": output")]
    assert outputs and all(c["passed"] for c in outputs)  # forward right, expert gradients wrong

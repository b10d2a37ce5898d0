"""fairscale's MOELayer (Top2Gate, _AllToAll) over gloo ranks vs one process: right when right, and
each injected bug - made by patching or subclassing fairscale's own objects in this process (the
ranks fork from it), never by editing installed files - failed and named by its class."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("fairscale", reason="fairscale is not installed: pip install 'moebench[fairscale]'")

from fairscale.nn import moe as fairscale_moe  # noqa: E402
from fairscale.nn.moe import moe_layer  # noqa: E402
from helpers import library_checks  # noqa: E402

from moebench.libraries import matrix  # noqa: E402
from moebench.libraries.fairscale import parity as adapter  # noqa: E402
from moebench.libraries.records import rows_of  # noqa: E402
from moebench.parity.runner import ParityConfig, run_checks  # noqa: E402


def _run(world_sizes=(2, 4), seed=0):
    with matrix.registered(library_checks(["fairscale"], world_sizes)) as checks:
        return run_checks(ParityConfig(world_size=max(world_sizes), checks=tuple(c.name for c in checks),
                                       seed=seed, timeout_s=60.0))


def _failed_row(summary):
    record = summary["checks"][0]
    assert record["status"] == "fail", "the broken fairscale path passed"
    assert record["launch_status"] == "ok", record["reason"]  # failed by its numbers, not by a crash
    failed = [c for c in record["comparisons"] if c["asserted"] and not c["passed"]]
    return record, failed


def _step1(failed, what):
    return [c for c in failed if c["name"].startswith("step 1: ") and what in c["name"]]


@pytest.mark.multirank
def test_fairscale_rows_pass_at_world_2_and_4_with_every_expert_compared():
    summary = _run()
    rows = rows_of(summary)
    assert [(r["world_size"], r["ep_mode"]) for r in rows] == [
        (2, "a2a-E=W"), (2, "a2a-E=2W"), (4, "a2a-E=W"), (4, "a2a-E=2W")]
    assert all(r["verdict"] == "pass" and r["diagnosis"] is None and r["version"] == "0.4.13" for r in rows)
    for record, per_rank in zip(summary["checks"], (1, 2, 1, 2)):
        assert record["vacuous"] == 0 and record["comparisons_total"] > 0
        names = [c["name"] for c in record["comparisons"]]
        experts = {n.split("(expert ")[1].rstrip(")") for n in names if n.startswith("step 1: grad experts.")}
        assert experts == {str(e) for e in range(per_rank * record["world_size"])}  # every global expert
        for what in ("loss", "output", "input grad", "grad gate.wg.weight", "after SGD"):
            assert any(what in n for n in names), what
        assert any(n.startswith(f"step {adapter.STEPS}: ") for n in names)


@pytest.mark.slow
@pytest.mark.multirank
def test_no_false_alarm_over_five_seeds():
    for seed in range(1, 6):
        summary = _run(seed=seed)
        assert all(c["status"] == "pass" for c in summary["checks"]), (seed, [c["reason"] for c in summary["checks"]])


def _ddp_style_sync(layer, world_size, group=None):
    """What a data-parallel wrapper does with fairscale's `p.expert` mark: average the rest, skip the experts."""
    for p in layer.parameters():
        if p.grad is not None and not getattr(p, "expert", False):
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(world_size)


@pytest.mark.multirank
def test_expert_grads_times_w(monkeypatch):
    """Expert gradients W x too large: the sync skips fairscale's expert-marked parameters, which
    already hold the sum over every rank's tokens. Real instance: deepspeedai/DeepSpeed#6545 (expert
    weights' gradient ep_size times the true one under ZeRO; also #5259 for bf16)."""
    monkeypatch.setattr(adapter, "sync_gradients", _ddp_style_sync)
    record, failed = _failed_row(_run(world_sizes=(4,)))
    grads = _step1(failed, "grad experts.")
    assert grads and all(c["diagnosis"]["name"] == "uniform-scale" and c["diagnosis"]["details"]["integer"] == 4
                         for c in grads)
    assert "summed instead of averaged over 4 ranks (the world size)" in grads[0]["diagnosis"]["sentence"]
    d = record["diagnosis"]
    assert d["name"] == "uniform-scale" and "experts" in d["details"]["wrong"]
    assert not _step1(failed, "grad gate.") and not _step1(failed, "input grad")


def _zero_backward(ctx, *grad_output):
    return None, torch.zeros_like(grad_output[0])


def _local_only_backward(ctx, *grad_output):
    """The exchange's backward keeps the chunk this rank exchanged with itself, drops the others'."""
    grad = grad_output[0]
    w, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
    keep = grad.new_zeros(grad.shape).view(w, -1)
    keep[r] = grad.reshape(w, -1)[r]
    return None, keep.view(grad.shape)


@pytest.mark.multirank
@pytest.mark.parametrize("backward", [_zero_backward, _local_only_backward], ids=["zeros", "local-only"])
def test_no_backward_all_to_all(monkeypatch, backward):
    """fairscale's _AllToAll with no backward exchange. Real instance: facebookresearch/fairscale#137
    ("moe: add all_to_all backward support": before it the MoE all-to-all sent no gradient back)."""
    monkeypatch.setattr(moe_layer._AllToAll, "backward", staticmethod(backward))
    record, failed = _failed_row(_run(world_sizes=(2,)))
    inputs = _step1(failed, "input grad")
    assert inputs and all(c["diagnosis"]["name"] == "missing-backward-exchange" for c in inputs)
    d = record["diagnosis"]
    assert d["name"] == "missing-backward-exchange" and "input gradient" in d["details"]["wrong"]
    assert "output" in d["details"]["right"] or not _step1(failed, "output")


class _ExpertMarkedGate(fairscale_moe.Top2Gate):
    """The gate's weight carries fairscale's expert mark, so the data-parallel sync treats it as an
    expert's: never all-reduced, only divided by W."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for p in self.parameters():
            p.expert = True


@pytest.mark.multirank
def test_gate_gradient_rank_local(monkeypatch):
    """The router's gradient never all-reduced: each rank keeps its own tokens' (here / W). Real
    instance: pytorch/torchtitan#2387 (MoE router weights diverge across ranks after the first step:
    the gradient from downstream of the router is not reduced)."""
    monkeypatch.setattr(fairscale_moe, "Top2Gate", _ExpertMarkedGate)
    record, failed = _failed_row(_run(world_sizes=(2,)))
    gates = _step1(failed, "grad gate.wg.weight")
    assert gates and all(c["diagnosis"]["name"] == "rank-local" for c in gates)
    assert abs(gates[0]["diagnosis"]["details"]["scale"] - 0.5) < 1e-6
    d = record["diagnosis"]
    assert d["name"] == "rank-local" and "gate/router" in d["details"]["wrong"]
    assert not _step1(failed, "grad experts.") and not _step1(failed, "input grad")


class _SwappedScoresGate(fairscale_moe.Top2Gate):
    """Where a token keeps both slots, each expert's slot carries the other expert's score."""

    def forward(self, input):
        l_aux, combine, dispatch = super().forward(input)
        flat = combine.reshape(combine.shape[0], -1)
        vals, idx = flat.topk(2, dim=1)
        both = (vals > 0).all(dim=1, keepdim=True)
        swapped = torch.where(both, flat.scatter(1, idx, vals.flip(1)), flat)
        return l_aux, swapped.view_as(combine), dispatch


@pytest.mark.multirank
def test_scores_paired_with_the_wrong_experts(monkeypatch):
    """Top-2 scores applied to each other's expert. Real instance of the class: sgl-project/sglang#8125
    (topk(sorted=False) left experts out of score order, so the wrong one was replaced)."""
    monkeypatch.setattr(fairscale_moe, "Top2Gate", _SwappedScoresGate)
    record, failed = _failed_row(_run(world_sizes=(2,)))
    outputs = _step1(failed, "output")
    assert outputs and all(c["diagnosis"]["name"] == "scores-mispaired" for c in outputs)
    assert record["diagnosis"]["name"] == "scores-mispaired"

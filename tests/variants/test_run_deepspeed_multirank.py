"""DeepSpeed-MoE on two gloo ranks: an ep_size=2 training run, and parity check 10 (which must
fail when fed a broken expert-parallel layer)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_config

from moebench import results, train, variants
from moebench.models.transformer import count_params
from moebench.variants.deepspeed.model import build_model

pytestmark = pytest.mark.multirank


@pytest.fixture
def refuse_op_builds(monkeypatch, tmp_path):
    """Any DeepSpeed op build raises (forked ranks inherit the patch); extensions dir private."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"DeepSpeed tried to build op {self.name}")

    ext = tmp_path / "torch_extensions"
    ext.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    monkeypatch.setattr(OpBuilder, "load", refuse)
    monkeypatch.setattr(OpBuilder, "jit_load", refuse)
    return ext


def test_two_rank_expert_parallel_run(tmp_path, refuse_op_builds, no_leftover_children):
    variant = variants.by_name("deepspeed")
    config = variant.prepare(make_config("deepspeed", world_size=2, ep_size=2, zero_stage=1, timeout_s=180))
    outcome = train.run_variant(variant, config, results_root=tmp_path / "results", show_progress=False)
    summary = results.read_json(outcome.run_path / "summary.json")
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["ep_size"] == 2
    assert summary["comm_backend"] == results.read_json(outcome.run_path / "config.json")["launch"]["comm_backend"]
    assert summary["comm_backend"] == "gloo"
    # Each rank holds half the experts; the table counts the global model, the same as on one process.
    whole = count_params(build_model(make_config("deepspeed")))
    assert summary["params"]["total"] == whole["total"]
    assert summary["params"]["by_category"]["experts"] == whole["by_category"]["experts"]
    # Routing totals are summed over both ranks: every token of the global batch, once per layer.
    steps = config.train.total_steps
    for layer in summary["routing"]["per_layer"]:
        assert layer["routes"] == sum(layer["exp_counts"]) == steps * config.train.tokens_per_step
    metrics = results.read_jsonl(outcome.run_path / "metrics.jsonl")
    assert len(metrics) == steps and summary["epoch_loss"][-1] < summary["epoch_loss"][0]
    assert list(refuse_op_builds.iterdir()) == []


def _check_10(world_size: int):
    from moebench.parity.runner import ParityConfig, run_checks

    return run_checks(ParityConfig(world_size=world_size, checks=("deepspeed-moe-ep",), timeout_s=90))["checks"][0]


def test_parity_check_10_passes_and_is_not_vacuous(no_leftover_children):
    record = _check_10(2)
    assert record["status"] == "pass", record["reason"]
    assert record["vacuous"] == 0 and record["comparisons_failed"] == 0
    names = {c["name"] for c in record["comparisons"]}
    for needed in ("top-1: output", "top-1: l_aux", "top-1: exp_counts", "top-1: input grad",
                   "top-2 + residual: moe.deepspeed_moe.gate.wg.weight grad (sum over ranks)",
                   "top-2 + residual: moe.coefficient.weight grad (sum over ranks)"):
        assert needed in names
    assert any(" expert 3 " in n for n in names)  # rank 1's experts are compared too


def test_parity_check_10_fails_on_an_all_to_all_without_its_backward_exchange(monkeypatch):
    from deepspeed.moe import sharded_moe

    # The broken layer sends tokens to the experts' ranks but returns each rank's gradient unexchanged.
    monkeypatch.setattr(sharded_moe._AllToAll, "backward", staticmethod(lambda ctx, *grads: (None, grads[0])))
    record = _check_10(2)
    assert record["status"] == "fail"
    failed = {c["name"] for c in record["comparisons"] if not c["passed"]}
    assert "top-1: input grad" in failed and "top-1: output" not in failed


def test_parity_check_10_fails_on_an_off_by_one_expert_placement(monkeypatch):
    from moebench.parity import checks_deepspeed

    build = checks_deepspeed.build_layer

    def off_by_one(moe, *, experts, seed, ep_rank):
        return build(moe, experts=experts, seed=seed, ep_rank=(ep_rank + 1) % moe.ep_size)

    monkeypatch.setattr(checks_deepspeed, "build_layer", off_by_one)
    record = _check_10(2)
    assert record["status"] == "fail"
    failed = {c["name"] for c in record["comparisons"] if not c["passed"]}
    assert "top-1: output" in failed and "top-1: local expert 0 holds global expert 0's weights" in failed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL path)")
def test_quick_run_on_gpu(tmp_path):
    variant = variants.by_name("deepspeed")
    config = variants.resolve_config(variant, "quick", {})
    outcome = train.run_variant(variant, config, results_root=tmp_path, show_progress=False)
    assert outcome.summary["status"] == "ok" and outcome.summary["device"].startswith("cuda")

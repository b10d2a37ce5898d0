"""Broken transformers expert parallelism, made here by subclassing or wrapping transformers' own objects
(never by editing installed files), must fail the adapter's row, in the right parameter groups.

Each patch is applied in the test process before the ranks are forked, so it reaches every rank; pytest's
monkeypatch undoes it afterwards."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed"),
]


def _one(model: str, backend: str, mode: str, world_size: int = 2):
    from libraries.hf_launch import row, run_rows

    (result,) = run_rows([row(model, backend, mode, world_size)], world_size)
    assert result.skipped is None
    return result


def _use_ep_implementation(monkeypatch, name: str, cls) -> None:
    """What `EPImplementationInterface.register(name, cls)` does, undone after the test."""
    from transformers.distributed.expert_parallel import EPImplementationInterface

    monkeypatch.setitem(EPImplementationInterface._global_mapping, name, cls)


def _experts_summed_over_ranks(monkeypatch) -> None:
    """FSDP2's divide factor on the experts reset to 1: expert gradients summed over the ranks."""
    import transformers.distributed.mixin as mixin

    original = mixin.apply_fully_sharded_data_parallelism

    def without_divide_factor(model, mesh_manager, fsdp_plan, ep_plan):
        model = original(model, mesh_manager, fsdp_plan, ep_plan)
        for name, module in model.named_modules():
            if ep_plan.get(name) == "ep_dispatch_experts":
                module.set_gradient_divide_factor(1.0)
        return model

    monkeypatch.setattr(mixin, "apply_fully_sharded_data_parallelism", without_divide_factor)


def _router_gradient_never_reduced(monkeypatch) -> None:
    """AllReduceEP without the backward all-reduce of top_k_weights."""
    import torch
    from transformers.distributed import expert_parallel as ep

    class RouterGradientNeverReduced(ep.AllReduceEP):
        def __call__(self, hidden_states, top_k_index, top_k_weights):
            ep_group = self.ep_mesh.get_group()
            hidden_states = ep._AllReduceBackward.apply(hidden_states, ep_group)
            off_rank = (top_k_index // self.num_local_experts) != self.ep_mesh.get_local_rank()
            local_index = torch.where(off_rank, self.num_local_experts, top_k_index % self.num_local_experts)
            expert_output = self.experts_forward(hidden_states, local_index, top_k_weights.masked_fill(off_rank, 0.0))
            return ep._AllReduceForward.apply(expert_output, ep_group)

    _use_ep_implementation(monkeypatch, "all_reduce", RouterGradientNeverReduced)


def _dispatch_without_backward(monkeypatch) -> None:
    """AllToAllEP whose dispatched tokens are cut from the graph."""
    from transformers.distributed import expert_parallel as ep

    class DispatchWithoutBackward(ep.AllToAllEP):
        def _dispatch_tokens(self, hidden_states, top_k_index, top_k_weights):
            tokens, expert_ids, weights, state = super()._dispatch_tokens(hidden_states, top_k_index, top_k_weights)
            return tokens.detach(), expert_ids, weights, state

    _use_ep_implementation(monkeypatch, "all_to_all", DispatchWithoutBackward)


def _weights_paired_wrong(monkeypatch) -> None:
    """AllToAllEP with each token's top-k weights reversed."""
    from transformers.distributed import expert_parallel as ep

    class WeightsPairedWrong(ep.AllToAllEP):
        def __call__(self, hidden_states, top_k_index, top_k_weights):
            return super().__call__(hidden_states, top_k_index, top_k_weights.flip(-1))

    _use_ep_implementation(monkeypatch, "all_to_all", WeightsPairedWrong)


def test_expert_gradients_times_world_size(monkeypatch):
    """(a) Expert gradients summed over the data-parallel ranks instead of averaged: the all-to-all backward
    already brings every rank's tokens' gradient to the expert's owner, and FSDP2 over the expert mesh
    (efsdp, size 1 here) divides by 1, so transformers must divide by dp_size itself
    (`set_gradient_divide_factor` in distributed/fsdp.py). Without it the experts train W times too fast.
    Real instances of the class: NVIDIA/Megatron-LM#5956 (FSDP + EP expert gradients ep_size x too large),
    deepspeedai/DeepSpeed#5259 (EP=2 expert gradients exactly 2x), databricks/megablocks#20."""
    _experts_summed_over_ranks(monkeypatch)
    result = _one("mixtral", "grouped_mm", "all_to_all")
    assert not result.passed
    grads = [c for c in result.failed if c.name.startswith("grad ")]
    assert grads and all("experts." in c.name for c in grads), result.describe()
    step0 = {c.name for c in result.comparisons if c.passed}
    assert {"output", "input grad", "grad gate.weight"} <= step0  # only the experts' gradients are wrong
    assert {c.diagnosis["name"] for c in grads} == {"uniform-scale"}
    assert all(c.diagnosis["details"]["integer"] == 2 for c in grads), result.describe()
    assert "experts" in result.failed_groups()


def test_router_gradient_never_all_reduced(monkeypatch):
    """(b) all_reduce mode: each rank backpropagates through its own experts only, so the routing weights'
    gradient it computes covers only its experts' slots. transformers sums it over the group
    (`_AllReduceBackward` on top_k_weights in AllReduceEP); without that the router gradient stays
    rank-local. Real instances: huggingface/transformers#48205 ("each rank's score gradient covers only its
    local experts' slots"), pytorch/torchtitan#2387 (router gradient never reduced under TP)."""
    _router_gradient_never_reduced(monkeypatch)
    result = _one("olmoe", "eager", "all_reduce")
    assert not result.passed
    assert "grad gate.weight" in {c.name for c in result.failed}, result.describe()
    step0_passed = {c.name for c in result.comparisons if c.passed}
    assert "output" in step0_passed  # the forward is right: only the backward misses the other ranks' slots
    assert not [c for c in result.failed if c.name.startswith("grad experts.")]
    assert {"gate/router", "input gradient"} <= result.failed_groups()
    assert result.failed[0].name == "grad gate.weight"  # the root cause comes first, named by its class
    assert result.failed[0].diagnosis["name"] == "rank-local", result.describe()


def test_no_backward_all_to_all(monkeypatch):
    """(c) The dispatch all-to-all carries no gradient back: the tokens a rank received are cut from the
    graph, so the gradient through the experts never returns to the rank that holds the token. Outputs,
    expert and router gradients stay right; the input gradient misses every expert path. Real instances:
    pytorch/torchtitan#989 (all_to_all token shuffle without backward, "Enable backward"),
    lucidrains/soft-moe-pytorch#4 (parameters on other ranks receive no gradient)."""
    _dispatch_without_backward(monkeypatch)
    result = _one("qwen3_moe", "eager", "all_to_all")
    assert not result.passed
    failed = {c.name for c in result.failed}
    assert "input grad" in failed, result.describe()
    passed = {c.name for c in result.comparisons if c.passed}
    assert {"output", "grad gate.weight"} <= passed
    assert not [n for n in failed if n.startswith("grad experts.")]
    assert result.failed_groups() == {"input gradient"}
    assert {c.diagnosis["name"] for c in result.failed} == {"missing-backward-exchange"}, result.describe()


def test_scores_paired_with_the_wrong_experts(monkeypatch):
    """(d) Each token's routing weights applied to the wrong one of its experts (the top-k slots swapped
    between dispatch and combine). Real instances: xberg-io/xberg#1211 (DeepSeek MoE gate binds top-k
    indices and weights the wrong way round), sgl-project/sglang#8125 (unsorted top-k: the score of one
    expert used for another)."""
    _weights_paired_wrong(monkeypatch)
    result = _one("mixtral", "batched_mm", "all_to_all")
    assert not result.passed
    assert "output" in {c.name for c in result.failed}, result.describe()
    assert {"output", "gate/router", "experts"} <= result.failed_groups()
    assert result.failed[0].name == "output"
    assert result.failed[0].diagnosis["name"] == "scores-mispaired", result.describe()


def test_router_gradient_from_slots_never_routed(monkeypatch):
    """(e) all_reduce mode with the batched_mm experts: the routes to other ranks' experts (sentinel slots) run
    through this rank's last local expert (batched_mm clamps the sentinel in-bounds) and their routing weight is
    zeroed in the forward only, so each rank's router collects <output grad, that expert's output> for slots it
    never routed, and the all-reduce adds them up. transformers 5.23 cuts that gradient twice (AllReduceEP's
    masked_fill, batched_mm's sentinel mask); this subclass clamps the index itself (so batched_mm sees no
    sentinel) and zeroes the weights straight-through. Real instance: huggingface/transformers#48687 ("the
    sentinel slots keep a non-zero expert output, and the zero routing weight hides that in the forward but not in
    the backward, so the router collects gradient for slots the rank never routed"), fixed by #48689."""
    import torch
    from transformers.distributed import expert_parallel as ep

    class SentinelSlotsInRouterGradient(ep.AllReduceEP):
        def __call__(self, hidden_states, top_k_index, top_k_weights):
            ep_group = self.ep_mesh.get_group()
            hidden_states = ep._AllReduceBackward.apply(hidden_states, ep_group)
            top_k_weights = ep._AllReduceBackward.apply(top_k_weights, ep_group)
            off_rank = (top_k_index // self.num_local_experts) != self.ep_mesh.get_local_rank()
            clamped = torch.where(off_rank, self.num_local_experts - 1, top_k_index % self.num_local_experts)
            zeroed_in_forward_only = top_k_weights - (top_k_weights * off_rank).detach()
            expert_output = self.experts_forward(hidden_states, clamped, zeroed_in_forward_only)
            return ep._AllReduceForward.apply(expert_output, ep_group)

    _use_ep_implementation(monkeypatch, "all_reduce", SentinelSlotsInRouterGradient)
    result = _one("olmoe", "batched_mm", "all_reduce")
    assert not result.passed
    assert "output" in {c.name for c in result.comparisons if c.passed}  # the forward is right
    assert not [c for c in result.failed if c.name.startswith("grad experts.")]
    assert "gate/router" in result.failed_groups()
    assert result.failed[0].name == "grad gate.weight", result.describe()
    assert result.failed[0].diagnosis["name"] == "unrouted-slots", result.describe()


def test_router_gradient_rank_local_with_the_other_ranks_unrouted_slots(monkeypatch):
    """(f) Both (e)'s leak and a rank-local router gradient at once, where they interact: transformers 5.16.0's
    all_reduce EP masks the off-rank routing weights with masked_fill, then all-reduces their gradient at the experts'
    input (its install_forward never passes is_expert_parallel), and batched_mm runs each sentinel slot through the
    last local expert. So each slot collects every rank's leak, the mask keeps this rank's own slots, and the gate's
    gradient is never all-reduced. Neither known-wrong answer alone matches, nor their errors added (the mask cuts
    the leak at the off-rank slots); the adapter's reference with both applied does, and the row names both."""
    import torch
    from transformers.distributed import expert_parallel as ep

    class MaskedThenReduced(ep.AllReduceEP):
        def __call__(self, hidden_states, top_k_index, top_k_weights):
            ep_group = self.ep_mesh.get_group()
            hidden_states = ep._AllReduceBackward.apply(hidden_states, ep_group)
            off_rank = (top_k_index // self.num_local_experts) != self.ep_mesh.get_local_rank()
            masked = ep._AllReduceBackward.apply(top_k_weights.masked_fill(off_rank, 0.0), ep_group)
            clamped = torch.where(off_rank, self.num_local_experts - 1, top_k_index % self.num_local_experts)
            return ep._AllReduceForward.apply(self.experts_forward(hidden_states, clamped, masked), ep_group)

    _use_ep_implementation(monkeypatch, "all_reduce", MaskedThenReduced)
    result = _one("qwen3_moe", "batched_mm", "all_reduce")
    assert not result.passed
    assert "output" in {c.name for c in result.comparisons if c.passed}  # the forward is right
    assert not [c for c in result.failed if c.name.startswith("grad experts.")]
    assert result.failed[0].name == "grad gate.weight", result.describe()
    found = result.failed[0].diagnosis
    assert found["name"] == "rank-local+unrouted-slots", result.describe()
    assert found["details"]["composite"] == ["rank-local", "unrouted-slots"]
    assert {c.diagnosis["name"] for c in result.failed if c.name == "input grad"} == {"rank-local+unrouted-slots"}


BF16_CASES = [  # (patch, model, EP mode, the noise-model judgement that fails first, its diagnosis)
    (_experts_summed_over_ranks, "mixtral", "all_to_all", "parameter gradient", "uniform-scale"),
    (_router_gradient_never_reduced, "olmoe", "all_reduce", "parameter gradient", "bf16-noise"),
    (_dispatch_without_backward, "qwen3_moe", "all_to_all", "input grad", None),
    (_weights_paired_wrong, "mixtral", "all_to_all", "output", None),
]


@pytest.mark.parametrize("patch,model,mode,judgement,diagnosis", BF16_CASES,
                         ids=[c[0].__name__[1:] for c in BF16_CASES])
def test_the_bf16_rows_noise_model_catches_each_bug(monkeypatch, patch, model, mode, judgement, diagnosis):
    """The same bugs in bf16 (the row's precision judged by moebench.parity.noise, not per element): each
    leaves its judgement far outside the noise of bf16 on one process; expert gradients x W are named."""
    from libraries.hf_launch import run_rows

    from moebench.libraries.spec import BF16, Row
    from moebench.libraries.transformers import BF16_BACKEND

    patch(monkeypatch)
    row = Row(library="transformers", model=model, backend=BF16_BACKEND, ep_mode=mode, world_size=2, kind=BF16,
              features=("bf16",), variant="bf16")
    (result,) = run_rows([row], 2)
    assert not result.passed
    first = result.failed[0]
    assert first.name.startswith(f"step 1: bf16 noise model: {judgement}'s distance from fp32"), result.describe()
    assert float(first.note.split()[-1]) > 5, result.describe()  # the ratio: unbroken rows measure 0.98-1.03
    if diagnosis:
        assert first.diagnosis["name"] == diagnosis, result.describe()
    if diagnosis == "uniform-scale":
        assert "expert gradients scaled by 2 (router right within the noise): summed instead of averaged over 2 " \
            "ranks" in first.diagnosis["sentence"]

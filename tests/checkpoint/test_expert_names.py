"""The tensor names the frameworks' own checkpointers write are read as experts (no process, no checkpoint on disk:
the names and shapes as the saves of test_framework_saves.py hold them). Each was missed before, and its save then
read "sound" with no MoE layer at all: a broken save of the same framework read sound too."""

from __future__ import annotations

from moebench.checkpoint_audit import stream as s
from moebench.checkpoint_audit.experts import layers_of
from moebench.checkpoint_audit.run import audit


def _stored(name: str, shape: tuple[int, ...], role: str = s.PARAM) -> s.Stored:
    import torch

    return s.Stored(name=name, shape=shape, dtype="float32", chunks=(s.Chunk((0,) * len(shape), shape),),
                    load=lambda: torch.randn(shape), file="f", role=role)


def test_autoep_per_expert_files_name_the_expert_last():
    """DeepSpeed AutoEP's layer_0_expert_<e> files: `<layer>.experts.w1.<e>` (one global expert's slice)."""
    mlp = "model.layers.0.mlp"
    tensors = [_stored(f"{mlp}.router.gate.weight", (8, 32))]
    tensors += [_stored(f"{mlp}.experts.{w}.{e}", (16, 32)) for e in range(8) for w in ("w1", "w2", "w3")]
    (layer,) = layers_of(tensors).values()
    assert layer.name == mlp and layer.indices() == set(range(8)) and sorted(layer.per_expert) == ["w1", "w2", "w3"]
    assert [t.name for t in layer.routers] == [f"{mlp}.router.gate.weight"]


def test_torchtitan_routed_experts_and_its_expert_bias():
    """torchtitan 0.3: `<layer>.routed_experts.inner_experts.w1_EFD` stacked, the bias `expert_bias_E`; the shared
    expert beside them is no routed expert."""
    moe = "layers.0.moe"
    tensors = [_stored(f"{moe}.routed_experts.inner_experts.{w}", (8, 32, 32)) for w in ("w1_EFD", "w2_EDF")]
    tensors += [_stored(f"{moe}.router.gate.weight", (8, 32)), _stored(f"{moe}.expert_bias_E", (8,), s.BUFFER),
                _stored(f"{moe}.shared_experts.w1.weight", (32, 32))]
    (layer,) = layers_of(tensors).values()
    assert layer.name == moe and len(layer.stacked) == 2 and len(layer.routers) == 1 and len(layer.biases) == 1


def test_a_stated_expert_count_with_no_expert_tensor_is_named():
    """--experts (or the checkpoint's own num_experts) with no tensor read as an expert's: not sound."""
    checkpoint = s.Checkpoint(format="dcp", path="x", tensors=[_stored("model.mlp.w_in", (8, 32))],
                              config_experts={"num_experts (model_states)": 8})
    problems, found, _ = audit(checkpoint, {})
    (problem,) = problems
    assert problem.name == s.EXPERT_COUNT and found["layers"] == []
    assert "no tensor in the checkpoint is recognised as an expert's" in problem.sentence
    assert audit(s.Checkpoint(format="dcp", path="x", tensors=[_stored("model.mlp.w_in", (8, 32))]), {})[0] == []

"""The frameworks' own checkpointers, at W = 2 (default tier) and W = 4 (slow tier), read sound: DeepSpeed AutoEP's
`engine.save_checkpoint` (ZeRO 1 and 2), torchtitan 0.3's `CheckpointManager` over its trainer path (fully_shard),
NeMo Automodel's `Checkpointer` (save_model / save_optimizer). Every expert is found, the EP degree is read from the
format, the optimizer state is there. And a broken save of a real framework is named: torchtitan's Module protocol
without fully_shard under spmd_types hands DCP each rank's experts as a plain tensor, and DCP keeps one rank's."""

from __future__ import annotations

import pytest
from conftest import audit_json
from helpers.automodel_torch import runs_its_parallelizer

pytestmark = pytest.mark.multirank

EXPERTS = 8
"""Every maker's model: 8 routed experts (moebench's AutoEP, torchtitan and Automodel resume rows)."""
WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [1, 2])
def test_autoep_save_checkpoint_is_sound(framework_folders, world, stage):
    code, doc = audit_json(framework_folders("autoep", world) / f"zero{stage}")
    assert code == 0 and doc["status"] == "sound", doc["lines"]
    assert doc["format"] == "deepspeed"
    assert doc["saved"]["ep_size"] == world and doc["saved"]["zero_stage"] == stage  # AutoEP's own metadata
    assert doc["saved"]["dp_world_size"] == world
    (layer,) = doc["layers"]
    assert layer["layer"] == "model.layers.0.mlp" and layer["stored"] == "per-expert"
    assert layer["experts"] == EXPERTS and set(layer["counted_by"].values()) == {EXPERTS}
    assert layer["counted_by"]["num_experts (model_states)"] == EXPERTS and layer["tensors"] == 3 * EXPERTS
    assert any(f"AutoEP at autoep_size {world} only" in line for line in doc["loads"])


@pytest.mark.parametrize("world", WORLDS)
def test_torchtitan_checkpoint_manager_is_sound(framework_folders, world):
    code, doc = audit_json(framework_folders("torchtitan", world) / "sound" / "checkpoint" / "step-2")
    assert code == 0 and doc["status"] == "sound", doc["lines"]
    assert doc["format"] == "dcp" and doc["saved"] == {"ranks": world, "ep_size": world}
    (layer,) = doc["layers"]
    assert layer["layer"] == "layers.0.moe" and layer["stored"] == "stacked" and layer["tensors"] == 3
    assert layer["experts"] == EXPERTS and set(layer["counted_by"].values()) == {EXPERTS}
    assert len(layer["counted_by"]) == 5  # the router, the expert bias, w1 / w2 / w3
    assert doc["optimizer"]["present"] and doc["optimizer"]["steps"] == [2.0]


@runs_its_parallelizer  # Automodel 0.7.0's FSDP patch does not run on torch 2.15: its saves cannot be made there
@pytest.mark.parametrize("world", WORLDS)
def test_automodel_checkpointer_step_folder_is_sound(framework_folders, world):
    step = framework_folders("automodel", world) / "sound" / "step_2"
    code, doc = audit_json(step)  # the step folder: model/ and optim/, read as one
    assert code == 0 and doc["status"] == "sound", doc["lines"]
    assert doc["format"] == "dcp" and doc["saved"]["ep_size"] == world and doc["saved"]["ranks"] == world
    assert doc["saved"]["parts"] == "model/ + optim/"
    (layer,) = doc["layers"]
    assert layer["layer"] == "model.layers.0.mlp" and layer["stored"] == "stacked"
    assert layer["experts"] == EXPERTS and set(layer["counted_by"].values()) == {EXPERTS}
    assert doc["optimizer"]["present"] and doc["optimizer"]["steps"] == [2.0]
    model_code, model = audit_json(step / "model")
    assert model_code == 0 and model["layers"][0]["experts"] == EXPERTS and not model["optimizer"]["present"]


@pytest.mark.parametrize("world", WORLDS)
def test_torchtitan_module_protocol_without_fully_shard_keeps_one_ranks_experts(framework_folders, world):
    code, doc = audit_json(framework_folders("torchtitan", world) / "plain" / "checkpoint" / "step-0")
    assert code == 1
    (problem,) = doc["problems"]
    assert problem["name"] == "expert-count" and problem["layer"] == "layers.0.moe"
    assert problem["experts"] == list(range(EXPERTS // world, EXPERTS))
    local = EXPERTS // world
    assert f"{EXPERTS} by the router layers.0.moe.router.gate.weight [{EXPERTS}, 32]" in problem["sentence"]
    assert f"{local} by layers.0.moe.routed_experts.inner_experts.w1_EFD [{local}, 32, 32]" in problem["sentence"]
    assert doc["saved"]["ep_size"] == 1  # one rank's copy of each stack


@runs_its_parallelizer
def test_automodel_step_folder_names_a_lost_file_with_its_sub_folder(framework_folders, broken_copy):
    folder = broken_copy(framework_folders("automodel", 2) / "sound" / "step_2")
    (folder / "model" / "__1_0.distcp").unlink()
    code, doc = audit_json(folder)
    assert code == 1
    (problem,) = doc["problems"]
    assert problem["name"] == "missing-file" and problem["layer"] == "model.layers.0.mlp"
    assert problem["experts"] == [4, 5, 6, 7]  # rank 1's experts at EP 2
    assert problem["sentence"].startswith("model/__1_0.distcp is named by model/.metadata and is not there")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_an_hf_save_pretrained_of_each_family_the_rows_build_is_sound(family, tmp_path_factory):
    """transformers' own `save_pretrained` (safetensors, its config.json beside it) of each MoE family moebench's
    transformers rows build, at their tiny size (8 experts): sound, 8 experts counted by the config and the router."""
    import torch

    from moebench.libraries.transformers.build import model_classes

    config_cls, model_cls, kwargs = model_classes(family)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp(family)  # not under tmp_path: its config.json is transformers', not moebench's
    model_cls(config_cls(**kwargs)).save_pretrained(folder)
    code, doc = audit_json(folder, "--hf-config", str(folder / "config.json"))
    assert code == 0 and doc["status"] == "sound", doc.get("problems")
    layers = doc["layers"]
    assert layers and all(layer["experts"] == 8 for layer in layers), layers

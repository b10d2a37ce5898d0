"""Every check, fed a broken checkpoint, names it: exit 1 and one line naming the problem, the tensor or file, the
layer and the experts. The broken checkpoints are real saves of broken states (DCP of plain local tensors, a
replica, a strided export) or real saves damaged on disk afterwards (a file removed, cut, a chunk dropped)."""

from __future__ import annotations

import os
import pickle

import pytest
from conftest import audit, audit_json

pytestmark = pytest.mark.multirank


def _named(doc: dict, name: str) -> list[dict]:
    found = [p for p in doc["problems"] if p["name"] == name]
    assert found, f"no {name} among {doc['lines']}"
    return found


def test_dcp_of_plain_local_tensors_holds_one_ranks_experts(dcp_folders):
    code, doc = audit_json(dcp_folders / "local")
    assert code == 1
    (problem,) = _named(doc, "expert-count")
    assert problem["experts"] == [2, 3] and problem["layer"] == "model.layers.0.moe"
    assert "4 by the router" in problem["sentence"] and "2 by model.layers.0.moe.experts.w1" in problem["sentence"]


def test_a_replica_written_over_other_experts_is_named(dcp_folders):
    code, doc = audit_json(dcp_folders / "replica")
    assert code == 1
    assert sorted(p["experts"] for p in _named(doc, "duplicate-expert")) == [[0, 2], [1, 3]]


def test_strided_experts_against_contiguous_are_named_slot_by_slot(dcp_folders):
    code, doc = audit_json(dcp_folders / "sound", "--against", dcp_folders / "strided")
    assert code == 1
    (problem,) = _named(doc, "permutation")
    assert "slot 1 holds expert 2; slot 2 holds expert 1" in problem["sentence"]
    assert "strided order of ep_size 2" in problem["sentence"] and problem["experts"] == [1, 2]
    same_code, same = audit_json(dcp_folders / "sound", "--against", dcp_folders / "sound")
    assert same_code == 0 and same["against"]["layers"][0]["matched"] == 4


def test_hf_export_in_strided_order_against_the_contiguous_one(hf_folders):
    code, doc = audit_json(hf_folders / "contiguous", "--against", hf_folders / "strided")
    assert code == 1
    problems = _named(doc, "permutation")
    assert len(problems) == 2  # both layers
    assert all("slot 1 holds expert 2; slot 2 holds expert 1" in p["sentence"] for p in problems)


def test_hf_export_against_the_ep_checkpoint_across_formats(hf_folders, dcp_folders):
    """Different models: no expert matches, and each is named (not a false permutation)."""
    code, doc = audit_json(hf_folders / "contiguous", "--against", dcp_folders / "sound")
    assert code == 1 and _named(doc, "unmatched")[0]["experts"] == [0, 1, 2, 3]


def test_a_missing_dcp_shard_file(dcp_folders, broken_copy):
    folder = broken_copy(dcp_folders / "sound")
    os.remove(folder / "__1_0.distcp")
    code, doc = audit_json(folder)
    assert code == 1
    (problem,) = _named(doc, "missing-file")
    assert "__1_0.distcp" in problem["sentence"]
    assert problem["layer"] == "model.layers.0.moe" and problem["experts"] == [2, 3]  # rank 1's chunk


def test_a_truncated_dcp_shard_file(dcp_folders, broken_copy):
    folder = broken_copy(dcp_folders / "sound")
    os.truncate(folder / "__1_0.distcp", 100)
    code, doc = audit_json(folder)
    assert code == 1
    (problem,) = _named(doc, "truncated")
    assert "__1_0.distcp is 100 bytes" in problem["sentence"]


def test_a_missing_and_a_truncated_safetensors_shard(hf_folders, broken_copy):
    folder = broken_copy(hf_folders / "contiguous")
    shards = sorted(folder.glob("*.safetensors"))
    os.remove(shards[1])  # layer 0's experts (save_pretrained's order)
    os.truncate(shards[-1], os.path.getsize(shards[-1]) - 64)
    code, doc = audit_json(folder)
    assert code == 1
    (missing,) = _named(doc, "missing-file")
    assert shards[1].name in missing["sentence"]
    assert missing["layer"] == "model.layers.0.block_sparse_moe" and missing["experts"] == [0, 1, 2, 3]
    (cut,) = _named(doc, "truncated")
    assert shards[-1].name in cut["sentence"] and cut["layer"] == "model.layers.1.block_sparse_moe"
    assert not [p for p in doc["problems"] if p["name"] == "unreadable"]  # a cut file is named once, whole


def _edit_metadata(folder, change) -> None:
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    change(metadata.state_dict_metadata["model.layers.0.moe.experts.w1"].chunks)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def test_dcp_optimizer_state_without_a_step(dcp_folders, broken_copy):
    """The class of NVIDIA-NeMo/Automodel#2088: a parameter's Adam state saved without its step."""
    folder = broken_copy(dcp_folders / "sound")
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    del metadata.state_dict_metadata["optim.state.layers.0.moe.experts.w2.step"]
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    code, doc = audit_json(folder)
    assert code == 1
    (problem,) = _named(doc, "missing-state")
    assert problem["tensor"] == "model.layers.0.moe.experts.w2" and problem["layer"] == "model.layers.0.moe"
    assert "has no step" in problem["sentence"]


def test_dcp_without_the_routers_optimizer_state(dcp_folders, broken_copy):
    """NVIDIA-NeMo/Automodel#2088 as its 0.5.0 saves it (tests/checkpoint/test_automodel_release.py): the router's Adam
    state absent, every other parameter's present."""
    folder = broken_copy(dcp_folders / "sound")
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    router = [key for key in metadata.state_dict_metadata if key.startswith("optim.state.") and ".router." in key]
    assert router, sorted(metadata.state_dict_metadata)
    for key in router:
        del metadata.state_dict_metadata[key]
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    code, doc = audit_json(folder)
    assert code == 1
    (problem,) = _named(doc, "missing-state")
    assert problem["layer"] == "model.layers.0.moe" and "the router has no optimizer state" in problem["sentence"]


def test_a_chunk_gap_and_a_chunk_overlap(dcp_folders, broken_copy):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    gap = broken_copy(dcp_folders / "sound")
    _edit_metadata(gap, lambda chunks: chunks.pop())
    code, doc = audit_json(gap)
    assert code == 1 and _named(doc, "chunk-gap")[0]["experts"] == [2, 3]
    overlap = broken_copy(dcp_folders / "replica")
    _edit_metadata(overlap, lambda chunks: chunks.append(ChunkStorageMetadata(offsets=chunks[0].offsets,
                                                                              sizes=chunks[0].sizes)))
    code, doc = audit_json(overlap)
    assert code == 1 and _named(doc, "chunk-overlap")[0]["experts"] == [0, 1]


def test_expert_count_against_experts_and_hf_config(dcp_folders, hf_folders, tmp_path):
    code, doc = audit_json(dcp_folders / "sound", "--experts", "8")
    assert code == 1 and "8 by --experts" in _named(doc, "expert-count")[0]["sentence"]
    config = tmp_path / "mixtral-6.json"
    config.write_text('{"num_local_experts": 6}')
    code, doc = audit_json(hf_folders / "contiguous", "--hf-config", config)
    assert code == 1 and _named(doc, "missing-expert")[0]["experts"] == [4, 5]


def test_deepspeed_universal_with_a_persistent_buffer_is_not_restored(ds_folders):
    code, doc = audit_json(ds_folders / "buffer")
    assert code == 1
    (problem,) = _named(doc, "not-restored")
    assert problem["tensor"] == "moe.moe.deepspeed_moe.gate.e_score_correction_bias"
    assert doc["layers"][0]["counted_by"]["the routing bias moe.moe.deepspeed_moe.gate.e_score_correction_bias [4]"]


def test_deepspeed_regular_missing_expert_file_and_expert_in_the_wrong_file(ds_folders, broken_copy):
    folder = broken_copy(ds_folders / "regular") / "step2"
    os.remove(folder / "layer_0_expert_1_mp_rank_00_model_states.pt")
    os.rename(folder / "layer_0_expert_3_mp_rank_00_model_states.pt",
              folder / "layer_0_expert_2_mp_rank_00_model_states.pt")
    code, doc = audit_json(folder.parent)
    assert code == 1
    missing = {tuple(p["experts"]) for p in _named(doc, "missing-expert")}
    assert missing == {(1, 2)}  # expert 1's file is gone; expert 2's file holds expert 3's tensors
    assert _named(doc, "permutation")[0]["experts"] == [2, 3]


def _edit_optimizer(path, change) -> None:
    import torch

    state = torch.load(path, weights_only=True)
    change(state["optimizer"]["state"])
    torch.save(state, path)


def test_deepspeed_optimizer_state_missing_a_step_and_one_shared_step(ds_folders, broken_copy):
    folder = broken_copy(ds_folders / "regular") / "step2"
    _edit_optimizer(folder / "expp_rank_1_mp_rank_00_optim_states.pt", lambda state: state[7].pop("step"))
    code, doc = audit_json(folder.parent)
    assert code == 1
    (problem,) = _named(doc, "missing-state")
    assert "expp_rank_1_mp_rank_00_optim_states.pt parameter #7" in problem["tensor"]
    assert "no step" in problem["sentence"]



def test_deepspeed_steps_that_disagree_and_one_shared_step(ds_folders, broken_copy):
    import torch

    folder = broken_copy(ds_folders / "regular") / "step2"
    path = folder / "expp_rank_0_mp_rank_00_optim_states.pt"
    _edit_optimizer(path, lambda state: state[3].update(step=torch.tensor(5.0)))
    code, doc = audit_json(folder.parent)
    assert code == 1 and "5 for 1" in _named(doc, "step-mismatch")[0]["sentence"]

    def one_step(state):
        step = torch.tensor(2.0)
        for entry in state.values():
            entry["step"] = step
    _edit_optimizer(path, one_step)
    code, doc = audit_json(folder.parent)
    assert code == 1 and _named(doc, "shared-step")[0]["tensor"].startswith("expp_rank_0")


def test_a_broken_line_is_printed_with_exit_1(dcp_folders):
    code, out, _, seconds = audit(dcp_folders / "local")
    assert code == 1
    assert any(line.startswith("expert-count: layer model.layers.0.moe") for line in out.splitlines())
    assert seconds < 60


def test_megatron_missing_rank_file(megatron_folders, broken_copy):
    """Megatron writes each expert as its own chunk: a rank's file gone takes that rank's experts."""
    folder = broken_copy(megatron_folders / "sound")
    os.remove(folder / "__1_0.distcp")
    code, doc = audit_json(folder)
    assert code == 1
    lost = _named(doc, "missing-file")[0]
    assert lost["layer"] == "mlp" and lost["experts"] == [4, 5, 6, 7]  # rank 1 of EP 2: experts 4-7


def test_a_cut_deepspeed_expert_file_is_named_with_its_expert(ds_folders, broken_copy):
    folder = broken_copy(ds_folders / "regular") / "step2"
    path = folder / "layer_0_expert_2_mp_rank_00_model_states.pt"
    os.truncate(path, os.path.getsize(path) // 2)
    code, doc = audit_json(folder.parent)
    assert code == 1
    (problem,) = _named(doc, "unreadable")
    assert problem["experts"] == [2] and "layer_0_expert_2_mp_rank_00_model_states.pt (layer 0, expert 2)" in \
        problem["sentence"]
    assert [p["experts"] for p in _named(doc, "missing-expert")] == [[2], [2], [2], [2]]  # its four tensors


def test_an_expert_stored_twice(hf_folders, broken_copy):
    """A shard written twice under two names (a resumed export that rewrote a rank's file): every expert in it is
    stored twice, each named with both files."""
    import shutil

    folder = broken_copy(hf_folders / "contiguous")
    shutil.copy(folder / "model-00002-of-00004.safetensors", folder / "model-00002-of-00004.rank1.safetensors")
    code, doc = audit_json(folder)
    assert code == 1
    twice = [p for p in _named(doc, "duplicate-expert") if "stored 2 times" in p["sentence"]]
    assert sorted({tuple(p["experts"]) for p in twice}) == [(0,), (1,), (2,), (3,)]
    assert "model-00002-of-00004.rank1.safetensors" in twice[0]["sentence"]


def test_a_missing_zero_optimizer_partition(ds_folders, broken_copy):
    folder = broken_copy(ds_folders / "zero1") / "step2"
    os.remove(folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    code, doc = audit_json(folder)
    assert code == 1
    (problem,) = _named(doc, "missing-file")
    assert problem["tensor"] == "zero_pp_rank_1_mp_rank_00_optim_states.pt" and "(1 of 2)" in problem["sentence"]

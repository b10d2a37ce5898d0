"""NeMo Automodel's resume rows (issue 40): its DeepSeek-V3 model parallelized as its recipes do (apply_ep, then
apply_fsdp), trained as train_ft steps (with its routing bias updated every step), saved and loaded by its own
Checkpointer over DCP, every slot matched against every global expert right after the load, then continued bit for
bit (moebench/libraries/automodel/resume.py). Known-wrong checkpoints (experts swapped in what its ModelState hands
DCP, an Adam moment from another expert in its OptimizerState's, the step counts dropped) and a routing bias left
rank-local (NVIDIA-NeMo/Automodel#3348 undone) are fed to the slot matcher and the uninterrupted reference by patching
Automodel's own objects in this process (the ranks fork from it)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(importlib.util.find_spec("nemo_automodel") is None,
                                 reason="NeMo Automodel is not installed (pip install 'moebench[automodel]')")]
EXPERTS = "experts.gate_and_up_projs"


def _rows(pattern: str = "*/torch_mm/*/w2/resume", world_size: int = 2, seed: int = 0):
    from moebench.libraries.automodel import ADAPTER
    from moebench.testing import run_rows

    return run_rows(ADAPTER, world_size=world_size, rows=[pattern], resume=True, seed=seed)


def test_the_pinned_release_restores_every_slot_and_continues_bit_for_bit():
    records = _rows("*/w2/resume*")
    assert [(r["check"].rsplit("/", 1)[1], r["backend"], r["verdict"]) for r in records] == [
        ("resume", "torch", "pass"), ("resume", "torch_mm", "pass"), ("resume-to-noep", "torch_mm", "pass")], records


def _swap_in_saved(monkeypatch, wrapper: str, key_end: str):
    """What Automodel's `wrapper` (ModelState / OptimizerState) hands DCP, with local slots 0 and 1 of every tensor
    whose key ends with `key_end` swapped (a copy: the live state is untouched)."""
    from nemo_automodel.components.checkpoint import stateful_wrappers
    from torch.distributed.tensor import DTensor

    owner = getattr(stateful_wrappers, wrapper)
    original = owner.state_dict

    def swapped(self):
        sd = original(self)

        def walk(d):
            for key, t in list(d.items()):
                if isinstance(t, dict):
                    walk(t)
                elif str(key).endswith(key_end) and isinstance(t, DTensor) and t.dim() == 3:
                    local = t.to_local()
                    moved = local.clone()
                    moved[[0, 1]] = local[[1, 0]]
                    d[key] = DTensor.from_local(moved, t.device_mesh, t.placements)
        walk(sd)
        return sd

    monkeypatch.setattr(owner, "state_dict", swapped)


@pytest.mark.faults
def test_two_experts_swapped_in_the_checkpoint_are_named_slot_by_slot(monkeypatch):
    _swap_in_saved(monkeypatch, "ModelState", EXPERTS)
    (record,) = _rows()
    assert (record["verdict"], record["diagnosis_name"]) == ("fail", "permutation"), record
    assert "rank 0, local slot 0 holds global expert 1's weights; it should hold expert 0" in record["diagnosis"]


@pytest.mark.faults
def test_an_adam_moment_from_another_expert_is_named(monkeypatch):
    _swap_in_saved(monkeypatch, "OptimizerState", EXPERTS + ".exp_avg")
    (record,) = _rows()
    assert (record["verdict"], record["diagnosis_name"]) == ("fail", "permutation"), record
    assert "rank 0, local slot 0 holds global expert 1's exp_avg; it should hold expert 0" in record["diagnosis"]


@pytest.mark.faults
def test_a_routing_bias_left_rank_local_is_named_before_any_save(monkeypatch):
    """apply_fsdp without #3348's step (the routing bias distributed over the data-parallel mesh): each rank updates
    it from its own tokens' expert load, and the ranks' biases part after the first step."""
    from nemo_automodel.components.moe import parallelizer
    from nemo_automodel.components.moe.layers import MoE

    original = parallelizer.apply_fsdp

    def without_bias_distribution(model, *args, **kwargs):
        original(model, *args, **kwargs)
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            bias = moe.gate.e_score_correction_bias
            if hasattr(bias, "to_local"):
                moe.gate.e_score_correction_bias = bias.to_local().clone()

    monkeypatch.setattr(parallelizer, "apply_fsdp", without_bias_distribution)
    (record,) = _rows()
    assert record["verdict"] == "fail", record
    assert "step 1: every rank holds the same routing bias" in record["diagnosis"], record["diagnosis"]


@pytest.mark.faults
def test_a_checkpoint_without_the_step_counts_fails_the_continuation(monkeypatch):
    from nemo_automodel.components.checkpoint import stateful_wrappers

    original = stateful_wrappers.OptimizerState.state_dict

    def no_steps(self):
        sd = original(self)

        def walk(d):
            for key, t in list(d.items()):
                if isinstance(t, dict):
                    walk(t)
                elif str(key).endswith("step") and hasattr(t, "mul"):
                    d[key] = t * 0
        walk(sd)
        return sd

    monkeypatch.setattr(stateful_wrappers.OptimizerState, "state_dict", no_steps)
    (record,) = _rows()
    assert record["verdict"] == "fail", record
    assert "(resumed)" in record["diagnosis"] and "vs the run that never stopped" in record["diagnosis"], record


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_no_false_alarms_over_seeds(world_size, seed):
    records = _rows(f"*/w{world_size}/resume*", world_size, seed)
    assert len(records) == 3 and {r["verdict"] for r in records} == {"pass"}, records

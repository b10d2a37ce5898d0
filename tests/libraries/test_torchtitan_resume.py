"""torchtitan's resume rows: its MoE parallelized through its trainer's parallelize function (fully_shard included),
trained through its own OptimizersContainer (with its load-balancing hook), saved and loaded by its own
CheckpointManager over DCP, every slot matched against every global expert right after the load, then continued bit
for bit with the run that never stopped (moebench/libraries/torchtitan/resume.py). Known-wrong checkpoints (experts
swapped, an Adam moment from another expert, ranks whose expert biases disagree, an optimizer step count dropped) are
fed to the slot matcher and the uninterrupted reference, and a router wrong alike before and after the save to the
one-process reference, by patching torchtitan's own objects in this process (the ranks fork from it)."""

from __future__ import annotations

import importlib.util
import re

import pytest

INSTALLED = importlib.util.find_spec("torchtitan") is not None and all(
    importlib.util.find_spec(m) is not None for m in ("spmd_types", "tyro", "docstring_parser"))
pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(not INSTALLED, reason="torchtitan is not installed (pip install "
                                 "'moebench[torchtitan]' && pip install --no-deps torchtitan==0.3.0)")]
W1 = "routed_experts.inner_experts.w1_EFD"


def _rows(pattern: str, world_size: int = 2, seed: int = 0):
    from moebench.libraries.torchtitan import ADAPTER
    from moebench.testing import run_rows

    return run_rows(ADAPTER, world_size=world_size, rows=[pattern], resume=True, seed=seed)


def test_the_dtensor_backends_restore_every_slot_at_the_same_layout_and_under_tp():
    records = _rows("*/partial_dtensor/ep/w2/resume*")
    assert [(r["check"].rsplit("/", 1)[1], r["verdict"]) for r in records] == [("resume", "pass"),
                                                                              ("resume-to-tp", "pass")], records


def _spmd_types_refused() -> str | None:
    from moebench.libraries.torchtitan import trainer

    return trainer.fsdp_refusal("spmd_types")


def test_the_default_backend_restores_every_slot_through_its_trainers_fsdp():
    """spmd_types through its trainer's parallelize: fully_shard turns its plain parameters into DTensors (torch
    2.14+), so DCP saves every expert and the load restores every slot, under EP and under TP; on a torch whose
    fully_shard refuses them, both rows are refused with FSDP's words (never a failure: the trainer cannot run
    there)."""
    same, to_tp = _rows("*/spmd_types/ep/w2/resume*")
    if _spmd_types_refused():
        for record in (same, to_tp):
            assert record["verdict"] == "refused" and "pytorch/pytorch#181519" in record["diagnosis"], record
        return
    assert (same["verdict"], to_tp["verdict"]) == ("pass", "pass"), (same, to_tp)


def test_a_checkpoint_saved_at_ep_2_loads_at_ep_4_through_dcps_resharding():
    """W = 4: saved under EP 2 (the experts over an expert-data-parallel axis of 2), loaded under EP 4: partial_dtensor
    restores every slot through DCP's resharding; the full-SPMD-mesh backends cannot build the second layout's
    ParallelDims in the same process (skipped, saying so)."""
    records = {r["backend"]: r for r in _rows("*/w4/resume-ep2-to-ep4", world_size=4)}
    assert {b: r["verdict"] for b, r in records.items()} == {"spmd_types": "skip", "partial_dtensor": "pass",
                                                              "full_dtensor": "skip"}, records
    assert "two ParallelDims in one process" in records["full_dtensor"]["diagnosis"], records


@pytest.mark.faults
def test_two_experts_swapped_at_ep_2_are_named_after_the_ep_4_load(monkeypatch):
    _swap_experts_in_saved(monkeypatch, "model", W1)
    (record,) = _rows("*/partial_dtensor/ep/w4/resume-ep2-to-ep4", world_size=4)
    assert (record["verdict"], record["diagnosis_name"]) == ("fail", "permutation"), record
    assert "rank 0, local slot 0 holds global expert 1's weights" in record["diagnosis"], record["diagnosis"]


def _swap_experts_in_saved(monkeypatch, where: str, key_part: str):
    """The checkpoint (what `where`.state_dict hands DCP) with local slots 0 and 1 of every tensor whose key holds
    `key_part` swapped; the live state is untouched."""
    from torch.distributed.tensor import DTensor

    from moebench.libraries.torchtitan import api

    api.load()
    from torchtitan.components.checkpointer import base
    from torchtitan.components.optimizer import optimizer

    owner = base.ModelWrapper if where == "model" else optimizer.OptimizersContainer
    original = owner.state_dict

    def swapped(self):
        sd = dict(original(self))
        for key, t in sd.items():
            if key.endswith(key_part) and hasattr(t, "shape") and len(t.shape) == 3:
                local = t.to_local() if isinstance(t, DTensor) else t
                moved = local.clone()
                moved[[0, 1]] = local[[1, 0]]
                sd[key] = DTensor.from_local(moved, t.device_mesh, t.placements) if isinstance(t, DTensor) else moved
        return sd

    monkeypatch.setattr(owner, "state_dict", swapped)


@pytest.mark.faults
def test_a_checkpoint_with_two_experts_swapped_is_named_slot_by_slot(monkeypatch):
    _swap_experts_in_saved(monkeypatch, "model", W1)
    (record,) = _rows("*/partial_dtensor/ep/w2/resume")
    assert (record["verdict"], record["diagnosis_name"]) == ("fail", "permutation"), record
    assert "rank 0, local slot 0 holds global expert 1's weights; it should hold expert 0" in record["diagnosis"]


@pytest.mark.faults
def test_an_adam_moment_from_another_expert_is_named(monkeypatch):
    _swap_experts_in_saved(monkeypatch, "optimizer", W1 + ".exp_avg")
    (record,) = _rows("*/partial_dtensor/ep/w2/resume")
    # the weights are right; a slot holding another expert's moment is a permutation (named before split-restore)
    assert (record["verdict"], record["diagnosis_name"]) == ("fail", "permutation"), record
    assert "rank 0, local slot 0 holds global expert 1's exp_avg; it should hold expert 0" in record["diagnosis"]


@pytest.mark.faults
def test_ranks_whose_expert_biases_disagree_before_the_save_are_named(monkeypatch):
    """The load-balancing update computed from this rank's tokens alone (its token counts never all-reduced)."""
    import torch.distributed as dist

    from moebench.libraries.torchtitan import api

    api.load()
    from torchtitan.components.optimizer import optimizer

    real = dist.all_reduce

    def counts_kept_local(tensor, *args, **kwargs):
        if tensor.dim() == 2 and tensor.shape[-1] == api.NUM_EXPERTS:  # the stacked per-layer token counts
            return None
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(optimizer.torch.distributed, "all_reduce", counts_kept_local)
    (record,) = _rows("*/partial_dtensor/ep/w2/resume")
    assert record["verdict"] == "fail", record
    assert "every rank holds the same expert bias" in record["diagnosis"], record["diagnosis"]


@pytest.mark.faults
def test_a_checkpoint_without_the_optimizers_step_count_fails_the_continuation(monkeypatch):
    """The moments are restored, the step count is not: the slot matcher's state is right, Adam's bias correction is
    not, and the run that never stopped tells them apart from the first resumed step."""
    from moebench.libraries.torchtitan import api

    api.load()
    from torchtitan.components.optimizer import optimizer

    original = optimizer.OptimizersContainer.state_dict

    def no_steps(self):
        sd = dict(original(self))
        for key in [k for k in sd if k.endswith(".step")]:
            sd[key] = sd[key] * 0
        return sd

    monkeypatch.setattr(optimizer.OptimizersContainer, "state_dict", no_steps)
    (record,) = _rows("*/partial_dtensor/ep/w2/resume")
    assert record["verdict"] == "fail", record
    assert "(resumed)" in record["diagnosis"] and "vs the run that never stopped" in record["diagnosis"], record


def test_the_run_that_never_stopped_is_one_process_step_by_step():
    """Every step's router and expert gradients within the noise model of torchtitan's module on one process, the
    shared expert's float32-exact, the expert bias after the hook's update exact, at every step of the row."""
    (record,) = _rows("*/partial_dtensor/ep/w2/resume")
    assert record["verdict"] == "pass", record


@pytest.mark.faults
def test_a_router_wrong_alike_before_and_after_the_save_fails_against_one_process(monkeypatch):
    """torchtitan's router passing back half its scores' gradient: the resumed run equals the run that never stopped
    bit for bit, so only the one-process reference sees it: torchtitan's own module no longer has the mathematics'
    router gradient (its one-process baseline shares the fault, so the noise model's ratio alone would not)."""
    from moebench.libraries.torchtitan import api

    api.load()
    from torchtitan.models.common import moe

    forward = moe.TokenChoiceTopKRouter.forward

    def half_gradient(self, *args, **kwargs):  # the same scores forward, half their gradient backward
        scores, ids, all_scores = forward(self, *args, **kwargs)
        return 0.5 * scores + 0.5 * scores.detach(), ids, all_scores

    monkeypatch.setattr(moe.TokenChoiceTopKRouter, "forward", half_gradient)
    (record,) = _rows("*/partial_dtensor/ep/w2/resume")
    assert record["verdict"] == "fail", record
    assert record["diagnosis_name"] == "one-process-differs", record["diagnosis"]
    assert re.search(r"at step 1 torchtitan's router gradient is 0\.50?\d* from float32 \(x 0\.(49|50)",
                     record["diagnosis"]), record["diagnosis"]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_no_false_alarms_over_seeds(world_size, seed):
    records = _rows(f"*/*dtensor/ep/w{world_size}/resume*", world_size, seed)
    skipped = {r["check"] for r in records if r["verdict"] == "skip"}  # two ParallelDims in one process
    assert skipped == ({"torchtitan/sigmoid-grouped+shared/full_dtensor/ep/w4/resume-ep2-to-ep4"} if world_size == 4
                       else set()), records
    assert len(records) == (4 if world_size == 2 else 6) and all(
        r["verdict"] == "pass" for r in records if r["check"] not in skipped), records


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["spmd_types", "partial_dtensor"])
def test_the_standalone_script_reproduces_the_row(tmp_path, backend):
    """`--repro`'s script for a resume row (torch, torchtitan and spmd_types only), through the trainer's parallelize
    as the row: every slot restored, exit 0; spmd_types on a torch whose fully_shard refuses it: exit 2 with FSDP's
    words."""
    code, words = 0, "every expert slot of every rank restored bit for bit"
    if backend == "spmd_types" and _spmd_types_refused():
        code, words = 2, "all parameters must be DTensors on the full SPMD mesh"
    import os
    import subprocess
    import sys

    from moebench.libraries.torchtitan import ADAPTER

    key = f"torchtitan/sigmoid-grouped+shared/{backend}/ep/w2/resume"
    (row,) = [r for r in ADAPTER.rows(2, resume=True) if r.key() == key]
    script = tmp_path / "repro.py"
    script.write_text(ADAPTER.repro_script(row, seed=0))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # moebench is not on the script's path
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=env)
    assert done.returncode == code and words in done.stdout + done.stderr, (done.returncode, done.stdout[-2000:],
                                                              done.stderr[-2000:])

"""NeMo Automodel's resume rows (issue 40): its DeepSeek-V3 model parallelized as its recipes do (apply_ep, then
apply_fsdp), trained as train_ft steps (with its routing bias updated every step), saved and loaded by its own
Checkpointer over DCP, every slot matched against every global expert right after the load, then continued bit for
bit (moebench/libraries/automodel/resume.py). Known-wrong checkpoints (experts swapped in what its ModelState hands
DCP, an Adam moment from another expert in its OptimizerState's, the step counts dropped) and a routing bias left
rank-local (NVIDIA-NeMo/Automodel#3348 undone) are fed to the slot matcher and the uninterrupted reference, and a step
wrong alike before and after the save to the one-process reference, by patching Automodel's own objects in this
process (the ranks fork from it)."""

from __future__ import annotations

import importlib.util

import pytest
from helpers.automodel_torch import runs_its_parallelizer

pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(importlib.util.find_spec("nemo_automodel") is None,
                                 reason="NeMo Automodel is not installed (pip install 'moebench[automodel]')")]
EXPERTS = "experts.gate_and_up_projs"


def _rows(pattern: str = "*/torch_mm/*/w2/resume", world_size: int = 2, seed: int = 0):
    from moebench.libraries.automodel import ADAPTER
    from moebench.testing import run_rows

    return run_rows(ADAPTER, world_size=world_size, rows=[pattern], resume=True, seed=seed)


@runs_its_parallelizer
def test_the_pinned_release_restores_every_slot_and_continues_bit_for_bit():
    records = _rows("*/w2/resume*")
    assert [(r["check"].rsplit("/", 1)[1], r["backend"], r["verdict"]) for r in records] == [
        ("resume", "torch", "pass"), ("resume", "torch_mm", "pass"), ("resume-to-noep", "torch_mm", "pass")], records


def _swap_in_saved(monkeypatch, wrapper: str, key_end: str):
    """Local slots 0 and 1 swapped in what Automodel's `wrapper` hands DCP (tests/faults/repro_faults.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
    from repro_faults import swap_in_saved

    swap_in_saved(monkeypatch.setattr, wrapper, key_end)


@runs_its_parallelizer
@pytest.mark.faults
def test_two_experts_swapped_in_the_checkpoint_are_named_slot_by_slot(monkeypatch):
    _swap_in_saved(monkeypatch, "ModelState", EXPERTS)
    (record,) = _rows()
    assert (record["verdict"], record["diagnosis_name"]) == ("fail", "permutation"), record
    assert "rank 0, local slot 0 holds global expert 1's weights; it should hold expert 0" in record["diagnosis"]


@runs_its_parallelizer
def test_a_checkpoint_saved_at_ep_2_loads_at_ep_4_with_every_slot_restored():
    """W = 4: saved under EP 2 (each expert on 2 ranks, Automodel's ep_shard 2), loaded under EP 4 through DCP's
    resharding: every slot of every rank holds its global expert's weights and moments."""
    (record,) = _rows("*/w4/resume-ep2-to-ep4", world_size=4)
    assert record["verdict"] == "pass", record


@runs_its_parallelizer
@pytest.mark.faults
def test_two_experts_swapped_at_ep_2_are_named_after_the_ep_4_load(monkeypatch):
    _swap_in_saved(monkeypatch, "ModelState", EXPERTS)
    (record,) = _rows("*/w4/resume-ep2-to-ep4", world_size=4)
    assert (record["verdict"], record["diagnosis_name"]) == ("fail", "permutation"), record
    assert "rank 0, local slot 0 holds global expert 1's weights; it should hold expert 0" in record["diagnosis"]


@runs_its_parallelizer
@pytest.mark.faults
def test_an_adam_moment_from_another_expert_is_named(monkeypatch):
    _swap_in_saved(monkeypatch, "OptimizerState", EXPERTS + ".exp_avg")
    (record,) = _rows()
    assert (record["verdict"], record["diagnosis_name"]) == ("fail", "permutation"), record
    assert "rank 0, local slot 0 holds global expert 1's exp_avg; it should hold expert 0" in record["diagnosis"]


@runs_its_parallelizer
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


@runs_its_parallelizer
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


@runs_its_parallelizer
@pytest.mark.faults
def test_a_step_wrong_alike_before_and_after_the_resume_fails_against_one_process(monkeypatch):
    """The trainer's EP scaling skipped (scale_grads_and_clip_grad_norm without the MoE mesh): the resumed run still
    equals the run that never stopped, bit for bit, so only the one-process reference sees it: the experts'
    gradients summed over the 2 ranks instead of averaged, named."""
    from nemo_automodel.components.training import utils

    scale = utils.scale_grads_and_clip_grad_norm
    monkeypatch.setattr(utils, "scale_grads_and_clip_grad_norm",
                        lambda max_norm, parts, **kw: scale(max_norm, parts, **{**kw, "moe_mesh": None}))
    (record,) = _rows()
    assert record["verdict"] == "fail", record
    assert "step 1 (uninterrupted): grad model.layers.0.mlp.experts" in record["diagnosis"], record["diagnosis"]
    assert "vs one process" in record["diagnosis"] and "summed instead of averaged" in record["diagnosis"], record


@runs_its_parallelizer
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_no_false_alarms_over_seeds(world_size, seed):
    records = _rows(f"*/w{world_size}/resume*", world_size, seed)
    assert len(records) == (3 if world_size == 2 else 4) and {r["verdict"] for r in records} == {"pass"}, records


@pytest.mark.slow
@pytest.mark.parametrize("variant,world_size,fault,code,words", [
    ("resume", 2, None, 0, "every expert slot of every rank and the routing bias restored bit for bit"),
    ("resume-ep2-to-ep4", 4, None, 0, "ep_size 2 -> 4"),
    ("resume", 2, "repro_faults:automodel-experts-swapped-in-checkpoint", 1,
     "permutation: rank 0, local slot 0 holds global expert 1's weights"),
])
@runs_its_parallelizer
def test_the_standalone_script_reproduces_the_row(tmp_path, variant, world_size, fault, code, words):
    """`--repro`'s script for a resume row (torch, transformers and nemo_automodel only), run from elsewhere with
    moebench off its path: the pinned release restores every slot (exit 0), also from EP 2 to EP 4; a checkpoint with
    two experts swapped (the fault injected into the script's own processes) is named as the tool names it (exit 1),
    and no rank survives it."""
    import ast
    import sys

    from test_repro import STANDALONE_MODULES, _imports, _survivors, run_script

    from moebench.libraries.automodel import ADAPTER

    key = f"automodel/deepseek_v3/torch_mm/apply_ep+fsdp/w{world_size}/{variant}"
    (row,) = [r for r in ADAPTER.rows(world_size, resume=True) if r.key() == key]
    source = ADAPTER.repro_script(row, seed=0)
    foreign = {m for m in _imports(source) if m not in sys.stdlib_module_names} - STANDALONE_MODULES
    assert foreign == {"nemo_automodel"}, foreign
    ast.parse(source)
    script = tmp_path / "repro.py"
    script.write_text(source)
    done, tag = run_script(script, tmp_path, fault=fault)
    assert done.returncode == code and words in done.stdout, (done.returncode, done.stdout[-2000:],
                                                              done.stderr[-2000:])
    assert _survivors(tag) == []



def test_the_rows_skip_with_the_reason_where_automodels_fsdp_patch_cannot_run(monkeypatch):
    """On a torch without FSDPParam.to_accumulated_grad_if_needed (2.15), Automodel 0.7.0's parallelizer raises in
    its own FSDP patch: the rows that parallelize through it (resume, a recipe's) skip saying so, never fail; the
    rows that call apply_ep alone still run. Where the method exists, nothing skips for it."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    from moebench.libraries.automodel import ADAPTER, compat

    rows = ADAPTER.rows(2, resume=True)
    resume = next(r for r in rows if r.kind == "resume")
    parity = next(r for r in rows if r.kind == "parity")
    monkeypatch.delattr(FSDPParam, "to_accumulated_grad_if_needed", raising=False)
    why = ADAPTER.skip_reason(resume)
    assert why and "does not run on torch" in why and compat.FSDP_PATCHED in why, why
    assert ADAPTER.skip_reason(parity) is None or compat.FSDP_PATCHED not in ADAPTER.skip_reason(parity)
    monkeypatch.setattr(FSDPParam, "to_accumulated_grad_if_needed", lambda self: None, raising=False)
    assert ADAPTER.skip_reason(resume) is None

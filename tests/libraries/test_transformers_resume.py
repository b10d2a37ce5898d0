"""transformers resume rows (save_pretrained / save_optimizer_distributed under EP, from_pretrained at the same and
another layout, continued): right when right, and each injected restore bug - made by wrapping transformers' own
loading functions in this process (the ranks fork from it), never by editing its files - named with its experts."""

from __future__ import annotations

import importlib.util

import pytest

from moebench.libraries.transformers import ADAPTER, NUM_EXPERTS
from moebench.libraries.transformers.resume import ONE_PROCESS, RESUME_ROWS, TRAINER_ROWS, resume_rows
from moebench.parity import restore

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install 'moebench[transformers]')")

SWAPPED = (1, 6)
"""Two experts on different ranks at W = 2 (4 a rank) and at W = 4 (2 a rank)."""


def test_resume_rows_only_with_resume_and_their_json_fields():
    plain = ADAPTER.rows(2)
    assert not [r for r in plain if "resume" in r.features]
    rows = [r for r in ADAPTER.rows(2, resume=True) if "resume" in r.features]
    assert rows == resume_rows(2) and len(rows) == len(RESUME_ROWS) + len(TRAINER_ROWS)
    assert len({r.key() for r in ADAPTER.rows(2, resume=True)}) == len(plain) + len(rows)
    same, other = rows[0], rows[1]
    assert same.key() == "transformers/mixtral/grouped_mm/all_to_all/w2/resume"
    assert other.key() == "transformers/mixtral/grouped_mm/all_to_all/w2/resume-to-all_reduce"
    assert same.settings.fields() == {"ep_size": 2, "save_steps": 2, "continue_steps": 2,
                                      "load_optimizer_states": True, "distributed_checkpoint": False,
                                      "optimizer_checkpoint": "save_optimizer_distributed"}
    assert rows[-1].settings.optimizer_checkpoint == "Trainer" and rows[-1].variant == "resume-trainer"
    assert other.settings.load_ep_mode == "all_reduce" and other.settings.load_ep_size == 2
    assert rows[3].settings.load_ep_mode == ONE_PROCESS and rows[3].settings.load_ep_size == 1


def _rows(world_size: int, which=None):
    from libraries.hf_launch import run_rows

    rows = resume_rows(world_size)
    return run_rows(rows if which is None else [rows[i] for i in which], world_size)


def _restore_diagnosis(result) -> dict:
    """The row's restore diagnosis: the every-rank assertion fails on every rank with it."""
    from moebench.libraries.resume import EVERY_RANK

    heads = [c for c in result.comparisons if c.name == EVERY_RANK]
    assert heads and all(not c.passed for c in heads), result.describe()
    assert len({c.diagnosis["sentence"] for c in heads}) == 1
    return heads[0].diagnosis


def _is_file_slice(source) -> bool:
    """A tensor read from a checkpoint file (safetensors slice), not the state dict the model was built from."""
    import torch

    return not isinstance(source, torch.Tensor)


def _runner(world_size: int, seed: int = 0) -> dict:
    """The resume rows through the library runner (one launch each, as `verify-parity --library transformers
    --resume` runs them): the summary, with its JSON "rows"."""
    from helpers import library_checks

    from moebench.libraries import matrix
    from moebench.libraries.records import with_rows
    from moebench.parity.runner import ParityConfig, run_checks

    checks = [c for c in library_checks(["transformers"], (world_size,), resume=True) if "/resume" in c.name]
    with matrix.registered(checks):
        summary = run_checks(ParityConfig(world_size=world_size, checks=tuple(c.name for c in checks), seed=seed,
                                          timeout_s=120.0))
    return with_rows(summary)


@pytest.mark.multirank
def test_every_resume_row_passes_at_world_2_bit_for_bit_at_the_same_layout():
    summary = _runner(2)
    rows = summary["rows"]
    assert [r["check"].rsplit("/", 1)[1] for r in rows] == ["resume", "resume-to-all_reduce", "resume",
                                                             "resume-to-ep1", "resume-dcp-to-all_to_all+tp",
                                                             "resume-trainer"]
    assert rows[-2]["distributed_checkpoint"] is True
    trainer = rows.pop()  # a finding on 5.23.0: test_trainer_optimizer_checkpoint_restores_rank_0s_experts
    assert trainer["verdict"] == "fail" and trainer["diagnosis_name"] == restore.PERMUTATION
    for row, record in zip(rows, summary["checks"]):
        assert row["verdict"] == "pass" and row["diagnosis"] is None, record["reason"]
        assert row["features"] == ["resume"] and row["ep_size"] == 2 and row["version"] == ADAPTER.version()
        assert record["vacuous"] == 0
        names = {c["name"] for c in record["comparisons"]}
        for e in range(NUM_EXPERTS):  # every global expert, every quantity, under transformers' own names
            for q in (restore.WEIGHTS, restore.EXP_AVG, restore.EXP_AVG_SQ):
                assert f"restored experts.gate_up_proj[expert {e}] {q}" in names
        assert "restored gate.weight exp_avg_sq" in names and "restored experts.down_proj step" in names
        assert {"loss at step 3 (resumed vs uninterrupted)", "loss at step 4 (resumed vs uninterrupted)"} <= names
        continued = [c for c in record["comparisons"] if c["max_abs_diff"] is not None]
        if "load_ep_mode" not in row:  # same layout: every continued comparison exact
            assert continued and all(c["max_abs_diff"] == 0.0 and c["rtol"] == 0.0 for c in continued)
        else:
            assert row["load_ep_size"] == (1 if row["load_ep_mode"] == ONE_PROCESS else 2)
            assert continued and all(c["rtol"] > 0 for c in continued)


@pytest.mark.multirank
def test_every_resume_row_passes_at_world_4():
    from libraries.hf_launch import run_rows

    for result in run_rows(_library_paths(resume_rows(4)), 4):
        assert result.skipped is None and result.passed, result.describe()


def _library_paths(rows):
    """The rows whose optimizer goes through transformers.distributed's own functions (the Trainer's path is a
    finding on 5.23.0)."""
    return [r for r in rows if r.settings.optimizer_checkpoint != "Trainer"]


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_trainer_optimizer_checkpoint_restores_rank_0s_experts(world_size):
    """FINDING (transformers 5.23.0): the Trainer's checkpoint code saves `optimizer.state_dict()` on rank 0 alone
    (`args.should_save`) and every rank loads that file, so under expert parallelism every rank gets rank 0's
    experts' Adam moments (DTensor local shards), while the weights (save_pretrained) are right: the first resumed
    loss is exact and the damage starts at the next step. Upstream: huggingface/transformers#48569 (open: "the
    optimizer comes back with the wrong state without a word", under tensor parallelism; the same mechanism)."""
    from libraries.hf_launch import run_rows

    (result,) = run_rows([r for r in resume_rows(world_size) if r.variant == "resume-trainer"], world_size)
    d = _restore_diagnosis(result)
    per_rank = NUM_EXPERTS // world_size
    assert d["name"] == restore.PERMUTATION and d["details"]["weights_right"], d
    assert d["details"]["experts"] == list(range(per_rank, NUM_EXPERTS))
    assert {f["quantity"] for f in d["details"]["findings"]} == {restore.EXP_AVG, restore.EXP_AVG_SQ}
    assert (f"rank 1, local slot 0 holds global expert 0's exp_avg and exp_avg_sq; it should hold expert {per_rank}"
            in d["sentence"])
    losses = {c.name: c for c in result.comparisons if c.name.startswith("loss at step")}
    assert losses["loss at step 3 (resumed vs uninterrupted)"].max_abs_diff == 0.0
    assert not losses["loss at step 4 (resumed vs uninterrupted)"].passed


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_one_ranks_experts_loaded_under_every_ranks_name(monkeypatch, world_size):
    """Every rank reads rank 0's slice of the stacked experts (the EP offset of the load lost): rank 1's slots hold
    experts 0-3. Real instances of the class: KempnerForge#202 (an EP checkpoint gave every rank the same
    experts), deepspeedai/DeepSpeed#6589 ("both GPUs load the first 30 experts")."""
    from transformers.distributed.sharding_utils import DtensorShardOperation

    original = DtensorShardOperation.shard_tensor

    def rank0_slice(self, source, tensor_idx=None, device=None, dtype=None):
        if _is_file_slice(source) and tensor_idx is None and self.param_ndim == 3 and \
                self._axis0_local_size < self._axis0_size:
            return source[0:self._axis0_local_size].to(device=device, dtype=dtype)
        return original(self, source, tensor_idx=tensor_idx, device=device, dtype=dtype)

    monkeypatch.setattr(DtensorShardOperation, "shard_tensor", rank0_slice)
    (result,) = _rows(world_size, which=[0])
    assert not result.passed
    d = _restore_diagnosis(result)
    per_rank = NUM_EXPERTS // world_size
    assert d["name"] == restore.PERMUTATION and d["details"]["experts"] == list(range(per_rank, NUM_EXPERTS)), d
    last = world_size - 1
    assert (f"rank {last}, local slot 1 holds global expert 1's weights; it should hold expert {last * per_rank + 1}"
            in d["sentence"])
    assert not d["details"]["weights_right"]
    # the optimizer state (DCP, keyed by name) came back right: only the weights of the other ranks' slots are wrong
    wrong = {(f["rank"], f["quantity"]) for f in d["details"]["findings"]}
    assert wrong == {(r, restore.WEIGHTS) for r in range(1, world_size)}


@pytest.mark.multirank
def test_experts_skipped_on_load_are_not_restored(monkeypatch):
    """The loader drops the experts' keys: transformers reports them missing and leaves its own initialisation.
    Real instance of the class: pith-train#89 (expert weights never localised when resharding), NeMo
    Automodel#2595 (expert keys under EP)."""
    import transformers.modeling_utils as modeling_utils

    original = modeling_utils.convert_and_load_state_dict_in_model

    def without_experts(model, state_dict, *args, **kwargs):
        if any(_is_file_slice(v) for v in state_dict.values()):
            state_dict = {k: v for k, v in state_dict.items() if ".experts." not in k}
        return original(model, state_dict, *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "convert_and_load_state_dict_in_model", without_experts)
    (result,) = _rows(2, which=[2])
    d = _restore_diagnosis(result)
    assert d["name"] == restore.NOT_RESTORED and d["details"]["experts"] == list(range(NUM_EXPERTS)), d
    assert d["sentence"].startswith("experts 0, 1, 2, 3, 4, 5 and 2 more: weights still the fresh initialisation")
    assert "shared_expert" not in d["sentence"]  # the shared expert is not under .experts.: restored


@pytest.mark.multirank
def test_two_experts_swapped_on_load(monkeypatch):
    """Two rows of the stacked experts swapped as they are read (a wrong index map). Each slot is named with the
    expert it holds."""
    import torch
    from transformers.distributed.sharding_utils import DtensorShardOperation

    original = DtensorShardOperation.shard_tensor
    a, b = SWAPPED

    def swapped(self, source, tensor_idx=None, device=None, dtype=None):
        if _is_file_slice(source) and tensor_idx is None and list(source.get_shape())[:1] == [NUM_EXPERTS] and \
                self.param_ndim == 3:
            order = list(range(NUM_EXPERTS))
            order[a], order[b] = b, a
            source = source[...][torch.tensor(order)]
        return original(self, source, tensor_idx=tensor_idx, device=device, dtype=dtype)

    monkeypatch.setattr(DtensorShardOperation, "shard_tensor", swapped)
    (result,) = _rows(2, which=[0])
    d = _restore_diagnosis(result)
    assert d["name"] == restore.PERMUTATION and d["details"]["experts"] == [a, b], d
    assert f"rank 0, local slot 1 holds global expert {b}'s weights; it should hold expert {a}" in d["sentence"]
    assert f"rank 1, local slot 2 holds global expert {a}'s weights; it should hold expert {b}" in d["sentence"]


@pytest.mark.multirank
def test_adam_state_of_two_slots_exchanged_is_a_permutation_with_weights_right(monkeypatch):
    """The optimizer state of each rank's first two experts exchanged as it is put back (a split restore: the
    weights, and so the first resumed loss, are right; the damage starts at the next step)."""
    from transformers.distributed import checkpoint

    original = checkpoint._redistribute_state_dict

    def exchanged(state_dict, reference_state_dict=None):
        out = original(state_dict, reference_state_dict)
        if reference_state_dict is not None:  # the state read back, in the model's placements
            for key, value in out.items():
                if ".experts.gate_up_proj.exp_avg" in key:
                    local = value.to_local() if hasattr(value, "to_local") else value
                    local[[0, 1]] = local[[1, 0]].clone()
        return out

    monkeypatch.setattr(checkpoint, "_redistribute_state_dict", exchanged)
    (result,) = _rows(2, which=[0])
    d = _restore_diagnosis(result)
    assert d["name"] == restore.PERMUTATION and d["details"]["weights_right"], d
    assert d["details"]["experts"] == [0, 1, 4, 5]
    assert "rank 1, local slot 0 holds global expert 5's exp_avg and exp_avg_sq; it should hold expert 4" \
        in d["sentence"]
    assert "damage starts at the next optimizer step" in d["sentence"]
    losses = {c.name: c for c in result.comparisons if c.name.startswith("loss at step")}
    # the first resumed loss is computed with the restored weights: exact; the next one after a wrong Adam step
    assert losses["loss at step 3 (resumed vs uninterrupted)"].max_abs_diff == 0.0
    assert not losses["loss at step 4 (resumed vs uninterrupted)"].passed


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("world_size", [2, 4])
def test_no_false_alarms_over_five_seeds(world_size, seed):
    from libraries.hf_launch import run_rows

    for result in run_rows(_library_paths(resume_rows(world_size)), world_size, seed=seed):
        assert result.skipped is None and result.passed, result.describe()

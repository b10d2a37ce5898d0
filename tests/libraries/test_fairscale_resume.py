"""fairscale resume row: MOELayer (+ Top2Gate) state dicts saved per rank under expert parallelism, loaded into a
layer built from another seed, continued - right when right, and each injected load bug (fairscale's own
MOELayer.load_state_dict wrapped in this process; the ranks fork from it) named with its global experts."""

from __future__ import annotations

import pytest

pytest.importorskip("fairscale", reason="fairscale is not installed: pip install 'moebench[fairscale]'")

import torch.distributed as dist  # noqa: E402
from fairscale.nn.moe import moe_layer  # noqa: E402
from helpers import library_checks  # noqa: E402

from moebench.libraries import matrix  # noqa: E402
from moebench.libraries.fairscale import ADAPTER  # noqa: E402
from moebench.libraries.records import rows_of  # noqa: E402
from moebench.libraries.resume import EVERY_RANK  # noqa: E402
from moebench.parity import restore  # noqa: E402
from moebench.parity.runner import ParityConfig, run_checks  # noqa: E402


def _run(world_size=2, seed=0):
    checks = [c for c in library_checks(["fairscale"], (world_size,), resume=True) if c.name.endswith("/resume")]
    with matrix.registered(checks):
        return run_checks(ParityConfig(world_size=world_size, checks=tuple(c.name for c in checks), seed=seed,
                                       timeout_s=60.0))


def _diagnosis(summary) -> dict:
    (record,) = summary["checks"]
    assert record["status"] == "fail" and record["launch_status"] == "ok", record["reason"]
    heads = [c for c in record["comparisons"] if c["name"] == EVERY_RANK]
    assert len(heads) == record["world_size"] and not any(c["passed"] for c in heads)
    assert record["diagnosis"]["name"] == heads[0]["diagnosis"]["name"]  # the row is named by it, not "partial"
    return heads[0]["diagnosis"]


def test_resume_row_only_with_resume():
    assert [r.variant for r in ADAPTER.rows(2)] == ["", ""]
    (row,) = [r for r in ADAPTER.rows(2, resume=True) if r.variant]
    assert row.key() == "fairscale/top2gate/-/a2a-E=2W/w2/resume" and row.features == ("resume",)


@pytest.mark.multirank
def test_round_trip_passes_bit_for_bit_and_its_json_row():
    summary = _run()
    (row,) = rows_of(summary)
    assert row["verdict"] == "pass" and row["diagnosis"] is None, summary["checks"][0]["reason"]
    assert row["features"] == ["resume"] and row["ep_size"] == 2 and row["load_optimizer_states"] is True
    assert "load_ep_size" not in row  # loaded at the layout it was saved in
    comps = summary["checks"][0]["comparisons"]
    names = {c["name"] for c in comps}
    for e in range(4):
        for q in ("weights", "exp_avg", "exp_avg_sq", "step"):
            assert f"restored experts.fc1.weight[expert {e}] {q}" in names
    assert "restored gate.wg.weight exp_avg" in names and "loss at step 4 (resumed vs uninterrupted)" in names
    numeric = [c for c in comps if c["max_abs_diff"] is not None]
    assert numeric and all(c["max_abs_diff"] == 0.0 for c in numeric) and summary["vacuous_total"] == 0


def _wrap_load(monkeypatch, change):
    original = moe_layer.MOELayer.load_state_dict

    def load_state_dict(self, state_dict, strict=True, **kwargs):
        state_dict, strict = change(dict(state_dict), strict)
        return original(self, state_dict, strict=strict, **kwargs)

    monkeypatch.setattr(moe_layer.MOELayer, "load_state_dict", load_state_dict)


@pytest.mark.multirank
def test_rank_0s_experts_loaded_on_every_rank(monkeypatch):
    """Every rank ends up with rank 0's experts (its file read under every rank's name). Real instance of the class:
    KempnerForge#202, deepspeedai/DeepSpeed#6589."""
    def rank0(state, strict):
        for k in sorted(state):
            if k.startswith("experts."):
                t = state[k].clone()
                dist.broadcast(t, src=0)
                state[k] = t
        return state, strict

    _wrap_load(monkeypatch, rank0)
    summary = _run()
    d = _diagnosis(summary)
    (row,) = rows_of(summary)
    assert row["verdict"] == "fail" and row["diagnosis_name"] == restore.PERMUTATION
    # the restore diagnosis is the row's whole diagnosis: the slots it names, not a count of wrong groups
    assert row["diagnosis"].startswith("permutation: rank 1, local slot 0 holds global expert 0's weights; "
                                       "it should hold expert 2"), row["diagnosis"]
    assert d["name"] == restore.PERMUTATION and d["details"]["experts"] == [2, 3], d
    assert "rank 1, local slot 0 holds global expert 0's weights; it should hold expert 2" in d["sentence"]


@pytest.mark.multirank
def test_experts_skipped_keep_the_fresh_layer(monkeypatch):
    _wrap_load(monkeypatch, lambda state, strict: ({k: v for k, v in state.items() if not k.startswith("experts.")},
                                                   False))
    d = _diagnosis(_run())
    assert d["name"] == restore.NOT_RESTORED and d["details"]["experts"] == [0, 1, 2, 3], d
    assert d["sentence"].startswith("experts 0, 1, 2, 3: weights still the fresh initialisation")


@pytest.mark.multirank
def test_two_local_experts_swapped(monkeypatch):
    def swap(state, strict):
        if dist.get_rank() == 1:
            for k in [k for k in state if k.startswith("experts.0.")]:
                other = "experts.1." + k.split(".", 2)[2]
                state[k], state[other] = state[other], state[k]
        return state, strict

    _wrap_load(monkeypatch, swap)
    d = _diagnosis(_run())
    assert d["name"] == restore.PERMUTATION and d["details"]["experts"] == [2, 3], d
    assert "rank 1, local slot 0 holds global expert 3's weights; it should hold expert 2" in d["sentence"]
    assert "exp_avg" not in d["sentence"]  # the optimizer state went where it belongs


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_no_false_alarm_over_five_seeds(world_size):
    for seed in range(1, 6):
        summary = _run(world_size, seed)
        assert all(c["status"] == "pass" for c in summary["checks"]), (seed, summary["checks"][0]["reason"])

"""The restored-state diagnosis: each way a resume goes wrong is named, with the right global experts."""

import torch

from moebench.parity import restore
from moebench.parity.restore import Slot, diagnose_restore, identify

EXPERTS = 4


def _state(seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {e: torch.randn(3, 2, generator=g) for e in range(EXPERTS)}


def _slots():
    # 2 ranks x 2 local slots: rank r slot j should hold expert 2r + j
    return [Slot(rank=e // 2, local=e % 2, unit=e) for e in range(EXPERTS)]


def _findings(got: dict, want: dict, quantity: str, fresh: dict | None = None):
    return [identify(s, quantity, got[s.unit], want, fresh[s.unit] if fresh else None) for s in _slots()]


def test_everything_restored_is_no_diagnosis():
    want = _state(0)
    findings = _findings({e: t.clone() for e, t in want.items()}, want, restore.WEIGHTS)
    assert all(f.state == restore.RIGHT for f in findings)
    assert diagnose_restore(findings) is None


def test_one_ulp_off_is_not_restored_exactly():
    want = _state(0)
    got = {e: t.clone() for e, t in want.items()}
    got[3] = torch.nextafter(got[3], torch.full_like(got[3], 10.0))
    findings = _findings(got, want, restore.WEIGHTS)
    assert [f.state for f in findings] == [restore.RIGHT] * 3 + [restore.UNKNOWN]
    assert diagnose_restore(findings)["name"] == restore.UNEXPLAINED


def test_swapped_masters_are_a_permutation_naming_both_experts_and_a_split_restore():
    weights, masters = _state(0), _state(1)
    got = dict(masters)
    got[1], got[2] = masters[2], masters[1]  # slot of expert 1 (rank 0 slot 1) holds expert 2's master
    findings = _findings(weights, weights, restore.WEIGHTS) + _findings(got, masters, restore.FP32_MASTER)
    d = diagnose_restore(findings)
    assert d["name"] == restore.PERMUTATION
    assert "rank 0, local slot 1 holds global expert 2's fp32 master; it should hold expert 1" in d["sentence"]
    assert "rank 1, local slot 0 holds global expert 1's fp32 master; it should hold expert 2" in d["sentence"]
    assert "damage starts at the next optimizer step" in d["sentence"]
    assert d["details"]["experts"] == [1, 2] and d["details"]["weights_right"]


def test_one_ranks_experts_under_every_name_is_a_permutation_to_rank_0s():
    want = _state(0)
    got = {e: want[e % 2] for e in range(EXPERTS)}  # rank 1 loaded rank 0's file
    d = diagnose_restore(_findings(got, want, restore.WEIGHTS))
    assert d["name"] == restore.PERMUTATION and d["details"]["experts"] == [2, 3]
    assert "rank 1, local slot 0 holds global expert 0's weights; it should hold expert 2" in d["sentence"]
    assert "damage starts" not in d["sentence"]  # the weights themselves are wrong


def test_skipped_experts_are_not_restored():
    want, fresh = _state(0), _state(7)
    got = dict(want)
    got[0], got[3] = fresh[0], fresh[3]
    d = diagnose_restore(_findings(got, want, restore.WEIGHTS, fresh))
    assert d["name"] == restore.NOT_RESTORED
    assert d["sentence"].startswith("experts 0, 3: weights still the fresh initialisation")


def test_adam_state_wrong_like_nothing_with_weights_right_is_a_split_restore():
    weights, moments = _state(0), _state(1)
    got = {e: t * 2 for e, t in moments.items()}
    findings = _findings(weights, weights, restore.WEIGHTS) + _findings(got, moments, restore.EXP_AVG)
    d = diagnose_restore(findings)
    assert d["name"] == restore.SPLIT_RESTORE
    assert "experts 0, 1, 2, 3: exp_avg wrong" in d["sentence"]


def test_as_comparison_fails_with_the_rows_diagnosis():
    want = _state(0)
    got = {e: want[(e + 1) % EXPERTS] for e in range(EXPERTS)}
    findings = _findings(got, want, restore.EXP_AVG_SQ)
    d = diagnose_restore(findings)
    c = restore.as_comparison(findings[0], "expert 0 exp_avg_sq after the load", diagnosis=d)
    assert not c.passed and c.diagnosis["name"] == restore.PERMUTATION and "holds 1's exp_avg_sq" in c.note


def test_a_wrong_slot_as_a_comparison_is_described_by_the_runner():
    """A failed restore comparison has no magnitude / relative difference: the runner's failure line must
    still describe it (by its note), not crash formatting the missing numbers."""
    from moebench.parity.runner import _describe_failure

    want = _state(0)
    finding = identify(_slots()[2], restore.WEIGHTS, want[0], want)
    d = diagnose_restore([finding])
    c = restore.as_comparison(finding, "restored experts.w[expert 2] weights", diagnosis=d)
    assert not c.passed and c.diagnosis["name"] == restore.PERMUTATION
    line = _describe_failure(c)
    assert line.startswith("rank 1: restored experts.w[expert 2] weights: holds 0's weights (max |diff| ")
    assert "diagnosis: permutation: rank 1, local slot 0 holds global expert 0's weights" in line

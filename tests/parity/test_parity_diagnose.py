"""Diagnoses: each bug class named from the numbers, on plain tensors and through real checks."""

from __future__ import annotations

import pytest
import torch

from moebench.parity.compare import STRICT, Comparison, compare
from moebench.parity.diagnose import SCALE_INTEGER_RTOL, diagnose, group_of, integer_scale, summarise
from moebench.parity.runner import ParityConfig, run_checks


def _e(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _diag(actual, expected, **kw):
    c = compare("x", actual, expected, STRICT, **kw)
    assert not c.passed
    return c.diagnosis


# ------------------------------------------------------------------ plain tensors


def test_a_passing_comparison_has_no_diagnosis():
    e = _e(4, 5)
    assert compare("x", e.clone(), e, STRICT).diagnosis is None


@pytest.mark.parametrize("n", [2, 4, 9])
def test_uniform_scale_summed_instead_of_averaged(n):
    e = _e(6, 3)
    d = _diag(e * n, e, world_size=n)
    assert d["name"] == "uniform-scale" and d["details"]["integer"] == n
    assert abs(d["details"]["scale"] - n) < 1e-6
    assert f"summed instead of averaged over {n} ranks (the world size)" in d["sentence"]


def test_uniform_scale_averaged_twice_and_a_non_integer_scale():
    e = _e(6, 3)
    d = _diag(e / 4, e)
    assert d["name"] == "uniform-scale" and d["details"]["integer"] == 4 and "averaged twice" in d["sentence"]
    d = _diag(e * 1.37, e)
    assert d["name"] == "uniform-scale" and d["details"]["integer"] is None and "ranks" not in d["sentence"]


def test_integer_scale_tolerance():
    assert integer_scale(3.0 * (1 + SCALE_INTEGER_RTOL / 2))[0] == 3
    assert integer_scale(3.0 * (1 + 3 * SCALE_INTEGER_RTOL))[0] is None
    assert integer_scale(1.0)[0] is None


def test_zero():
    e = _e(3, 4)
    d = _diag(torch.zeros_like(e), e)
    assert d["name"] == "zero"


def test_non_finite_names_the_first_index():
    e = _e(3, 4)
    a = e.clone()
    a[1, 2] = float("nan")
    a[2, 0] = float("inf")
    d = _diag(a, e)
    assert d["name"] == "non-finite" and d["details"]["first_index"] == [1, 2] and d["details"]["count"] == 2


def test_rows_permuted_reports_the_permutation():
    e = _e(5, 3)
    perm = [4, 3, 2, 1, 0]
    d = _diag(e[perm], e)
    assert d["name"] == "rows-permuted" and d["details"]["permutation"] == perm
    # along dim 1 too
    d = _diag(e[:, [1, 0, 2]], e)
    assert d["name"] == "rows-permuted" and d["details"]["dim"] == 1 and d["details"]["permutation"] == [1, 0, 2]


def test_partial_names_the_rows():
    e = _e(6, 4)
    a = e.clone()
    a[2] += 1.0
    a[5, 1] -= 0.5
    d = _diag(a, e)
    assert d["name"] == "partial" and d["details"]["indices"] == [2, 5] and "rows 2, 5 of 6" in d["sentence"]


def test_alternative_local_slice_is_named():
    e = _e(4, 3)
    local = _e(4, 3, seed=1)
    d = _diag(local.clone(), e, alternatives={"local slice": (local, "a local-slice backward")})
    assert d["name"] == "local-slice" and "local-slice backward" in d["sentence"]


def test_unexplained_keeps_statistics():
    e = _e(5, 5)
    d = _diag(_e(5, 5, seed=7), e)
    assert d["name"] == "unexplained"
    for key in ("outside", "max_abs_diff", "correlation", "best_scale", "norm_ratio"):
        assert key in d["details"]


def test_shape_mismatch():
    c = compare("x", torch.zeros(2), torch.zeros(3), STRICT)
    assert c.diagnosis["name"] == "shape"


def test_noise_at_the_tolerance_edge_is_never_a_scale():
    e = _e(50, 4)
    a = e + 1e-3 * _e(50, 4, seed=3)  # fails strict, but no single scale explains it
    assert _diag(a, e)["name"] in ("unexplained", "partial")


def test_groups():
    assert group_of("step 1: gate.weight grad") == "gate/router"
    assert group_of("step 1: experts.0.htoh4.weight grad (global experts.2.htoh4.weight)") == "experts"
    assert group_of("step 1: rank 2 input grad") == "input gradient"
    assert group_of("step 1: output") == "output"
    assert group_of("DDP(Net): fc1.weight after step 1") == "replicated"


def _c(name, passed, rank, diagnosis=None):
    return Comparison(name=name, passed=passed, rank=rank, diagnosis=diagnosis)


def test_summary_outputs_right_gate_wrong():
    scale = {"name": "uniform-scale", "sentence": "", "details": {"integer": 2}}
    comps = [_c("output", True, r) for r in range(2)] + [_c("gate.weight grad", False, r, scale) for r in range(2)]
    s = summarise(comps, 2)
    assert s["name"] == "uniform-scale" and s["details"]["right"] == ["output"]
    assert s["details"]["wrong"] == ["gate/router"]
    assert "output right" in s["sentence"] and "gate/router wrong (2/2)" in s["sentence"]
    assert "(the world size)" in s["sentence"]
    assert summarise([_c("output", True, 0)], 1) is None


def test_summary_names_the_only_failing_rank():
    comps = [_c("experts.0 grad", r != 2, r, None if r != 2 else {"name": "unexplained", "sentence": "",
                                                                     "details": {}}) for r in range(4)]
    s = summarise(comps, 4)
    assert s["name"] == "partial" and s["details"]["ranks_failed"] == [2] and "only on rank 2 of 4" in s["sentence"]


# ------------------------------------------------------------------ through real checks (3 gloo ranks)


def _record(check, key, impl):
    summary = run_checks(ParityConfig(world_size=3, checks=(check,), impls={key: f"parity_broken:{impl}"},
                                      timeout_s=30.0))
    record = summary["checks"][0]
    assert record["status"] == "fail", f"{check} passed a broken {impl}"
    failed = [c for c in record["comparisons"] if c["asserted"] and not c["passed"]]
    assert failed and all(c["diagnosis"] for c in failed if c["max_abs_diff"] is not None)
    return record, failed


@pytest.mark.multirank
def test_summed_not_averaged_is_a_scale_of_the_world_size():
    record, failed = _record("moe-expert-parallel", "moe-sync", "unscaled_expert_sync")
    grads = [c for c in failed if c["name"].startswith("step 1") and "grad" in c["name"]]
    assert grads and all(c["diagnosis"]["name"] == "uniform-scale" and c["diagnosis"]["details"]["integer"] == 3
                         for c in grads)
    assert "summed instead of averaged over 3 ranks (the world size)" in grads[0]["diagnosis"]["sentence"]
    d = record["diagnosis"]
    assert d["name"] == "uniform-scale" and d["details"]["wrong"] == ["experts"]
    assert {"output", "input gradient", "gate/router"} <= set(d["details"]["right"])


@pytest.mark.multirank
def test_averaged_twice():
    _, failed = _record("moe-expert-parallel", "moe-sync", "averaged_twice_sync")
    first = next(c for c in failed if c["name"].startswith("step 1") and "grad" in c["name"])
    assert first["diagnosis"]["details"]["integer"] == 3 and "averaged twice" in first["diagnosis"]["sentence"]


@pytest.mark.multirank
def test_detached_is_zero():
    record, failed = _record("all-gather-variable", "all-gather", "detached_all_gather")
    assert all(c["diagnosis"]["name"] == "zero" for c in failed)
    assert record["diagnosis"]["name"] == "zero" and record["diagnosis"]["details"]["right"] == ["output"]


@pytest.mark.multirank
def test_local_slice_all_gather_backward():
    record, failed = _record("all-gather-variable", "all-gather", "local_slice_all_gather")
    assert all(c["diagnosis"]["name"] == "local-slice" for c in failed)
    assert record["diagnosis"]["name"] == "local-slice"


@pytest.mark.multirank
def test_reversed_rank_order_is_permuted():
    record, failed = _record("all-gather-variable", "all-gather", "reversed_order_all_gather")
    first = failed[0]
    assert first["name"] == "variable sizes, dim 0: gathered rows in rank order"
    # ranks hold 1, 3, 5 rows: reversed blocks are rank 2's rows 4-8, rank 1's 1-3, rank 0's 0
    assert first["diagnosis"]["details"]["permutation"] == [4, 5, 6, 7, 8, 1, 2, 3, 0]
    assert record["diagnosis"]["name"] == "rows-permuted"


@pytest.mark.multirank
def test_a_bug_on_one_rank_is_partial_and_named():
    record, failed = _record("moe-expert-parallel", "moe-sync", "one_rank_summed_sync")
    assert {c["rank"] for c in failed} == {1}
    d = record["diagnosis"]
    assert d["name"] == "partial" and d["details"]["ranks_failed"] == [1] and "only on rank 1 of 3" in d["sentence"]


@pytest.mark.multirank
def test_nan_is_non_finite_with_its_index():
    record, failed = _record("all-gather-variable", "all-gather", "nan_all_gather")
    assert failed[0]["diagnosis"]["name"] == "non-finite"
    assert failed[0]["diagnosis"]["details"]["first_index"] == [0, 0, 0]
    assert record["diagnosis"]["name"] == "non-finite"


@pytest.mark.multirank
def test_correct_implementations_have_no_diagnosis():
    summary = run_checks(ParityConfig(world_size=3, checks=("all-gather-variable", "moe-expert-parallel"),
                                      timeout_s=30.0))
    for record in summary["checks"]:
        assert record["status"] == "pass" and record["diagnosis"] is None
        assert all(c["diagnosis"] is None for c in record["comparisons"])


def test_a_failed_non_numeric_assertion_names_itself_and_its_group():
    comps = [Comparison(name="dim 0: gathered values", passed=True, rank=0),
             Comparison(name="dim 0: gathered tensor is differentiable", passed=False, rank=0,
                        note="no grad_fn: the all-gather has no autograd backward")]
    s = summarise(comps, 2)
    assert s["name"] == "failed-assertion"
    assert "input gradient wrong (1/1)" in s["sentence"] and "no grad_fn" in s["sentence"]


def test_partial_along_a_later_dim_reads_as_english():
    e = torch.arange(1.0, 17.0).reshape(2, 8)
    a = e.clone()
    a[:, 3] *= -1
    d = diagnose(a, e, atol=1e-6, rtol=1e-5)
    assert d["name"] == "partial" and d["sentence"].startswith("only slice 3 along dim 1 of 8 differ")


# ------------------------------------------------------------------ rank-local / missing backward exchange


def test_rank_local_matches_its_alternative_and_up_to_an_integer_scale():
    from moebench.parity.diagnose import RANK_LOCAL, rank_local

    e, alone = _e(5, 4), _e(5, 4, seed=1)
    d = _diag(alone, e, alternatives={"rank-local": rank_local(alone)})
    assert d["name"] == RANK_LOCAL and "never all-reduced" in d["sentence"]
    d = _diag(alone / 4, e, alternatives={"rank-local": rank_local(alone)}, world_size=4)
    assert d["name"] == RANK_LOCAL and abs(d["details"]["scale"] - 0.25) < 1e-9 and "(the world size)" in d["sentence"]
    d = _diag(alone * 1.3, e, alternatives={"rank-local": rank_local(alone)})  # no integer scale: not this class
    assert d["name"] != RANK_LOCAL


def test_missing_backward_exchange_names_both_forms():
    from moebench.parity.diagnose import MISSING_BACKWARD_EXCHANGE, no_backward_exchange

    e, gate_only, local = _e(6, 3), _e(6, 3, seed=1), _e(6, 3, seed=2)
    alts = no_backward_exchange(gate_only, local)
    assert _diag(gate_only, e, alternatives=alts)["name"] == MISSING_BACKWARD_EXCHANGE
    d = _diag(local, e, alternatives=alts)
    assert d["name"] == MISSING_BACKWARD_EXCHANGE and "only this rank's own slots" in d["sentence"]


@pytest.mark.multirank
def test_router_gradient_never_all_reduced_is_rank_local():
    record, failed = _record("moe-expert-parallel", "moe-sync", "gate_rank_local_sync")
    grads = [c for c in failed if "grad" in c["name"]]
    assert grads and all(c["diagnosis"]["name"] == "rank-local" and c["name"].split(": ")[1].startswith("gate.")
                         for c in grads)
    d = record["diagnosis"]
    assert d["name"] == "rank-local" and d["details"]["wrong"] == ["gate/router"]
    assert {"output", "input gradient", "experts"} <= set(d["details"]["right"])


@pytest.mark.multirank
@pytest.mark.parametrize("impl", ["NoBackwardExchangeMoE", "LocalOnlyBackwardMoE"])
def test_all_to_all_without_backward_exchange_is_named(impl):
    record, failed = _record("moe-expert-parallel", "moe", impl)
    inputs = [c for c in failed if c["name"].endswith("input grad")]
    assert inputs and all(c["diagnosis"]["name"] == "missing-backward-exchange" for c in inputs)
    d = record["diagnosis"]
    assert d["name"] == "missing-backward-exchange" and "input gradient" in d["details"]["wrong"]
    assert {"output", "gate/router"} <= set(d["details"]["right"])


@pytest.mark.multirank
def test_router_gradient_from_slots_never_routed_is_named():
    """A router gradient with contributions from slots the rank never routed: the slots whose expert lives on
    another rank run through this rank's last local expert with a score that is zero in the forward only, so
    the gate collects <output grad, that expert's output> for them. The mechanism of
    huggingface/transformers#48687 (batched_mm experts under expert parallelism: "the sentinel slots keep a
    non-zero expert output, and the zero routing weight hides that in the forward but not in the backward",
    fixed by huggingface/transformers#48689)."""
    from moebench.parity.diagnose import UNROUTED_SLOTS

    record, failed = _record("moe-expert-parallel", "moe", "UnroutedSlotsRouterGradMoE")
    gates = [c for c in failed if c["name"].split(": ")[1].startswith("gate.") and "grad" in c["name"]]
    assert gates and all(c["diagnosis"]["name"] == UNROUTED_SLOTS for c in gates), failed
    assert not [c for c in failed if c["name"].split(": ")[1].startswith("experts.") and "grad" in c["name"]]
    d = record["diagnosis"]
    assert d["name"] == UNROUTED_SLOTS and "gate/router" in d["details"]["wrong"], d
    assert "output" in d["details"]["right"]


def test_a_named_first_divergence_headlines_and_later_failures_are_its_consequences():
    """A check that knows its causal order (the DeepSpeed engine rows) marks its first divergence; the
    check's diagnosis is that mechanism, and the later failures are counted as consequences, not causes."""
    from moebench.parity.diagnose import FIRST_DIVERGENCE

    first = Comparison(name="first divergence: step 1, experts", passed=False, rank=0, kind="equal",
                       diagnosis={"name": "expert-grad-scale", "sentence": "expert gradients scaled by 2",
                                  "details": {FIRST_DIVERGENCE: True, "step": 1}})
    e = torch.ones(4)
    later = [compare("step 1: expert 0.weight update", 2 * e, e, STRICT, rank=0),
             compare("step 2: loss", e + 1, e, STRICT, rank=0),
             compare("step 2: inp.weight after the step", e + 1, e, STRICT, rank=1)]
    d = summarise([first, *later], world_size=2, first=first)
    assert d["name"] == "expert-grad-scale"
    assert d["sentence"] == ("expert gradients scaled by 2; 3 other failed comparison(s) follow from it (output 1, "
                             "experts 1, replicated 1): consequences, not causes")
    assert d["details"]["consequences"] == 3 and d["details"]["step"] == 1

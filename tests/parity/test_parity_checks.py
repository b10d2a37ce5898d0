"""Every verify-parity check passes on the real thing and FAILS on a deliberately broken one.

Runs real gloo ranks (forked by moebench's launcher); the broken implementations live in
tests/parity_broken.py and are passed the way users pass theirs: --impl key=module:attr.
"""

from __future__ import annotations

import pytest

from moebench.parity.registry import all_checks
from moebench.parity.runner import ParityConfig, run_checks

pytestmark = pytest.mark.multirank


def _run(world_size: int, checks: tuple[str, ...], *, impls=None, tolerance="strict", timeout_s=30.0) -> dict:
    return run_checks(ParityConfig(world_size=world_size, checks=checks, impls=impls or {},
                                   tolerance=tolerance, timeout_s=timeout_s))


def _by_name(summary: dict) -> dict:
    return {c["name"]: c for c in summary["checks"]}


OWN_CHECKS = ("ddp-adam", "ddp-sgd", "replicate-state-dict", "replicate-train", "replicate-ignored",
              "replicate-bad-device-id", "all-gather-variable", "experts", "moe-expert-parallel")


@pytest.mark.parametrize("world_size", [4, 9])
def test_every_check_passes_on_the_real_implementations(world_size):
    names = tuple(c.name for c in all_checks() if c.name in OWN_CHECKS)
    summary = _run(world_size, names)
    for name, record in _by_name(summary).items():
        assert record["status"] == "pass", f"{name}: {record['reason']}"
        assert record["vacuous"] == 0, f"{name}: strict mode must not be vacuous"
        assert record["comparisons_total"] > 0


def test_world_size_16_oversubscribed_on_two_cores():
    records = _by_name(_run(16, ("all-gather-variable", "experts", "moe-expert-parallel"), timeout_s=60))
    for name, record in records.items():
        assert record["status"] == "pass", f"{name}: {record['reason']}"


def test_world_size_1_runs_or_skips_with_a_reason():
    records = _by_name(_run(1, OWN_CHECKS))
    assert records["replicate-ignored"]["status"] == "skip" and "world size" in records["replicate-ignored"]["reason"]
    assert all(r["status"] == "pass" for n, r in records.items() if n != "replicate-ignored")


BROKEN = [
    # (check, --impl key, broken implementation, words the failure must contain)
    ("all-gather-variable", "all-gather", "local_slice_all_gather", "input grad"),
    ("all-gather-variable", "all-gather", "reversed_order_all_gather", "rank order"),
    ("all-gather-variable", "all-gather", "nan_all_gather", "NaN"),
    ("all-gather-variable", "all-gather", "no_autograd_all_gather", "differentiable"),
    ("experts", "experts", "OffByOneExperts", "output: differ"),
    ("experts", "experts", "LocalSliceExperts", "input grad"),
    ("experts", "experts", "NoBiasExperts", "output"),
    ("experts", "experts", "LocalOnlyExperts", "computed locally, not sharded"),
    ("ddp-adam", "ddp", "no_sync_ddp", "after 10 Adam steps"),
    ("ddp-adam", "ddp", "dropped_bias_ddp", "after 10 Adam steps"),
    ("ddp-adam", "ddp", "no_broadcast_ddp", "before (rank 0's initial parameters)"),
    ("ddp-sgd", "ddp", "not_averaged_ddp", "step 1"),
    ("ddp-sgd", "ddp", "dropped_bias_ddp", "bias"),
    ("replicate-state-dict", "replicate", "ddp_wrapping_replicate", "keys"),
    ("replicate-state-dict", "replicate", "noop_replicate", "fc1.weight: differ"),
    ("replicate-train", "replicate", "noop_replicate", "whole model"),
    ("replicate-ignored", "replicate", "ignores_nothing_replicate", "fc1.weight grad"),
    ("replicate-bad-device-id", "replicate", "lenient_device_id_replicate", "silently"),
    ("moe-expert-parallel", "moe-sync", "unscaled_expert_sync", "experts.0.htoh4.weight grad"),
    ("moe-expert-parallel", "moe-sync", "no_moe_sync", "grad"),
    ("moe-expert-parallel", "moe", "SwappedLocalExpertsMoE", "output"),
    ("moe-expert-parallel", "moe", "DroppedBiasMoE", "h4toh.bias grad"),
]


@pytest.mark.parametrize("check,key,impl,words", BROKEN, ids=[f"{c}-{i}" for c, _, i, _ in BROKEN])
def test_each_check_fails_on_a_broken_implementation(check, key, impl, words):
    record = _by_name(_run(3, (check,), impls={key: f"parity_broken:{impl}"}))[check]
    assert record["status"] == "fail", f"{check} passed a broken {impl}"
    assert words in record["reason"], record["reason"]


def test_seed_mode_passes_the_local_slice_backward_but_flags_it_vacuous_strict_catches_it():
    """assert.py's setting (9 ranks, 8 experts): its atol=1e-2 cannot see the wrong gradients."""
    impls = {"experts": "parity_broken:LocalSliceExperts"}
    seed = _by_name(_run(9, ("experts",), impls=impls, tolerance="seed"))["experts"]
    assert seed["status"] == "pass" and seed["vacuous"] > 0
    vacuous = [c for c in seed["comparisons"] if c["vacuous"] and c["asserted"]]
    assert vacuous and all("expert 0 0.weight grad" in c["name"] for c in vacuous)
    # What the seed never asserts is vacuous too (in effect an infinite tolerance) and counted so.
    unasserted = [c for c in seed["comparisons"] if not c["asserted"]]
    assert unasserted and all(c["vacuous"] for c in unasserted)
    assert seed["unasserted"] == len(unasserted) and seed["vacuous"] == len(vacuous) + len(unasserted)
    strict = _by_name(_run(9, ("experts",), impls=impls))["experts"]
    assert strict["status"] == "fail" and strict["vacuous"] == 0


def test_seed_mode_passes_the_local_slice_all_gather_only_vacuously():
    """The seed asserts nothing about the backward: seed mode passes it, flagged vacuous."""
    impls = {"all-gather": "parity_broken:local_slice_all_gather"}
    seed = _by_name(_run(3, ("all-gather-variable",), impls=impls, tolerance="seed"))["all-gather-variable"]
    grads = [c for c in seed["comparisons"] if "input grad" in c["name"]]
    assert seed["status"] == "pass" and grads and all(c["vacuous"] and not c["asserted"] for c in grads)
    assert seed["vacuous"] == seed["unasserted"] == len(grads) and seed["unasserted_outside"] > 0
    strict = _by_name(_run(3, ("all-gather-variable",), impls=impls))["all-gather-variable"]
    assert strict["status"] == "fail" and strict["vacuous"] == 0


def test_every_check_passes_with_the_largest_seed():
    from moebench.config import SEED_LIMIT

    summary = run_checks(ParityConfig(world_size=2, seed=SEED_LIMIT - 1, timeout_s=60))
    for name, record in _by_name(summary).items():
        assert record["status"] in ("pass", "skip"), f"{name}: {record['reason']}"


def test_the_idle_rank_must_stay_in_the_backward_graph():
    """An idle rank cut out of the graph skips a backward collective the others wait in: they
    deadlock or (as here, where it runs ahead into the next collective) gloo reports a mismatch.
    Either way the check fails quickly and says which ranks."""
    record = _by_name(_run(3, ("experts",), impls={"experts": "parity_broken:DetachedIdleRankExperts"},
                           timeout_s=4.0))["experts"]
    assert record["status"] == "fail"
    assert record["elapsed_s"] < 4.0 + 5.0 + 3.0
    reason = record["reason"]
    assert "rank 2" in reason, reason  # the idle rank (3 ranks, 2 experts) is named
    assert "collectives.py" in reason, reason  # and the others' tracebacks point at the gather's backward


def test_debug_collectives_reaches_every_rank():
    """Inside each rank torch.distributed itself must run at DETAIL (the probe checks
    dist.get_debug_level(), not the environment variable, which torch reads only at import)."""
    impls = {"all-gather": "parity_broken:debug_env_probe_all_gather"}
    plain = run_checks(ParityConfig(world_size=2, checks=("all-gather-variable",), impls=impls, timeout_s=20))
    assert plain["checks"][0]["status"] == "fail"
    debug = run_checks(ParityConfig(world_size=2, checks=("all-gather-variable",), impls=impls, timeout_s=20,
                                    debug_collectives=True))
    assert debug["checks"][0]["status"] == "pass", debug["checks"][0]["reason"]

"""The transformers adapter: its rows, its availability line, and every row passing on the pinned release."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from moebench.libraries.spec import Row
from moebench.libraries.transformers import (
    ADAPTER,
    BACKENDS,
    EP_MODES,
    MODELS,
    NUM_EXPERTS,
    TransformersAdapter,
    skip_reason,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install 'moebench[transformers]')")


def test_protocol_attributes_and_version():
    assert (ADAPTER.name, ADAPTER.import_name, ADAPTER.extra) == ("transformers", "transformers", "transformers")
    assert ADAPTER.version() == importlib.metadata.version("transformers")
    assert ADAPTER.unavailable() is None


def test_unavailable_says_why(monkeypatch):
    from moebench.libraries.transformers import api

    monkeypatch.setattr(api, "hf_version", lambda: "4.57.1")
    assert "4.57.1 has no expert parallelism" in TransformersAdapter().unavailable()
    monkeypatch.setattr(api, "hf_version", lambda: None)
    assert TransformersAdapter().unavailable() == (
        "transformers is not installed: pip install 'moebench[transformers]'")


def test_rows_cover_models_backends_modes():
    rows = ADAPTER.rows(4)
    runnable = [r for r in rows if r.backend in BACKENDS]
    assert {(r.model, r.backend, r.ep_mode) for r in runnable} == {
        (m, b, e) for m in MODELS for b in BACKENDS for e in EP_MODES}
    assert all(r.world_size == 4 and r.library == "transformers" for r in rows)
    assert len({r.key() for r in rows}) == len(rows)
    assert rows[0].key() == "transformers/mixtral/eager/all_to_all/w4"


def test_unsupported_combinations_skip_with_one_line():
    cuda = [r for r in ADAPTER.rows(2) if r.backend not in BACKENDS]
    assert cuda
    for r in cuda:
        reason = skip_reason(r)
        assert reason and "\n" not in reason and "CUDA" in reason
    assert "world size >= 2" in skip_reason(Row(library="transformers", model="mixtral", backend="eager",
                                                ep_mode="all_to_all", world_size=1))
    assert f"{NUM_EXPERTS} experts" in skip_reason(Row(library="transformers", model="mixtral", backend="eager",
                                                       ep_mode="all_reduce", world_size=3))
    assert skip_reason(Row(library="transformers", model="mixtral", backend="eager", ep_mode="all_reduce",
                           world_size=2)) is None


def test_distributed_config_is_the_public_one():
    """Each mode is a DistributedConfig as transformers' docs spell it (no private entry point)."""
    from transformers.distributed import DistributedConfig

    from moebench.libraries.transformers.api import distributed_config

    def make(mode):
        return distributed_config(Row(library="transformers", model="mixtral", backend="eager", ep_mode=mode,
                                       world_size=4))

    a2a, a2a_tp, ar = make("all_to_all"), make("all_to_all+tp"), make("all_reduce")
    assert all(isinstance(c, DistributedConfig) for c in (a2a, a2a_tp, ar))
    assert (a2a.fsdp_size, a2a.tp_size, a2a.ep_size, a2a.ep_implementation) == (4, 1, 4, "all_to_all")
    assert (a2a_tp.fsdp_size, a2a_tp.tp_size, a2a_tp.ep_size, a2a_tp.ep_implementation) == (1, 4, 4, "all_to_all")
    assert (ar.tp_size, ar.ep_size, ar.ep_implementation) == (4, 4, "all_reduce")


# ------------------------------------------------------------------ on real ranks


def _assert_all_pass(results):
    for result in results:
        if result.skipped is None:
            assert result.passed, result.describe()
            assert not [c for c in result.comparisons if c.vacuous], f"{result.row.key()}: vacuous comparisons"


@pytest.mark.multirank
def test_fast_subset_passes_at_world_2():
    """Two families, every backend and mode once: Mixtral (plain top-2) and DeepSeek-V3 (grouped top-k, shared
    expert), in one launch."""
    from libraries.hf_launch import row, run_rows

    bf16 = next(r for r in ADAPTER.rows(2) if r.key() == "transformers/deepseek_v3/grouped_mm/all_to_all/w2/bf16")
    rows = [row("mixtral", "grouped_mm", "all_to_all", 2), row("mixtral", "eager", "all_reduce", 2),
            row("deepseek_v3", "batched_mm", "all_to_all+tp", 2), row("deepseek_v3", "eager", "all_to_all", 2), bf16]
    results = run_rows(rows, 2)
    _assert_all_pass(results)
    names = {c.name for r in results[:4] for c in r.comparisons}
    # every expert by its global index, in transformers' own parameter names; router; loss curve
    assert {f"grad experts.gate_up_proj[expert {e}]" for e in range(NUM_EXPERTS)} <= names
    assert {"output", "input grad", "grad gate.weight", "loss curve (3 SGD steps)"} <= names
    # bf16: judged by the noise model (output, every parameter's gradient, input gradient), never per element
    judged = [c.name.split(": ")[2].split("'s")[0] for c in results[4].comparisons if "noise model" in c.name]
    assert judged == ["output", "parameter gradient", "input grad"] * 2  # on each rank


@pytest.mark.multirank
def test_fast_subset_passes_at_world_4():
    from libraries.hf_launch import row, run_rows

    _assert_all_pass(run_rows([row("qwen3_moe", "grouped_mm", "all_to_all", 4)], 4))


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_whole_matrix_passes(world_size):
    from libraries.hf_launch import run_rows

    results = run_rows(ADAPTER.rows(world_size), world_size)
    _assert_all_pass(results)
    # float32 rows: every family x backend x mode; bf16 rows: every family x mode (transformers' default backend)
    assert sum(r.skipped is None for r in results) == len(MODELS) * (len(BACKENDS) + 1) * len(EP_MODES)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_no_false_alarms_over_seeds(world_size, seed):
    """0 false alarms: the unbroken library passes every runnable row for 5 more seeds."""
    from libraries.hf_launch import run_rows

    rows = [r for r in ADAPTER.rows(world_size) if r.backend in BACKENDS]
    _assert_all_pass(run_rows(rows, world_size, seed=seed))

"""The torchtitan adapter: its rows and one-line why-nots, the import stand-in for triton (a kernel launched through it
raises, and it leaves nothing behind), the pinned release passing in bf16 under the noise model, and the TP
router gradient left Partial (pytorch/torchtitan#4054 undone by patching torchtitan's own sharding config in this
process) named as such."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import textwrap

import pytest

from moebench.libraries.spec import Row
from moebench.libraries.torchtitan import ADAPTER, Torchtitan, skip_reason

INSTALLED = importlib.util.find_spec("torchtitan") is not None and all(
    importlib.util.find_spec(m) is not None for m in ("spmd_types", "tyro", "docstring_parser"))
needs_torchtitan = pytest.mark.skipif(not INSTALLED, reason="torchtitan is not installed (pip install "
                                      "'moebench[torchtitan]' && pip install --no-deps torchtitan==0.3.0)")


def _row(model="softmax-top2", backend="partial_dtensor", layout="ep", world_size=2) -> Row:
    key = f"torchtitan/{model}/{backend}/{layout}/w{world_size}"
    return next(r for r in ADAPTER.rows(world_size) if r.key() == key)


@needs_torchtitan
def test_rows_cover_layouts_backends_and_models():
    two, four = ADAPTER.rows(2), ADAPTER.rows(4)
    runnable = {(r.model, r.backend, r.ep_mode) for r in four if skip_reason(r) is None}
    assert runnable == {(m, b, lay) for m in ("softmax-top2", "sigmoid-grouped+shared")
                        for b in ("spmd_types", "partial_dtensor", "full_dtensor") for lay in ("ep", "tp", "ep+tp")}
    assert not any(r.ep_mode == "ep+tp" for r in two) and ADAPTER.rows(1) == []
    assert all(r.kind == "bf16" and r.settings.triton for r in four)  # every row says which triton it ran with
    # the default backend's rows say what they bridge (the padded exchange), where they exchange tokens
    assert {r.ep_mode for r in four if r.settings.patch.startswith("spmd_types")} == {"ep", "ep+tp"}


def test_missing_library_is_one_line_with_its_pip_command(monkeypatch):
    from moebench.libraries.torchtitan import api

    monkeypatch.setattr(api, "tt_version", lambda: None)
    line = Torchtitan().unavailable()
    assert line == "not installed: pip install 'moebench[torchtitan]' && pip install --no-deps torchtitan==0.3.0"


def test_the_triton_stand_in_raises_when_a_kernel_is_launched_and_leaves_nothing(tmp_path, monkeypatch):
    """A module importing triton at module level, as torchtitan's kernels do, imports through the stand-in; its kernel
    raises naming itself when launched; afterwards `import triton` fails as before."""
    from moebench.libraries.torchtitan import imports

    if importlib.util.find_spec("triton") is not None:
        pytest.skip("triton is installed here: the stand-in is never used")
    package = tmp_path / "torchtitan_fake_kernels.py"
    package.write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit(do_not_specialize=["rank"])
        def fill(counts: tl.pointer_type(tl.int64), BLOCK: tl.constexpr):
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    imports.import_torchtitan("torchtitan_fake_kernels")
    kernel = sys.modules["torchtitan_fake_kernels"].fill
    with pytest.raises(RuntimeError, match="Triton kernel fill launched, but triton is not installed"):
        kernel[(1,)](None, BLOCK=1)
    assert "triton" not in sys.modules and importlib.util.find_spec("triton") is None
    assert imports.triton_kind() == imports.STUB


# ------------------------------------------------------------------ on real ranks


def _run(rows, world_size=2, seed=0):
    """Each row in its own launch, as the --library runner runs it: torchtitan's trainer path builds one ParallelDims
    per process, and a second one of the same mesh shape in a process (another backend's row) leaves FSDP a
    parameter on the first one's mesh (api._DIMS)."""
    from libraries.rows_launch import run_rows

    return [result for row in rows for result in run_rows(ADAPTER, [row], world_size, seed)]


def _assert_all_pass(results):
    for result in results:
        if result.skipped is None:
            assert result.passed, result.describe()


@needs_torchtitan
@pytest.mark.multirank
def test_pinned_release_passes_ep_and_tp_in_bf16():
    """EP (softmax top-2) and TP (sigmoid, grouped, shared expert) at world 2, one launch (~3 s): every group within
    the noise model."""
    results = _run([_row(), _row("sigmoid-grouped+shared", layout="tp")])
    _assert_all_pass(results)
    judged = [c.name.split("noise model: ")[1].split("'s distance")[0] for c in results[1].comparisons
              if "noise model" in c.name and c.rank == 0]
    assert judged == ["output", "router gradient", "expert gradient", "shared-expert gradient", "input grad"]


def _tp_grad_placement_dropped(monkeypatch):
    """pytorch/torchtitan#4054 undone: without EP the routed experts' local_map gets no input-gradient placements,
    so local_map takes them as Replicate and one TP rank's share of each gradient below the experts is kept."""
    from moebench.libraries.torchtitan import api

    api.load()
    from torchtitan.models.common import moe_sharding
    from torchtitan.protocols.sharding import LocalMapConfig

    configs = moe_sharding._routed_experts_sharding_configs

    def dropped(*, enable_ep, enable_sp, expert_param_layout):
        routed, inner = configs(enable_ep=enable_ep, enable_sp=enable_sp, expert_param_layout=expert_param_layout)
        if not enable_ep:
            routed = dataclasses.replace(routed, local_map=LocalMapConfig(in_grad_placements=None))
        return routed, inner

    monkeypatch.setattr(moe_sharding, "_routed_experts_sharding_configs", dropped)


@needs_torchtitan
@pytest.mark.multirank
def test_a_tp_router_gradient_left_partial_is_named(monkeypatch):
    from moebench.parity.diagnose import summarise

    _tp_grad_placement_dropped(monkeypatch)
    (result,) = _run([_row(layout="tp")])
    first = result.failed[0]
    verdict = summarise(result.comparisons, 2)
    assert verdict["name"] == "grad-left-partial", verdict["sentence"]
    assert first.group == "gate/router" and "summed over the 2 TP ranks it is right" in first.diagnosis["sentence"]
    assert "output right" in verdict["sentence"] and "experts right" in verdict["sentence"]


def _spmd_types_refused() -> str | None:
    """Why this torch's fully_shard refuses spmd_types' parameters (torch < 2.14), or None."""
    from moebench.libraries.torchtitan import trainer

    return trainer.fsdp_refusal("spmd_types")


def _assert_matrix(results) -> None:
    """Every row passes through torchtitan's trainer path (its parallelize function, fully_shard included), but the
    default backend's on a torch whose fully_shard refuses its plain parameters: refused, with FSDP's words."""
    for result in results:
        if result.skipped is not None:
            continue
        if result.row.backend == "spmd_types" and _spmd_types_refused():
            assert result.refused and "pytorch/pytorch#181519" in result.refused, result.describe()
            continue
        assert result.passed, result.describe()
        assert "fully_shard" in result.row.settings.dense_grads and not result.row.settings.emulated()


def _summary(result):
    from moebench.parity.diagnose import summarise

    return summarise(result.comparisons, result.row.world_size)


@needs_torchtitan
@pytest.mark.multirank
def test_the_default_backend_runs_its_ep_rows_through_the_padded_exchange():
    """spmd_types (torchtitan 0.3's default) at W = 2: EP and TP pass within the noise model through its trainer's
    parallelize (fully_shard converting its plain parameters, torch >= 2.14) and its own token exchange, padded for
    gloo (exchange.py); refused on a torch whose fully_shard cannot take them."""
    _assert_matrix(_run([_row(backend="spmd_types"), _row("sigmoid-grouped+shared", backend="spmd_types"),
                         _row(backend="spmd_types", layout="tp")]))


@needs_torchtitan
@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_whole_matrix_passes(world_size):
    results = _run(ADAPTER.rows(world_size), world_size)
    _assert_matrix(results)
    assert sum(r.skipped is None for r in results) == (12 if world_size == 2 else 18)


@needs_torchtitan
@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_no_false_alarms_over_seeds(world_size, seed):
    _assert_all_pass(_run([r for r in ADAPTER.rows(world_size) if skip_reason(r) is None and not (
        r.backend == "spmd_types" and _spmd_types_refused())], world_size, seed))


def _padded_exchange(ctx):
    """Every rank sends rank j a chunk of (rank + 2 * j) % 3 rows (one empty) through the padded exchange; what it
    receives must be exactly what each sender sent it, as an uneven all_to_all would give."""
    import torch
    import torch.distributed as dist

    from moebench.libraries.torchtitan.exchange import PaddedAllToAll

    r, w = ctx.rank, ctx.world_size

    def chunk(src, dst):
        rows = (src + 2 * dst) % 3
        return torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 100 * src + 10 * dst

    sent = [chunk(r, j) for j in range(w)]
    received = [torch.full_like(chunk(j, r), -1.0) for j in range(w)]
    PaddedAllToAll(dist).all_to_all(received, sent)
    return all(torch.equal(got, chunk(j, r)) for j, got in enumerate(received))


@pytest.mark.multirank
def test_the_padded_exchange_is_the_uneven_exchange_element_for_element():
    from moebench.distributed.launch import check, launch

    result = check(launch(_padded_exchange, 3, backend="gloo", timeout_s=60, label="padded exchange"))
    assert result.returns == [True, True, True]

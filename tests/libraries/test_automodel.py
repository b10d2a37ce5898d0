"""The NeMo Automodel adapter: its rows, its one-line why-nots, the pinned release passing, and broken EP made by
patching Automodel's own objects in this process (never its files; the ranks are forked, so they inherit the patch),
each failing with its mechanism named."""

from __future__ import annotations

import importlib.util

import pytest

from moebench.libraries.automodel import ADAPTER, Automodel, skip_reason
from moebench.libraries.spec import Row

INSTALLED = importlib.util.find_spec("nemo_automodel") is not None
needs_automodel = pytest.mark.skipif(not INSTALLED, reason="nemo-automodel is not installed "
                                     "(pip install --no-deps nemo-automodel==0.7.0; make install does it)")


def _row(model="block", backend="torch", world_size=2, clip=False) -> Row:
    key = f"automodel/{model}/{backend}/apply_ep/w{world_size}" + ("/clip" if clip else "")
    return next(r for r in ADAPTER.rows(world_size) if r.key() == key)


def test_rows_cover_models_backends_and_the_clip():
    rows = ADAPTER.rows(4)
    runnable = [r for r in rows if r.backend in ("torch", "torch_mm")]
    assert {(r.model, r.backend, r.settings.max_grad_norm is not None) for r in runnable} == {
        (m, b, c) for m in ("block", "deepseek_v3", "qwen3_moe") for b in ("torch", "torch_mm") for c in (False, True)}
    assert len({r.key() for r in rows}) == len(rows) and ADAPTER.rows(1) == []
    qwen3 = [r for r in rows if r.model == "qwen3_moe"]
    assert all("torch.cuda.current_device" in r.settings.patch for r in qwen3)  # named in every row it applies to
    assert all(r.settings.patch == "" for r in rows if r.model != "qwen3_moe")


def test_cuda_backends_skip_with_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    for backend, words in (("te", "Transformer Engine"), ("deepep", "DeepEP")):
        reason = skip_reason(_row(backend=backend))
        assert words in reason and "CUDA" in reason and "\n" not in reason
    assert skip_reason(_row()) is None


def test_missing_library_is_one_line_with_its_pip_command(monkeypatch):
    from moebench.libraries.automodel import api

    monkeypatch.setattr(api, "am_version", lambda: None)
    line = Automodel().unavailable()
    assert line.startswith("not installed: ") and "pip install --no-deps nemo-automodel==" in line
    assert "moebench[automodel]" in line and "\n" not in line


# ------------------------------------------------------------------ on real ranks


def _run(rows, world_size=2, seed=0):
    from libraries.rows_launch import run_rows

    return run_rows(ADAPTER, rows, world_size, seed)


def _assert_all_pass(results):
    for result in results:
        if result.skipped is None:
            assert result.passed, result.describe()
            assert not [c for c in result.comparisons if c.vacuous], f"{result.row.key()}: vacuous comparisons"


@needs_automodel
@pytest.mark.multirank
def test_pinned_release_passes_a_row_of_each_model():
    """The block (loop experts, clip), DeepSeek-V3 (torch_mm) and Qwen3-MoE (clip) at world 2, one launch (~3 s)."""
    results = _run([_row(clip=True), _row("deepseek_v3", "torch_mm"), _row("qwen3_moe", clip=True)])
    _assert_all_pass(results)
    names = {c.name for c in results[0].comparisons}
    assert {f"grad layers.0.mlp.experts.gate_and_up_projs[expert {e}]" for e in range(8)} <= names
    assert {"output", "input grad", "grad layers.0.mlp.gate.weight", "loss curve (3 SGD steps)"} <= names
    assert any(n.startswith("clip norm (training.utils.clip_grad_norm") for n in names)


def _first_failure(result):
    assert result.skipped is None and not result.passed, result.row.key()
    return result.failed[0]


def _router_detached(monkeypatch):
    """The routing weights gathered without a backward (what 0.5.0's differentiable=False gather does)."""
    from nemo_automodel.components.moe.experts import GroupedExperts

    gather = GroupedExperts._gather_ep_inputs

    def detached(*args, **kwargs):
        x, weights, indices, mask, lens = gather(*args, **kwargs)
        return x, weights.detach(), indices, mask, lens

    monkeypatch.setattr(GroupedExperts, "_gather_ep_inputs", staticmethod(detached))


def _gather_backward_unreduced(monkeypatch):
    """The EP all-gather's backward keeps this rank's slice of the gathered gradient without all-reducing it."""
    from nemo_automodel.components.moe import experts

    def backward(ctx, grad_output):
        start = sum(ctx.gathered_lens[: ctx.rank])
        return grad_output.narrow(0, start, ctx.gathered_lens[ctx.rank]).contiguous(), None, None, None

    monkeypatch.setattr(experts._AllGatherConcatVarlenFn, "backward", staticmethod(backward))


def _experts_summed(monkeypatch):
    """The trainer's EP scaling skipped: scale_grads_and_clip_grad_norm called without the MoE mesh, so the expert
    gradients keep the sum over the dp ranks' (x dp) losses."""
    from nemo_automodel.components.training import utils

    scale = utils.scale_grads_and_clip_grad_norm
    monkeypatch.setattr(utils, "scale_grads_and_clip_grad_norm",
                        lambda max_norm, parts, **kw: scale(max_norm, parts, **{**kw, "moe_mesh": None}))


def _per_rank_norm(monkeypatch):
    """clip_grad_norm's scalar reductions skipped: every rank clips by the norm of the gradients it holds."""
    from nemo_automodel.components.training import utils

    monkeypatch.setattr(utils, "_all_reduce_scalar", lambda scalar, op, mesh, mesh_dim=None: scalar)


FAULTS = [  # (patch, row, the row's diagnosis name, the group of the first failure, words of its sentence)
    (_router_detached, dict(), "router-detached", "gate/router", "non-differentiable gather"),
    (_gather_backward_unreduced, dict(), "gather-backward-unreduced", "gate/router", "_AllGatherConcatVarlenFn"),
    (_experts_summed, dict(), "uniform-scale", "experts", "summed instead of averaged over 2 ranks (the world size)"),
    (_per_rank_norm, dict(clip=True), "global-norm", "replicated", "per-rank norms"),
]


@needs_automodel
@pytest.mark.multirank
@pytest.mark.parametrize("patch,where,name,group,words", FAULTS, ids=[f[2] for f in FAULTS])
def test_each_broken_ep_path_is_named(monkeypatch, patch, where, name, group, words):
    from moebench.parity.diagnose import summarise

    patch(monkeypatch)
    (result,) = _run([_row(**where)])
    first = _first_failure(result)
    verdict = summarise(result.comparisons, 2)
    assert verdict["name"] == name, verdict["sentence"]
    assert first.group == group and words in first.diagnosis["sentence"], first.diagnosis
    if name in ("router-detached", "gather-backward-unreduced"):  # the forward is right: only gradients are wrong
        assert "output right" in verdict["sentence"]


@needs_automodel
@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_whole_matrix_passes(world_size):
    results = _run(ADAPTER.rows(world_size), world_size)
    _assert_all_pass(results)
    assert sum(r.skipped is None for r in results) == 12


@needs_automodel
@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_no_false_alarms_over_seeds(world_size, seed):
    """0 false alarms: the pinned release passes every runnable row for 5 more seeds (the clip binds at each)."""
    _assert_all_pass(_run([r for r in ADAPTER.rows(world_size) if skip_reason(r) is None], world_size, seed))

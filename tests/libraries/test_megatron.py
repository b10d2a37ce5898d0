"""The Megatron-core adapter: its matrix and one-line why-nots, the CUDA stand-ins (only in a rank, undone after,
raising where a CUDA kernel would be needed), the pinned release's matrix at W = 2 with its findings named, and every
injected fault (tests/faults/megatron_faults.py, Megatron's own objects patched in this process) named by its
mechanism. W = 4, five seeds and the side-installed releases are the slow tier."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest

from moebench.libraries.megatron import ADAPTER, Megatron, layouts, skip_reason
from moebench.libraries.spec import Row

INSTALLED = importlib.util.find_spec("megatron") is not None and ADAPTER.version() is not None
needs_megatron = pytest.mark.skipif(not INSTALLED, reason="megatron-core is not installed (pip install "
                                    "'moebench[megatron]')")

FINDINGS = {  # megatron-core 0.16.1, as measured (docs/libraries/megatron.md, "Findings")
    "megatron/softmax-top2/alltoall+sequential/tp=2_etp=1_ep=1/w{w}": "expert-dp-unreduced",
    "megatron/softmax-top2/alltoall+sequential/tp=2_ep=1/w{w}/aux+z+per-token": "aux-loss-scale",
    "megatron/softmax-top2/alltoall+sequential/tp=2_etp=1_ep={w}/w{w}/aux+z+per-token": "aux-loss-scale",
}
"""The pinned release's failing rows at world w and the mechanism each is named by."""


def findings(world_size: int) -> dict[str, str]:
    return {key.format(w=world_size): name for key, name in FINDINGS.items()}


def _row(key: str) -> Row:
    world = int(key.split("/w")[1].split("/")[0])
    return next(r for r in ADAPTER.rows(world) if r.key() == key)


def _run(rows, world_size=2, seed=0):
    from libraries.rows_launch import run_rows

    return run_rows(ADAPTER, rows, world_size, seed)


def _verdict(result, world_size):
    from moebench.parity.diagnose import summarise

    if result.skipped is not None:
        return "skip", result.skipped
    found = summarise(result.comparisons, world_size)
    return ("pass", None) if found is None else ("fail", found)


def test_the_matrix_covers_dispatchers_experts_routers_features_and_layouts():
    for w in (2, 4):
        rows = ADAPTER.rows(w)
        keys = [r.key() for r in rows]
        assert len(keys) == len(set(keys))
        assert {r.backend for r in rows} == {"alltoall+sequential", "allgather+sequential", "alltoall+grouped",
                                            "flex+sequential", "alltoall+te"}
        assert {r.model for r in rows} == {"softmax-top2", "softmax-pre-top2", "sigmoid-grouped+shared",
                                          "sigmoid-bias"}
        assert {r.variant for r in rows} == {"", "aux+z", "aux+z+per-token", "capacity-drop", "capacity-pad",
                                            "distopt", "bf16"}
        assert {r.ep_mode for r in rows} == set(layouts(w))
        assert all(r.settings.standins and r.settings.edp * r.settings.etp * r.settings.ep == w for r in rows)
        assert all(r.settings.tp * (w // r.settings.tp) == w for r in rows)
        assert {r.kind for r in rows} == {"parity", "bf16"}
    assert ADAPTER.rows(1) == [] and ADAPTER.rows(3) == []
    assert set(findings(2)) <= {r.key() for r in ADAPTER.rows(2)}
    assert set(findings(4)) <= {r.key() for r in ADAPTER.rows(4)}


def test_cuda_only_rows_skip_with_one_line():
    for key, needs in (("megatron/softmax-top2/flex+sequential/ep=2/w2", "DeepEP"),
                       ("megatron/softmax-top2/alltoall+te/ep=2/w2", "Transformer Engine"),
                       ("megatron/softmax-top2/alltoall+sequential/tp=2_ep=2/w4", "gloo refuses")):
        reason = skip_reason(_row(key))
        assert needs in reason and "\n" not in reason


def test_missing_library_is_one_line_with_its_pip_command(monkeypatch):
    from moebench.libraries.megatron import api

    monkeypatch.setattr(api, "mc_version", lambda: None)
    assert Megatron().unavailable() == "not installed: pip install 'moebench[megatron]'"


def test_list_says_it_runs_and_which_releases():
    from moebench.libraries import registry

    status = registry.status("megatron")
    if INSTALLED:
        assert status.why_not is None and status.version == ADAPTER.version()
    from moebench.libraries import compatibility

    lines = [r.line() for name, r in compatibility.entries() if name == "megatron"]
    assert any(line.startswith("0.16.1 (pinned): ") and "#5047" in line for line in lines), lines


def test_the_triton_stand_in_raises_when_a_kernel_is_launched_and_leaves_nothing(tmp_path, monkeypatch):
    """A module importing triton at module level, as megatron-core 0.17+ does, imports through the stand-in; its
    kernel raises naming itself when launched; triton's version reads 0.0.0 (Megatron's own checks then take their
    no-triton path); afterwards `import triton` fails as before."""
    from moebench.libraries.megatron import standins

    if importlib.util.find_spec("triton") is not None:
        pytest.skip("triton is installed here: the stand-in is never used")
    (tmp_path / "megatron_fake_kernels.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        VERSION = triton.__version__

        @triton.jit
        def copy(src, dst, BLOCK: tl.constexpr):
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    standins.import_megatron("megatron_fake_kernels")
    module = sys.modules["megatron_fake_kernels"]
    with pytest.raises(RuntimeError, match="Triton kernel copy launched, but triton is not installed"):
        module.copy[(1,)](None, None, BLOCK=4)
    assert module.VERSION == "0.0.0"
    assert "triton" not in sys.modules and importlib.util.find_spec("triton") is None


@needs_megatron
def test_without_transformer_engine_the_router_of_0_13_to_0_16_raises_name_error():
    """The finding behind the `te_general_gemm` stand-in: moe_utils.py defines it only when Transformer Engine imports,
    and the router's gating calls it (0.19.2 defines it None itself: there is nothing to stand in for)."""
    import torch

    from moebench.libraries.megatron.standins import import_megatron

    import_megatron("megatron.core.transformer.moe.moe_utils")
    moe_utils = sys.modules["megatron.core.transformer.moe.moe_utils"]
    if "te_general_gemm" in vars(moe_utils):
        pytest.skip(f"megatron-core {ADAPTER.version()} defines te_general_gemm without Transformer Engine")
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(torch.randn(3, 4), torch.randn(2, 4), None, torch.float32)


def _inside_a_rank(ctx):
    """What the stand-ins do in a rank, and that they are gone after."""
    import torch

    from moebench.libraries.megatron import standins

    seen = {}
    with standins.in_rank():
        seen["device"] = str(torch.cuda.current_device())
        seen["cuda_tensor"] = str(torch.zeros(2, device="cuda").device)
        seen["type"] = torch.zeros(2).type()
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
        try:
            torch.cuda.Event().elapsed_time(torch.cuda.Event())
        except RuntimeError as exc:
            seen["timing"] = str(exc)
        from megatron.core.transformer.moe import grouped_gemm_util

        a, b = torch.randn(5, 3, requires_grad=True), torch.randn(2, 3, 4)
        out = grouped_gemm_util.ops.gmm(a, b, torch.tensor([2, 3]))
        seen["gmm"] = bool(torch.allclose(out, torch.cat([a[:2] @ b[0], a[2:] @ b[1]])))
        out.sum().backward()
        seen["gmm_grad"] = a.grad is not None
    seen["after_type"] = torch.zeros(2).type()
    try:
        torch.zeros(2, device="cuda")
        seen["after_cuda"] = "made"
    except (RuntimeError, AssertionError) as exc:
        seen["after_cuda"] = type(exc).__name__
    seen["stream_after"] = torch.cuda.Stream.__module__
    return seen


@needs_megatron
@pytest.mark.multirank
def test_the_cuda_stand_ins_live_in_the_rank_only_and_raise_where_cuda_is_needed():
    from moebench.distributed.launch import check, launch
    from moebench.libraries.megatron import standins

    with pytest.raises(RuntimeError, match="rank processes only"):
        with standins.in_rank():
            pass
    seen = check(launch(_inside_a_rank, 1, backend="gloo", timeout_s=60)).returns[0]
    assert seen["device"] == "cpu" and seen["cuda_tensor"] == "cpu" and seen["type"] == "torch.cuda.FloatTensor"
    assert "needs CUDA" in seen["timing"] and seen["gmm"] and seen["gmm_grad"]
    assert seen["after_type"] == "torch.FloatTensor" and seen["after_cuda"] != "made"
    assert seen["stream_after"].startswith("torch.cuda")


def _assert_verdicts(results, world_size):
    """Each row passes, or fails with the mechanism of its finding, or skips. A passing row's only vacuous comparisons
    are zero against zero exactly (the gradient of an expert no token reached, which its tolerance 0 holds to 0)."""
    expected = findings(world_size)
    verdicts = {}
    for result in results:
        verdict, found = _verdict(result, world_size)
        verdicts[result.row.key()] = verdict
        if result.row.key() in expected:
            assert verdict == "fail" and found["name"] == expected[result.row.key()], (result.row.key(), found)
        elif verdict != "skip":
            assert verdict == "pass", result.describe()
            assert not any(c.vacuous and c.asserted and not (c.magnitude == 0 and c.max_abs_diff == 0)
                           for c in result.comparisons), result.row.key()
    return verdicts


@needs_megatron
@pytest.mark.multirank
def test_pinned_release_matrix_at_w2():
    """Every row of W = 2 in one launch (~10 s): each passes, or fails with the mechanism of its finding, or skips
    with its reason (the flex dispatcher, Transformer Engine's experts)."""
    verdicts = _assert_verdicts(_run(ADAPTER.rows(2)), 2)
    assert list(verdicts.values()).count("skip") == 2 and list(verdicts.values()).count("fail") == len(findings(2))


@needs_megatron
@pytest.mark.slow
@pytest.mark.multirank
def test_pinned_release_matrix_at_w4():
    verdicts = _assert_verdicts(_run(ADAPTER.rows(4), 4), 4)
    assert list(verdicts.values()).count("skip") == 3 and list(verdicts.values()).count("fail") == len(findings(4))


@needs_megatron
@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_no_false_alarms_over_seeds(world_size, seed):
    """Seeds 1-5: every row that passes at seed 0 passes, every finding fails with its mechanism."""
    _assert_verdicts(_run([r for r in ADAPTER.rows(world_size) if skip_reason(r) is None], world_size, seed),
                     world_size)


FAULT_ROWS = {
    "aux-loss-tp-factor": ("megatron/softmax-top2/alltoall+sequential/tp=2_ep=1/w2/aux+z", "aux-loss-scale"),
    "expert-grads-x-ep": ("megatron/softmax-top2/alltoall+sequential/ep=2/w2", "expert-grad-scale"),
    "norm-without-experts": ("megatron/softmax-top2/alltoall+sequential/ep=2/w2", "clip-norm-without-group"),
    "norm-tp-rank-0-experts": ("megatron/softmax-top2/alltoall+sequential/tp=2_etp=1_ep=2/w2",
                               "norm-missing-experts"),
    "expert-dp-skipped": ("megatron/softmax-top2/alltoall+sequential/ep=2_edp=2/w4", "expert-dp-unreduced"),
}
"""Each injected fault, the row it breaks (a row that passes on the pinned release), and the name it must get. The
expert-DP reduction needs EP > 1 and expert-DP > 1, so 4 ranks (with EP = 1 Megatron reduces experts as dense
parameters: there is no expert buffer to skip)."""


@needs_megatron
@pytest.mark.multirank
@pytest.mark.parametrize("fault", sorted(FAULT_ROWS))
def test_an_injected_fault_is_named(fault, monkeypatch):
    from faults.megatron_faults import FAULTS

    from moebench.libraries.megatron.api import MODULES
    from moebench.libraries.megatron.standins import import_megatron

    import_megatron(*MODULES)
    FAULTS[fault](monkeypatch.setattr)
    key, name = FAULT_ROWS[fault]
    row = _row(key)
    (result,) = _run([row], row.world_size)
    verdict, found = _verdict(result, row.world_size)
    assert verdict == "fail" and found["name"] == name, (fault, found)

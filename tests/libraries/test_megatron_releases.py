"""Other megatron-core releases, side-installed (pip's --target, never into the venv) and first on PYTHONPATH of a CLI
run (slow tier): each release's verdicts at W = 2 as measured here (docs/libraries/megatron.md, "Releases and torch").

0.16.1 (pinned) is the newest wheel for Python 3.11 (tests/libraries/test_megatron.py); 0.12.3-0.16.0 have cp311
wheels too. 0.17-0.19 declare Requires-Python >= 3.12; their wheel's code runs on 3.11 all the same: pip installs the
cp312 wheel into the side folder with `--python-version 3.12 --only-binary=:all: --ignore-requires-python` (its one
compiled file, the datasets' helpers_cpp, is never imported on the MoE path), still outside the venv."""

from __future__ import annotations

import json

import pytest
from helpers.releases import cli, side_install

pytestmark = pytest.mark.slow

PY312 = ["--python-version", "3.12", "--only-binary=:all:", "--ignore-requires-python"]
FOUND_IN_0_16 = {
    "megatron/softmax-top2/alltoall+sequential/tp=2_etp=1_ep=1/w2": "expert-dp-unreduced",
    "megatron/softmax-top2/alltoall+sequential/tp=2_ep=1/w2/aux+z+per-token": "aux-loss-scale",
    "megatron/softmax-top2/alltoall+sequential/tp=2_etp=1_ep=2/w2/aux+z+per-token": "aux-loss-scale",
}
"""The findings of 0.16.1 (and 0.13.1-0.16.0): ETP != TP with EP = 1 reduces the experts over the dense DP group
(NVIDIA/Megatron-LM#5916's second case); the aux / z-loss under TP with the per-token loss (#5047)."""
NO_SHARED_GATE = "TransformerConfig has no moe_shared_expert_gate"
DISTOPT_RAISES = "Invalid Transformer Engine version for FP8 distributed optimizer"


def _run(version: str, tmp_path, extra: tuple[str, ...] = ()) -> dict:
    folder = side_install(f"megatron-core-{version}", [*extra, f"megatron-core=={version}"],
                          "megatron/core/__init__.py")
    done = cli(folder, "--library", "megatron", "-n", "2", "--json", results=tmp_path)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode in (0, 1), done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert {r["version"] for r in summary["rows"]} == {version}
    return summary


def _failed(summary: dict) -> dict[str, str]:
    return {r["check"]: r["diagnosis_name"] for r in summary["rows"] if r["verdict"] == "fail"}


def test_0_19_2_passes_every_row_it_has(tmp_path):
    """The newest release: both findings fixed (#5047's TP factor in the per-token aux / z scale, #5916's expert
    reduction with ETP != TP); no GroupedMLP (its grouped experts are Transformer Engine's): those rows skip. Imported
    with the stand-in triton (0.17+ import it at module level), which every row records."""
    summary = _run("0.19.2", tmp_path, tuple(PY312))
    assert summary["counts"] == {"pass": 28, "fail": 0, "skip": 4}
    grouped = [r for r in summary["rows"] if r["backend"] == "alltoall+grouped"]
    assert grouped and all("no GroupedMLP" in r["diagnosis"] for r in grouped)
    assert all(r["triton"].startswith("import stand-in") for r in summary["rows"])


@pytest.mark.parametrize("version", ["0.16.0", "0.15.3", "0.14.0", "0.13.1"])
def test_0_13_to_0_16_have_the_findings_of_the_pinned_release(version, tmp_path):
    summary = _run(version, tmp_path)
    assert _failed(summary) == FOUND_IN_0_16
    gateless = [r for r in summary["rows"] if NO_SHARED_GATE in (r["diagnosis"] or "")]
    assert len(gateless) == (0 if version == "0.16.0" else 3)  # the shared expert's gate arrived in 0.16
    assert summary["counts"]["skip"] == 2 + len(gateless)


def test_0_12_3_raises_where_later_releases_compute_wrong(tmp_path):
    """0.12.3: the aux / z-loss finding as in 0.16; ETP != TP with EP = 1 raises in the shared reduce-scatter (an
    assertion on the tensor's first dimension) instead of reducing over the wrong group; its distributed optimizer
    raises without Transformer Engine, in float32 with no FP8 asked for (fp8_utils: "Invalid Transformer Engine
    version for FP8 distributed optimizer"; 0.13.1 runs it)."""
    summary = _run("0.12.3", tmp_path)
    failed = _failed(summary)
    assert {k: v for k, v in failed.items() if v == "aux-loss-scale"} == {
        k: v for k, v in FOUND_IN_0_16.items() if v == "aux-loss-scale"}
    raised = {r["check"]: r["diagnosis"] for r in summary["rows"] if r["diagnosis_name"] == "library-raised"}
    assert "divisible by tensor parallel size" in raised.pop(
        "megatron/softmax-top2/alltoall+sequential/tp=2_etp=1_ep=1/w2")
    assert len(raised) == 3 and all(DISTOPT_RAISES in why and "/distopt" in key for key, why in raised.items())
    assert summary["counts"] == {"pass": 21, "fail": 6, "skip": 5}

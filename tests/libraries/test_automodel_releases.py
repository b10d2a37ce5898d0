"""Older NeMo Automodel releases, side-installed (pip's --target, never into the venv) and first on PYTHONPATH of a
CLI run (slow tier): each release's verdicts and diagnoses as measured here (docs/libraries/automodel.md,
"Findings", has the upstream fixes). A failing row on a real release is a finding: asserted, not skipped."""

from __future__ import annotations

import collections
import json

import pytest
from helpers.releases import cli, side_install

pytestmark = pytest.mark.slow


def _run(version: str, tmp_path) -> tuple[dict, dict]:
    folder = side_install(f"nemo-automodel-{version}", [f"nemo-automodel=={version}"], "nemo_automodel/__init__.py")
    done = cli(folder, "--library", "automodel", "-n", "2", "--json", results=tmp_path)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode in (0, 1), done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert {r["version"] for r in summary["rows"]} == {version}
    by = collections.Counter((r["model"], r["verdict"], r["diagnosis_name"]) for r in summary["rows"]
                             if r["verdict"] != "skip")
    return summary, dict(by)


def test_0_6_0_passes_every_row(tmp_path):
    summary, _ = _run("0.6.0", tmp_path)
    assert summary["counts"] == {"pass": 12, "fail": 0, "skip": 2}


def test_0_5_0_detaches_the_router_gradient(tmp_path):
    """The EP all-gather of the routing weights has no backward (differentiable=False): the router's gradient is
    exactly zero while the output is right, on every row (NVIDIA-NeMo/Automodel#2995 fixed it in 0.6)."""
    summary, by = _run("0.5.0", tmp_path)
    assert summary["counts"] == {"pass": 0, "fail": 12, "skip": 2}
    assert by == {(m, "fail", "router-detached"): 4 for m in ("block", "deepseek_v3", "qwen3_moe")}
    assert all("output right" in r["diagnosis"] and "gate/router wrong" in r["diagnosis"]
               for r in summary["rows"] if r["verdict"] == "fail")


def test_0_4_0_detaches_the_router_gradient_too(tmp_path):
    """0.4.0 gathers as 0.5.0 does; its MoE.forward runs the shared experts on a torch.cuda.Stream, so only the
    Qwen3-MoE rows (no shared expert) run here."""
    summary, by = _run("0.4.0", tmp_path)
    assert summary["counts"] == {"pass": 0, "fail": 4, "skip": 10}
    assert by == {("qwen3_moe", "fail", "router-detached"): 4}


def test_0_3_0_never_reduces_the_gather_backward(tmp_path):
    """0.3.0 gathers with DTensor's full_tensor(), whose backward keeps each rank's slice unreduced: every token's
    input and routing weights get gradient only through its own rank's experts (NVIDIA-NeMo/Automodel#1260).
    Blocks with shared experts run them on a torch.cuda.Stream there: those rows skip with that reason."""
    summary, by = _run("0.3.0", tmp_path)
    assert summary["counts"] == {"pass": 0, "fail": 4, "skip": 10}
    assert by == {("qwen3_moe", "fail", "gather-backward-unreduced"): 4}
    stream = [r for r in summary["rows"] if r["verdict"] == "skip" and "torch.cuda.Stream" in r["diagnosis"]]
    assert {r["model"] for r in stream} == {"block", "deepseek_v3"} and len(stream) == 8


def _resume(version: str, tmp_path) -> dict:
    folder = side_install(f"nemo-automodel-{version}", [f"nemo-automodel=={version}"], "nemo_automodel/__init__.py")
    done = cli(folder, "--library", "automodel", "-n", "2", "--resume", "--row", "*/resume", "--json",
               results=tmp_path)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode in (0, 1), done.stderr[-3000:]
    return json.loads(done.stdout)


def test_0_6_0_resumes_every_slot(tmp_path):
    """0.6.0 through its Checkpointer: every slot, moment and the routing bias restored, continued bit for bit."""
    summary = _resume("0.6.0", tmp_path)
    assert [(r["backend"], r["verdict"]) for r in summary["rows"]] == [("torch", "pass"), ("torch_mm", "pass")]


def test_0_5_0_refuses_to_resume_the_gate_it_never_trained(tmp_path):
    """0.5.0's router gets no gradient under EP (its non-differentiable gather, above), so Adam never creates the
    gate's state; the checkpoint has none and the optimizer's strict DCP load refuses: the gate's optimizer state
    missing on resume under EP, NVIDIA-NeMo/Automodel#2088 (open; PR #2071 proposed a partial load; the gather is
    differentiable from 0.6, NVIDIA-NeMo/Automodel#2995)."""
    summary = _resume("0.5.0", tmp_path)
    assert [(r["backend"], r["verdict"]) for r in summary["rows"]] == [("torch", "refused"), ("torch_mm", "refused")]
    missing = "Missing key in checkpoint state_dict: optim.state.model.layers.0.mlp.gate.weight.step"
    assert all(missing in r["diagnosis"] for r in summary["rows"]), summary["rows"]


def test_0_5_0_detaches_the_router_gradient_of_a_qwen3_moe_recipe(tmp_path):
    """The same finding through a user's own launch: Automodel's published Qwen3-MoE recipe
    (fixtures/automodel/qwen3_moe_30b_hellaswag.yaml) with Qwen3-30B-A3B's config.json, read by 0.5.0's own loader,
    parallelized by its own parallelizer: the router gets no gradient under EP (NVIDIA-NeMo/Automodel#2995), in the
    float32 row (exactly zero while the output is right) and the bf16 row (None while the loss is right)."""
    from pathlib import Path

    fixtures = Path(__file__).resolve().parent / "fixtures"
    folder = side_install("nemo-automodel-0.5.0", ["nemo-automodel==0.5.0"], "nemo_automodel/__init__.py")
    done = cli(folder, "--recipe", str(fixtures / "automodel" / "qwen3_moe_30b_hellaswag.yaml"), "--hf-config",
               str(fixtures / "hf" / "qwen3_30b_a3b.json"), "-n", "2", "--json", results=tmp_path)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 1, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert [(r["check"], r["version"], r["verdict"], r["diagnosis_name"]) for r in summary["rows"]] == [
        ("automodel/qwen3_moe/torch_mm/ep=2/w2/recipe", "0.5.0", "fail", "router-detached"),
        ("automodel/qwen3_moe/torch_mm/ep=2/w2/recipe+bf16", "0.5.0", "fail", "router-detached")]
    assert "output right" in summary["rows"][0]["diagnosis"]
    assert summary["setup"]["settings"]["automodel"]["ep_size"] == 8  # the recipe's, verified at 2

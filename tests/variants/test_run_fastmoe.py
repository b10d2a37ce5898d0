"""`moebench run fastmoe` end to end: bad input, the quick run's files, reproducibility, ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from moebench import results
from moebench.cli.app import app

runner = CliRunner()
# Same float32 ops in a different grouping (per-rank means, then all_reduce): a few ulps per step.
LOSS_CURVE_ATOL = 1e-5
FAST = ["--steps", "6"]


def _resolve(overrides: dict, preset: str = "quick"):
    """The resolved fastmoe config of a preset with flat field overrides ({"world_size": 2})."""
    from moebench import config as config_tree
    from moebench import variants

    variant = variants.by_name("fastmoe")
    paths = {spec.path[-1]: spec.path for spec in config_tree.leaves(variant.config_cls)}
    return variants.resolve_config(variant, preset, {paths[k]: v for k, v in overrides.items()})


def _run_json(*args: str) -> dict:
    result = runner.invoke(app, ["run", "fastmoe", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args,flag", [
    (["--experts", "6", "--world-size", "4"], "--world-size"),
    (["--experts", "8", "--top-k", "9"], "--top-k"),
    (["--d-model", "30", "--heads", "4"], "--heads"),
    (["--gate", "switch", "--top-k", "2"], "--top-k"),
    (["--gate", "gshard", "--top-k", "1"], "--top-k"),
    (["--gate", "bogus"], "--gate"),
    (["--steps", "0"], "--steps"),
    (["--d-hidden", "-3"], "--d-hidden"),
    (["--batch-size", "6", "--world-size", "4"], "--batch-size"),
    (["--lr", "0"], "--lr"),
    (["--preset", "nope"], "--preset"),
    (["--moe-impl", "fmoe"], "--moe-impl"),
    (["--moe-impl", "magic"], "--moe-impl"),
    (["--epochs", "0"], "--epochs"),
    (["--samples", "8", "--batch-size", "16"], "--samples"),
    (["--world-size", "65"], "--world-size"),
    (["--ds-config", "x.json"], "--ds-config"),
    (["--device", "tpu"], "--device"),
    (["--device", "cuda"], "--device"),
    (["--seed", "18446744073709551616"], "--seed"),
    (["--seed", "-1"], "--seed"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--aux-loss-coef", "nan"], "--aux-loss-coef"),
    (["--aux-loss-coef", "inf"], "--aux-loss-coef"),
    (["--timeout", "inf"], "--timeout"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(args, flag, tmp_path):
    root = tmp_path / "res"
    result = runner.invoke(app, ["run", "fastmoe", *args, "--results-dir", str(root)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and lines[0].startswith("error: "), result.output
    assert not root.exists()


def test_cuda_needs_a_gpu_per_rank_instead_of_falling_back_to_cpu(monkeypatch):
    import torch
    import torch.distributed as dist

    from moebench.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match="needs 2 CUDA GPUs .* torch sees 1") as err:
        _resolve({"device": "cuda", "world_size": 2, "moe_impl": "reference"})
    assert err.value.flag == "--device"
    # auto picks CUDA only where every rank gets a GPU
    assert _resolve({"device": "auto", "world_size": 2}).launch.device == "cpu"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(UserError, match="needs NCCL"):
        _resolve({"device": "cuda", "world_size": 2, "moe_impl": "reference", "comm_backend": "nccl"})


def test_largest_seed_runs():
    assert _run_json("--steps", "1", "--seed", str(2**63 - 1))["steps"] == 1


def test_fmoe_backend_error_says_why():
    result = runner.invoke(app, ["run", "fastmoe", "--moe-impl", "fmoe"])
    assert "CUDA" in result.output or "not importable" in result.output


def test_quick_run_records_everything():
    summary = _run_json(*FAST)
    run = summary["run_path"]
    files = sorted(os.listdir(run))
    assert files == ["config.json", "env.json", "loss.png", "metrics.jsonl", "params.json", "summary.json"]
    config = results.read_json(f"{run}/config.json")
    assert config["moe"]["moe_impl"] == "reference" == summary["moe_impl"]
    # one in-process rank: no process group at all; the default deadline is recorded with it
    assert summary["comm_backend"] == "none" and config["launch"]["device"] == summary["device"] == "cpu"
    assert config["launch"]["timeout_s"] == 1800
    assert results.read_json(f"{run}/params.json")["moe_impl"] == "reference"
    on_disk = results.read_json(f"{run}/summary.json")
    assert on_disk["status"] == "ok" and on_disk["loss"] == summary["loss"]
    metrics = results.read_jsonl(f"{run}/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert [m["loss"] for m in metrics] == summary["losses"]
    assert {m["moe_impl"] for m in metrics} == {"reference"}
    # Every slot goes somewhere: routed tokens per layer sum to batch * seq * top_k.
    per_step = config["train"]["batch_size"] * config["train"]["seq_len"] * config["moe"]["top_k"]
    assert all(sum(layer) == per_step for m in metrics for layer in m["tokens_per_expert"])
    assert summary["routing"]["dropped"] == 0  # the naive gate drops nothing
    params = summary["params"]["by_category"]
    assert params["moe"] == params["experts"] + params["gate"]
    assert summary["params"]["total"] == params["moe"] + params["attention"] + params["norm"] + params.get("other", 0)
    assert summary["loss"]["last"] < summary["loss"]["first"] and summary["test"]["loss"] > 0
    assert summary["tokens_per_s_steady"] > 0 and summary["warmup_steps"] == 2
    assert [row["key"] for row in summary["chapter_comparison"]][:2] == ["params.total", "params.by_category.moe"]


def test_same_seed_same_loss_curve_bit_for_bit():
    assert _run_json(*FAST)["losses"] == _run_json(*FAST)["losses"]
    assert _run_json(*FAST, "--seed", "1")["losses"] != _run_json(*FAST)["losses"]


@pytest.mark.parametrize("gate,k", [("gshard", "2"), ("switch", "1"), ("noisy", "2")])
def test_other_gates_train_with_aux_loss(gate, k):
    args = ("--steps", "3", "--gate", gate, "--top-k", k)
    with_aux = _run_json(*args, "--aux-loss-coef", "0.01")
    metrics = results.read_jsonl(f"{with_aux['run_path']}/metrics.jsonl")
    assert len(metrics) == 3 and all(m["aux_loss"] > 0 for m in metrics)  # a real balance loss
    without = _run_json(*args, "--aux-loss-coef", "0")
    # same weights, data and noise: step 1 (before any update) agrees, then the aux gradient shows
    assert without["losses"][0] == with_aux["losses"][0]
    assert without["losses"][1:] != with_aux["losses"][1:]


@pytest.mark.multirank
def test_gate_noise_differs_per_rank(monkeypatch):
    """Every rank builds the same weights from the seed; what it draws while training must not be
    the same stream on every rank (fastmoe draws per rank). Probe: the generator right after training."""
    from moebench import config as config_tree
    from moebench.distributed.launch import launch
    from moebench.variants.fastmoe import rank as fastmoe_rank

    real_loop = fastmoe_rank.train_loop

    def probed_loop(step_fn, spec, **kwargs):
        import torch

        history = real_loop(step_fn, spec, **kwargs)
        return {**history, "losses": [*history["losses"], *torch.rand(4).tolist()]}

    monkeypatch.setattr(fastmoe_rank, "train_loop", probed_loop)  # forked ranks inherit it
    config = _resolve({"steps": 2, "gate": "switch", "top_k": 1, "world_size": 2})
    result = launch(fastmoe_rank.train_rank, 2, args=(None, config_tree.as_dict(config), False),
                    timeout_s=300, label="noise probe")
    assert result.status == "ok", result.describe()
    probes = [summary["losses"][-4:] for summary in result.returns]
    assert probes[0] != probes[1]


@pytest.mark.multirank
def test_two_ranks_follow_the_one_process_loss_curve():
    one = _run_json(*FAST)
    two = _run_json(*FAST, "--world-size", "2")
    assert two["world_size"] == 2 and two["params"]["ep_size"] == 2
    assert {**two["params"], "ep_size": 1} == one["params"]  # the global model, counted on 1 or 2 ranks
    assert (
        two["comm_backend"] == results.read_json(f"{two['run_path']}/config.json")["launch"]["comm_backend"] == "gloo"
    )
    assert max(abs(a - b) for a, b in zip(one["losses"], two["losses"])) < LOSS_CURVE_ATOL
    assert abs(one["test"]["loss"] - two["test"]["loss"]) < LOSS_CURVE_ATOL


def test_console_output_names_backend_and_says_a_quick_run_is_not_the_chapter():
    result = runner.invoke(app, ["run", "fastmoe", *FAST])
    assert result.exit_code == 0, result.output
    for text in ("moe_impl reference", "parameters", "not comparable with chapter 6", "test loss", "steady"):
        assert text in result.output


def test_failed_run_with_json_prints_one_json_document(tmp_path, monkeypatch):
    from moebench.variants.fastmoe import rank as fastmoe_rank

    def broken_rank(*args, **kwargs):
        raise RuntimeError("rank 0 broke on purpose")

    monkeypatch.setattr(fastmoe_rank, "train_rank", broken_rank)
    args = ["run", "fastmoe", *FAST, "--results-dir", str(tmp_path)]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "failed" and "rank 0 broke on purpose" in doc["error"]
    assert results.read_json(os.path.join(doc["run_path"], "summary.json"))["error"] == doc["error"]
    human = runner.invoke(app, args)  # without --json: the root group's message, exit 1
    assert human.exit_code == 1 and "run failed: RuntimeError: rank 0 broke on purpose" in human.output


def test_default_deadline_bounds_a_hang_and_grows_with_the_run():
    from moebench.variants.fastmoe.config import HANG_DEADLINE_FLOOR_S

    assert _resolve({}, "quick").default_timeout_s == HANG_DEADLINE_FLOOR_S == 1800
    chapter = _resolve({}, "chapter")  # 100 steps of 273 M weights: past the floor
    assert chapter.default_timeout_s == pytest.approx(100 * chapter.weights * 6e-7, abs=1)
    long_chapter = _resolve({"steps": 1000}, "chapter")
    assert long_chapter.default_timeout_s == pytest.approx(1000 * long_chapter.weights * 6e-7, abs=1)
    assert long_chapter.default_timeout_s > 1000 * 9  # 9 s a step on 2 idle cores: never cut short


@pytest.mark.slow
def test_chapter_preset_runs_on_cpu(tmp_path):
    """The chapter's 273 M model, real CLI in a subprocess (a few minutes on 2 cores)."""
    out = subprocess.run([sys.executable, "-m", "moebench", "run", "fastmoe", "--preset", "chapter", "--json",
                          "--results-dir", str(tmp_path)], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert round(summary["params"]["by_category"]["moe"] / 1e6, 1) == 268.6
    assert summary["loss"]["last"] < summary["loss"]["first"]


def test_torch_free_config_names_match_the_models():
    """The config keeps torch-free copies of the gate and implementation names (fast --help)."""
    from moebench.models import moe
    from moebench.models.moe import gates
    from moebench.variants.fastmoe import config

    assert config.GATE_NAMES == tuple(gates.GATES) and config.FIXED_TOP_K == gates.FIXED_TOP_K
    assert config.MOE_IMPLS == moe.MOE_IMPLS

"""`moebench run deepspeed`: bad input, dropped-token accounting, and in-process runs (no JIT op)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moebench import deepspeed_run, results
from moebench.cli.app import app
from moebench.errors import UserError

runner = CliRunner()
INITIALIZE_BUDGET_S = 40.0
"""deepspeed.initialize on the default path takes ~1 s idle; building a JIT op cold takes >= 60 s
here, so anything under 40 s (room for other tests sharing the 2 cores) rules a compile out."""


# --------------------------------------------------------------------------- bad input


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BAD_INPUTS = [
    (["--zero-stage", "3"], "--zero-stage", "ZeRO stage 3"),
    (["--world-size", "2", "--ep-size", "3", "--experts", "6"], "--ep-size", "does not divide the world size"),
    (["--world-size", "2", "--ep-size", "2", "--experts", "3"], "--ep-size", "layer 0's 3 experts"),
    (["--experts", "4,8,16"], "--experts", "3 expert counts for 2 MoE layers"),
    (["--experts", "four"], "--experts", "comma list"),
    (["--batch", "1", "--seq", "2", "--min-capacity", "4"], "--min-capacity", "fewer than --min-capacity"),
    (["--noisy-gate-policy", "RSample", "--top-k", "2"], "--noisy-gate-policy", "RSample only applies"),
    (["--noisy-gate-policy", "Gaussian"], "--noisy-gate-policy", "unknown policy"),
    (["--zero-stage", "4"], "--zero-stage", "unknown ZeRO stage 4"),
    (["--zero-stage", "-1"], "--zero-stage", "unknown ZeRO stage -1"),
    (["--backend", "nccl"], "--backend", "nccl on 1 local rank(s) needs CUDA GPUs"),
    (["--backend", "nccl", "--world-size", "2"], "--backend", "use --backend gloo or auto"),
    (["--seed", "18446744073709551616"], "--seed", "from 0 to 2**63-1"),
    (["--seed", "-1"], "--seed", "from 0 to 2**63-1"),
    (["--aux-loss-coef", "nan"], "--aux-loss-coef", "finite"),
    (["--aux-loss-coef", "inf"], "--aux-loss-coef", "finite"),
    (["--lr", "inf"], "--lr", "finite"),
    (["--capacity-factor", "inf"], "--capacity-factor", "finite"),
    (["--eval-capacity-factor", "nan"], "--eval-capacity-factor", "finite"),
    (["--timeout", "inf"], "--timeout", "finite"),
]


@pytest.mark.parametrize("args,flag,text", BAD_INPUTS, ids=[b[1] + ":" + b[2] for b in BAD_INPUTS])
def test_bad_flags_exit_2_with_one_line_and_no_results(tmp_path, args, flag, text):
    root = tmp_path / "results"
    result = runner.invoke(app, ["run", "deepspeed", "--preset", "quick", "--results-dir", str(root), *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag}: ") and text in lines[0], result.output
    assert not root.exists()


DS_CONFIGS = [
    ("{not json", [], "not valid JSON"),
    ("[1, 2]", [], "must hold a JSON object"),
    ('{"zero_optimization": {"stage": 2}}', ["--zero-stage", "1"], "drop one of them"),
    ('{"zero_optimization": {"stage": 3}}', [], "zero_optimization.stage in"),
    ('{"optimizer": {"type": "Adam", "params": {"torch_adam": false}}}', [], "add --compiled-ops"),
    ('{"optimizer": {"type": "Lamb", "params": {"lr": 0.001}}}', [], "optimizer.type='Lamb'"),
    ('{"gradient_accumulation_steps": 4}', [], "gradient_accumulation_steps=4"),
    ('{"train_batch_size": 7}', [], "train_batch_size=7"),
    # a parent of a flag-owned key that is not an object, or a flag-owned value of the wrong type
    ('{"optimizer": "Adam"}', [], "optimizer in"),
    ('{"zero_optimization": 2}', [], "zero_optimization in"),
    ('{"optimizer": {"params": 5}}', [], "optimizer.params in"),
    ('{"optimizer": {"params": {"lr": "abc"}}}', [], "must be a finite number, got 'abc'"),
    ('{"optimizer": {"params": {"lr": 1e999}}}', [], "must be a finite number, got inf"),
    ('{"zero_optimization": {"stage": "2"}}', [], "must be an integer ZeRO stage (0, 1 or 2), got '2'"),
    ('{"zero_optimization": {"stage": 4}}', [], "unknown ZeRO stage 4"),
    ('{"train_micro_batch_size_per_gpu": 2.5}', [], "must be a positive integer, got 2.5"),
    # half precision on the CPU engine fails inside deepspeed.initialize, after the folder exists
    ('{"fp16": {"enabled": true}}', [], "fp16.enabled=true needs a CUDA GPU"),
    ('{"bf16": {"enabled": true}}', [], "bf16.enabled=true needs a CUDA GPU"),
]


@pytest.mark.parametrize("text,args,message", DS_CONFIGS, ids=[d[2] for d in DS_CONFIGS])
def test_bad_ds_config_exits_2_with_one_line_and_no_results(tmp_path, text, args, message):
    root = tmp_path / "results"
    path = _write(tmp_path, "ds.json", text)
    result = runner.invoke(app, ["run", "deepspeed", "--preset", "quick", "--results-dir", str(root),
                                 "--ds-config", path, *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --ds-config: ") and message in lines[0], result.output
    assert not root.exists()


def test_missing_ds_config_and_unknown_preset(tmp_path):
    for args, flag in ((["--ds-config", str(tmp_path / "nope.json")], "--ds-config"), (["--preset", "nope"], "--preset")):
        result = runner.invoke(app, ["run", "deepspeed", "--results-dir", str(tmp_path / "r"), *args])
        assert result.exit_code == 2 and result.output.startswith(f"error: {flag}: "), result.output
    assert not (tmp_path / "r").exists()


def test_nccl_needs_a_gpu_per_rank_and_nccl(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match="needs 2 CUDA GPUs .* torch sees 1") as err:
        deepspeed_run.resolve_config("quick", {"backend": "nccl", "world_size": 2})
    assert err.value.flag == "--backend"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(UserError, match="needs NCCL"):
        deepspeed_run.resolve_config("quick", {"backend": "nccl", "world_size": 2})
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert deepspeed_run.resolve_config("quick", {"backend": "nccl", "world_size": 2}).backend == "nccl"


def test_largest_seed_keeps_every_derived_seed_in_range():
    config = deepspeed_run.resolve_config("quick", {"seed": 2**63 - 1})
    assert deepspeed_run.epoch_order(config, 4).shape == (config.samples,)  # seed * 7919 + epoch
    assert deepspeed_run.random_dataset(config)[0].shape[0] == config.samples
    assert deepspeed_run.held_out_batch(config)[0].shape[0] == config.batch


def test_validation_never_imports_deepspeed():
    code = ("import sys\nfrom moebench import deepspeed_run\nfrom moebench.errors import UserError\n"
            "try:\n    deepspeed_run.resolve_config('chapter', {'zero_stage': 3})\nexcept UserError as e:\n    print(e.flag)\n"
            "deepspeed_run.resolve_config('chapter', {'experts': (4, 8), 'use_residual': True})\n"
            "print('deepspeed' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["--zero-stage", "False"]


# --------------------------------------------------------------------------- the DeepSpeed config


def test_ds_config_file_sits_under_the_flags_and_fills_unset_ones(tmp_path):
    path = _write(tmp_path, "ds.json", json.dumps({
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.9]}},
        "gradient_clipping": 1.0}))
    config = deepspeed_run.resolve_config("quick", {"ds_config_path": path, "lr": 0.01, "world_size": 2})
    ds = deepspeed_run.build_ds_config(config)
    assert config.zero_stage == 2 and config.lr == 0.01  # taken from the file: no flag said otherwise
    assert ds["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    assert ds["optimizer"]["params"] == {"lr": 0.01, "weight_decay": 0.0, "adam_w_mode": False,
                                         "torch_adam": True, "betas": [0.8, 0.9]}
    assert ds["gradient_clipping"] == 1.0 and ds["train_batch_size"] == 2 * config.batch
    assert deepspeed_run.compiled_op_settings(ds) == []


def test_compiled_ops_opt_in_restores_deepspeeds_fused_adam():
    default = deepspeed_run.build_ds_config(deepspeed_run.resolve_config("quick", {}))
    opted = deepspeed_run.build_ds_config(deepspeed_run.resolve_config("quick", {"compiled_ops": True}))
    assert default["optimizer"]["params"]["torch_adam"] is True
    assert "torch_adam" not in opted["optimizer"]["params"]
    assert deepspeed_run.compiled_op_settings(opted) == ["optimizer.params.torch_adam=false (FusedAdam)"]


def test_config_rejects_what_the_cli_cannot_express_too():
    with pytest.raises(UserError) as err:
        deepspeed_run.DeepSpeedRunConfig(samples=10, batch=8, world_size=2)
    assert err.value.flag == "--samples"


# --------------------------------------------------------------------------- dropped tokens


def _hand_routed_layer(top_k: int):
    """2 experts; gate = the first two input features, so token i goes where x[i, :2] points."""
    from moebench.models.deepspeed_moe import DeepSpeedMoEMLP, MoELayerSpec

    spec = MoELayerSpec(d_model=4, d_hidden=8, experts=2, top_k=top_k, capacity_factor=0.5, min_capacity=0,
                        use_rts=False, top2_2nd_expert_sampling=False)
    layer = DeepSpeedMoEMLP(spec)
    with torch.no_grad():
        layer.gate_weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))
    x = torch.zeros(1, 8, 4)
    x[0, :6, 0] = 1.0  # tokens 0-5 prefer expert 0
    x[0, 6:, 1] = 1.0  # tokens 6-7 prefer expert 1
    x[0, :, 2] = torch.arange(1.0, 9.0)
    return layer, x


def test_dropped_tokens_top1_match_a_hand_made_routing():
    # capacity = ceil(8 tokens / 2 experts x 0.5) = 2: expert 0 keeps 2 of its 6 tokens, expert 1 both.
    layer, x = _hand_routed_layer(top_k=1)
    y, _ = layer(x)
    rec = layer.last
    assert rec.capacity == 2 and rec.routes == 8 and rec.dropped == 4
    assert rec.tokens == 8 and rec.dropped_tokens == 4  # k=1: a dropped route is a dropped token
    assert rec.exp_counts.tolist() == [6, 2] and rec.kept_per_expert.tolist() == [2, 2]
    # independent of the gate's masks: a dropped token gets an all-zero MoE output
    assert int((y[0].abs().sum(-1) == 0).sum()) == 4


def test_dropped_tokens_top2_match_a_hand_made_routing():
    # capacity = ceil(8 / 2 x 0.5 x 2) = 4 slots. Expert 0: 6 first choices then 2 second choices ->
    # keeps 4 (first choices only); expert 1: 2 first choices then 6 second -> keeps 2 + 2.
    # Routes dropped: 8 of 16. Tokens dropped: only 4 and 5 lost both routes (first choice past
    # expert 0's 4 slots, second choice past expert 1's 2 + tokens 0-1): 2 of 8.
    layer, x = _hand_routed_layer(top_k=2)
    y, _ = layer(x)
    rec = layer.last
    assert rec.capacity == 4 and rec.routes == 16 and rec.dropped == 8
    assert rec.tokens == 8 and rec.dropped_tokens == 2
    assert rec.exp_counts.tolist() == [8, 8] and rec.kept_per_expert.tolist() == [4, 4]
    assert torch.nonzero(y[0].abs().sum(-1) == 0).flatten().tolist() == [4, 5]
    fractions = deepspeed_run._drop_fractions(rec.routes, rec.dropped, rec.tokens, rec.dropped_tokens)
    assert fractions["dropped_route_frac"] == 0.5 and fractions["dropped_token_frac"] == 0.25

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rule against a faked CUDA")
def test_half_precision_is_allowed_where_deepspeed_runs_on_cuda(tmp_path, monkeypatch):
    path = _write(tmp_path, "ds.json", '{"fp16": {"enabled": true}, "bf16": {"enabled": false}}')
    with pytest.raises(UserError, match="fp16.enabled=true needs a CUDA GPU"):
        deepspeed_run.resolve_config("quick", {"ds_config_path": path})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = deepspeed_run.resolve_config("quick", {"ds_config_path": path})
    assert deepspeed_run.build_ds_config(config)["fp16"] == {"enabled": True}


def test_default_deadline_bounds_a_hang_and_grows_with_the_run():
    quick, chapter = deepspeed_run.resolve_config("quick", {}), deepspeed_run.resolve_config("chapter", {})
    assert quick.timeout_s == deepspeed_run.HANG_DEADLINE_FLOOR_S == 1800
    # the chapter run (200 steps of ~36 M weights) gets a little more than the floor, not an hour
    assert 1800 < chapter.timeout_s < 2400
    longer = deepspeed_run.resolve_config("chapter", {"epochs": 50})
    assert longer.timeout_s == pytest.approx(10 * chapter.timeout_s, rel=1e-3)
    assert deepspeed_run.resolve_config("chapter", {"timeout_s": 5.0}).timeout_s == 5.0


def test_comm_backend_is_what_launch_resolves(monkeypatch):
    import torch.distributed as dist

    assert deepspeed_run.comm_backend(deepspeed_run.resolve_config("quick", {})) == "gloo"
    assert deepspeed_run.comm_backend(deepspeed_run.resolve_config("quick", {"world_size": 2})) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert deepspeed_run.comm_backend(deepspeed_run.resolve_config("quick", {"world_size": 2})) == "nccl"
    assert deepspeed_run.comm_backend(deepspeed_run.resolve_config("quick", {"world_size": 2,
                                                                          "backend": "gloo"})) == "gloo"


def test_failed_run_with_json_prints_one_json_document(tmp_path, monkeypatch):
    def broken_rank(*args, **kwargs):
        raise RuntimeError("rank 0 broke on purpose")

    monkeypatch.setattr(deepspeed_run, "deepspeed_rank", broken_rank)
    root = tmp_path / "results"
    args = ["run", "deepspeed", "--preset", "quick", "--results-dir", str(root)]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "failed" and "rank 0 broke on purpose" in doc["error"]
    assert results.read_json(Path(doc["run_path"]) / "summary.json")["error"] == doc["error"]
    human = runner.invoke(app, args)  # without --json: the root group's message, exit 1
    assert human.exit_code == 1 and "run failed: RuntimeError: rank 0 broke on purpose" in human.output
    assert "1 rank(s) over gloo" in human.output  # the console header names the comm backend


# --------------------------------------------------------------------------- in-process runs


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """Two quick in-process runs, with every DeepSpeed op build refused and a private extensions dir."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.builder import OpBuilder

    ext = tmp_path_factory.mktemp("torch_extensions")
    root = tmp_path_factory.mktemp("results")
    calls: list[str] = []
    shm_before = deepspeed.ops.__compatible_ops__.get(deepspeed_run.SHM_COMM_OP)

    def refuse(self, *args, **kwargs):
        calls.append(self.name)
        raise AssertionError(f"DeepSpeed tried to build op {self.name}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", str(ext))
        mp.setattr(OpBuilder, "load", refuse)
        mp.setattr(OpBuilder, "jit_load", refuse)
        config = deepspeed_run.resolve_config("quick", {})
        outcomes = [deepspeed_run.run(config, results_root=root, show_progress=False) for _ in range(2)]
    return {"outcomes": outcomes, "calls": calls, "ext": ext, "shm_before": shm_before, "config": config}


def test_quick_run_writes_every_file(quick_runs):
    outcome = quick_runs["outcomes"][0]
    assert sorted(p.name for p in outcome.run_path.iterdir()) == [
        "config.json", "env.json", "loss.png", "metrics.jsonl", "params.json", "summary.json"]
    summary = results.read_json(outcome.run_path / "summary.json")
    config = quick_runs["config"]
    assert summary["status"] == "ok" and summary["world_size"] == 1
    assert len(summary["epoch_loss"]) == config.epochs
    metrics = results.read_jsonl(outcome.run_path / "metrics.jsonl")
    assert len(metrics) == config.epochs * config.steps_per_epoch
    first_epoch = [m["loss"] for m in metrics if m["epoch"] == 1]
    assert summary["epoch_loss"][0] == pytest.approx(sum(first_epoch) / len(first_epoch))
    assert summary["test"]["input_shape"] == summary["test"]["output_shape"] == [config.batch, config.seq, config.d_model]
    assert [r["key"] for r in summary["chapter_comparison"]] == ["epoch_loss.1", "epoch_loss.5"]
    recorded = results.read_json(outcome.run_path / "config.json")
    assert recorded["ds_config"]["optimizer"]["params"]["torch_adam"] is True
    # the comm backend: predicted in config.json, what really ran in summary.json (not "auto")
    assert recorded["backend"] == "auto" and recorded["comm_backend"] == summary["comm_backend"] == "gloo"
    assert recorded["timeout_s"] == deepspeed_run.HANG_DEADLINE_FLOOR_S


def test_quick_run_routing_counts_add_up(quick_runs):
    summary = quick_runs["outcomes"][0].summary
    config = quick_runs["config"]
    routes_per_layer = config.epochs * config.steps_per_epoch * config.batch * config.seq * config.top_k
    for layer in summary["routing"]["per_layer"]:
        assert layer["routes"] == sum(layer["exp_counts"]) == routes_per_layer
        assert sum(layer["tokens_kept_per_expert"]) == routes_per_layer - layer["dropped"]
        steps = config.epochs * config.steps_per_epoch
        assert all(k <= layer["capacity_per_expert"] * steps for k in layer["tokens_kept_per_expert"])
        assert all(k <= c for k, c in zip(layer["tokens_kept_per_expert"], layer["exp_counts"]))
        assert layer["capacity_per_expert"] == max(config.min_capacity,
                                                   -(-config.batch * config.seq * config.capacity_factor // layer["experts"]))
        assert layer["tokens"] == steps * config.batch * config.seq
        assert layer["dropped_tokens"] == layer["dropped"]  # top-1
    total = summary["routing"]
    assert total["dropped"] > 0  # the quick run drops at capacity 1.0: the fractions are not vacuous
    assert total["dropped_route_frac"] == pytest.approx(total["dropped"] / total["routes"])
    assert total["dropped_token_frac"] == pytest.approx(total["dropped_tokens"] / total["tokens"])
    metrics = results.read_jsonl(quick_runs["outcomes"][0].run_path / "metrics.jsonl")
    assert {m["backend"] for m in metrics} == {"deepspeed"}
    # every step routes the same number of tokens, so the step fractions average to the total
    mean = sum(m["dropped_route_frac"] for m in metrics) / len(metrics)
    assert mean == pytest.approx(total["dropped_route_frac"])
    assert all(m["dropped_token_frac"] == m["dropped_route_frac"] for m in metrics)


def test_params_split_by_category(quick_runs):
    outcome = quick_runs["outcomes"][0]
    params = results.read_json(outcome.run_path / "params.json")
    config = quick_runs["config"]
    d, h, e, layers = config.d_model, config.d_hidden, config.experts[0], config.layers
    cats = params["by_category"]
    assert cats["experts"] == layers * e * (d * h + h + h * d + d)
    assert cats["gate"] == layers * d * e  # wg has no bias
    assert cats["attention"] == layers * (4 * d * d + 4 * d) and cats["norm"] == layers * 4 * d
    assert "residual" not in cats and "coefficient" not in cats


def test_default_path_builds_no_jit_op(quick_runs):
    import deepspeed.ops

    assert quick_runs["calls"] == []
    assert list(quick_runs["ext"].iterdir()) == []
    timings = quick_runs["outcomes"][0].summary["timings"]
    assert timings["deepspeed_initialize_s"] < INITIALIZE_BUDGET_S
    # the shm op is disabled only for the run, then DeepSpeed's own verdict is restored
    assert deepspeed.ops.__compatible_ops__.get(deepspeed_run.SHM_COMM_OP) == quick_runs["shm_before"]


def test_same_seed_same_loss_curve_bit_for_bit(quick_runs):
    first, second = (results.read_jsonl(o.run_path / "metrics.jsonl") for o in quick_runs["outcomes"])
    assert [m["loss"] for m in first] == [m["loss"] for m in second]
    assert [m["aux_loss"] for m in first] == [m["aux_loss"] for m in second]


def test_pyramid_with_residual_through_the_cli(tmp_path, quick_runs):
    root = tmp_path / "results"
    result = runner.invoke(app, ["run", "deepspeed", "--preset", "quick", "--experts", "4,8", "--use-residual",
                                 "--epochs", "1", "--results-dir", str(root), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # stdout holds the JSON alone; DeepSpeed's chatter is on stderr
    assert summary["status"] == "ok" and summary["experts_per_layer"] == [4, 8]
    assert [layer["experts"] for layer in summary["routing"]["per_layer"]] == [4, 8]
    d, h = 64, 128
    params = summary["params"]
    assert params["experts"] == (4 + 8) * (2 * d * h + h + d)
    assert params["residual"] == 2 * (2 * d * h + h + d) and params["coefficient"] == 2 * (2 * d + 2)
    assert params["gate"] == (4 + 8) * d
    assert Path(summary["run_path"]).parent == root / "deepspeed"

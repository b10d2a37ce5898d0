"""`moebench run deepspeed`: bad input, dropped-token accounting, and in-process runs (no JIT op)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_config
from typer.testing import CliRunner

from moebench import published, results
from moebench.cli.app import app
from moebench.errors import UserError
from moebench.variants.deepspeed import comm as ds_comm
from moebench.variants.deepspeed import ds_config as ds_config_mod

runner = CliRunner()
INITIALIZE_BUDGET_S = 40.0
"""deepspeed.initialize on the default path takes ~1 s idle; building a JIT op cold takes >= 60 s
here, so anything under 40 s (room for other tests sharing the 2 cores) rules a compile out."""


# --------------------------------------------------------------------------- bad input


def _resolve(**flat):
    """The resolved deepspeed config of the quick preset with flat field overrides."""
    from moebench import config as config_tree
    from moebench import variants

    variant = variants.by_name("deepspeed")
    paths = {spec.path[-1]: spec.path for spec in config_tree.leaves(variant.config_cls)}
    return variants.resolve_config(variant, "quick", {paths[k]: v for k, v in flat.items()})


def _write(tmp_path: Path, name: str, text: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


BAD_INPUTS = [
    (["--zero-stage", "3"], "--zero-stage", "ZeRO stage 3"),
    (["--world-size", "2", "--ep-size", "3", "--experts", "6"], "--ep-size", "does not divide the world size"),
    (["--world-size", "2", "--ep-size", "2", "--experts", "3"], "--ep-size", "layer 0's 3 experts"),
    (["--experts", "4,8,16"], "--experts", "3 expert counts for 2 MoE layers"),
    (["--experts", "four"], "--experts", "comma list"),
    (["--batch-size", "1", "--seq-len", "2", "--min-capacity", "4"], "--min-capacity", "fewer than --min-capacity"),
    (["--noisy-gate-policy", "RSample", "--top-k", "2"], "--noisy-gate-policy", "RSample only applies"),
    (["--noisy-gate-policy", "Gaussian"], "--noisy-gate-policy", "Gaussian"),
    (["--zero-stage", "4"], "--zero-stage", "unknown ZeRO stage 4"),
    (["--zero-stage", "-1"], "--zero-stage", "unknown ZeRO stage -1"),
    (["--comm-backend", "nccl"], "--comm-backend", "nccl on 1 local rank(s) needs CUDA GPUs"),
    (["--comm-backend", "nccl", "--world-size", "2"], "--comm-backend", "use --comm-backend gloo or auto"),
    (["--ds-config", ""], "--ds-config", "is empty"),
    (["--train-batches", "2"], "--train-batches", "No such option"),
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
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0] and text in lines[0], result.output
    assert not root.exists()


DS_CONFIGS = [
    ("{not json", [], "not valid JSON"),
    ("[1, 2]", [], "holds a list, not a JSON object"),
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
    ('{"optimizer": {"params": {"lr": "abc"}}}', [], "must be a number, got 'abc'"),
    ('{"optimizer": {"params": {"lr": 1e999}}}', [], "holds a number beyond float range"),
    ('{"zero_optimization": {"stage": "2"}}', [], "zero_optimization.stage in"),  # "must be a whole number"
    ('{"zero_optimization": {"stage": 4}}', [], "must be at most 3 (DeepSpeed's stages), got 4"),
    ('{"train_micro_batch_size_per_gpu": 2.5}', [], "must be a whole number, got 2.5"),
    ('{"train_micro_batch_size_per_gpu": 4}', ["--batch-size", "16"], "drop one of them"),
    (b"\xff\xfe{}", [], "not UTF-8"),
    ('{"optimizer": {"type": "Frobnicate"}}', [], "is neither a DeepSpeed optimizer"),
    ('{"scheduler": {"type": "Cosine"}}', [], 'scheduler.type="Cosine" in'),
    ('{"scheduler": 5}', [], "scheduler in"),
    ('{"zero_optimization": {"reduce_bucket_size": "lots"}}', [], "zero_optimization.reduce_bucket_size in"),
    ('{"zero_optimization": {"no_such_knob": 1}}', [], "zero_optimization.no_such_knob in"),
    ("[" * 5000 + "]" * 5000, [], "nests deeper than"),
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
    for args, flag in (
        (["--ds-config", str(tmp_path / "nope.json")], "--ds-config"),
        (["--preset", "nope"], "--preset"),
    ):
        result = runner.invoke(app, ["run", "deepspeed", "--results-dir", str(tmp_path / "r"), *args])
        assert result.exit_code == 2 and result.output.startswith(f"error: {flag}: "), result.output
    assert not (tmp_path / "r").exists()


def test_nccl_needs_a_gpu_per_rank_and_nccl(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    from moebench.distributed.launch import resolve_placement

    with pytest.raises(UserError, match="needs 2 CUDA GPUs .* torch sees 1") as err:
        resolve_placement(2, "cuda", "nccl")
    assert err.value.flag == "--device"
    with pytest.raises(UserError, match="needs 2 CUDA GPUs .* torch sees 1") as err:
        resolve_placement(2, "auto", "nccl")  # auto stays on the CPU: nccl cannot follow it there
    assert err.value.flag == "--comm-backend"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(UserError, match="needs NCCL"):
        resolve_placement(2, "cuda", "nccl")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert resolve_placement(2, "auto", "nccl") == ("cuda", "nccl")


def test_largest_seed_keeps_every_derived_seed_in_range():
    from moebench import data

    train = make_config("deepspeed", seed=2**63 - 1).train
    assert data.epoch_order(train, 4).shape == (train.samples,)  # seed * 7919 + epoch
    assert data.random_dataset(train, 8)[0].shape[0] == train.samples
    assert data.held_out_batch(train, 8)[0].shape[0] == train.batch_size


def test_validation_never_imports_deepspeed():
    code = ("import sys\nfrom helpers import make_config\nfrom moebench.errors import UserError\n"
            "try:\n    make_config('deepspeed', 'chapter', zero_stage=3)\nexcept UserError as e:\n    print(e.flag)\n"
            "from moebench import variants\n"
            "variants.resolve_config(variants.by_name('deepspeed'), 'chapter', {('moe', 'experts'): '4,8'})\n"
            "print('deepspeed' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["--zero-stage", "False"]


# --------------------------------------------------------------------------- the DeepSpeed config


def test_ds_config_file_sits_under_the_flags_and_fills_unset_ones(tmp_path):
    path = _write(tmp_path, "ds.json", json.dumps({
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.9]}},
        "gradient_clipping": 1.0}))
    config = _resolve(ds_config=path, lr=0.01, world_size=2)
    ds = ds_config_mod.build_ds_config(config)
    assert config.engine.zero_stage == 2 and config.train.lr == 0.01  # from the file: no flag said otherwise
    assert ds["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    assert ds["optimizer"]["params"] == {"lr": 0.01, "weight_decay": 0.0, "adam_w_mode": False,
                                         "torch_adam": True, "betas": [0.8, 0.9]}
    assert ds["gradient_clipping"] == 1.0 and ds["train_batch_size"] == 2 * config.batch_per_rank
    assert ds_config_mod.compiled_op_settings(ds) == []


def test_compiled_ops_opt_in_restores_deepspeeds_fused_adam():
    default = ds_config_mod.build_ds_config(_resolve())
    opted = ds_config_mod.build_ds_config(_resolve(compiled_ops=True))
    assert default["optimizer"]["params"]["torch_adam"] is True
    assert "torch_adam" not in opted["optimizer"]["params"]
    assert ds_config_mod.compiled_op_settings(opted) == ["optimizer.params.torch_adam=false (FusedAdam)"]


def test_config_rejects_what_the_cli_cannot_express_too():
    with pytest.raises(UserError) as err:
        make_config("deepspeed", samples=10, batch_size=16, world_size=2)
    assert err.value.flag == "--samples"


# --------------------------------------------------------------------------- dropped tokens


def _hand_routed_layer(top_k: int):
    """2 experts; gate = the first two input features, so token i goes where x[i, :2] points."""
    from moebench.models.deepspeed_moe import DeepSpeedMoEMLP
    from moebench.variants.deepspeed.config import DeepSpeedMoEConfig

    moe = DeepSpeedMoEConfig(experts=(2,), d_hidden=8, top_k=top_k, capacity_factor=0.5, eval_capacity_factor=0.5,
                             min_capacity=0, noisy_gate_policy="none", use_residual=False, drop_tokens=True,
                             use_rts=False, ep_size=1)
    layer = DeepSpeedMoEMLP(moe, d_model=4, experts=2, top2_2nd_expert_sampling=False)
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
    from moebench.variants.deepspeed.routing import drop_fractions

    fractions = drop_fractions(rec.routes, rec.dropped, rec.tokens, rec.dropped_tokens)
    assert fractions["dropped_route_frac"] == 0.5 and fractions["dropped_token_frac"] == 0.25

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU rule against a faked CUDA")
def test_half_precision_is_allowed_where_deepspeed_runs_on_cuda(tmp_path, monkeypatch):
    path = _write(tmp_path, "ds.json", '{"fp16": {"enabled": true}, "bf16": {"enabled": false}}')
    with pytest.raises(UserError, match="fp16.enabled=true needs a CUDA GPU"):
        _resolve(ds_config=path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # what prepare() sets where CUDA is there
    config = make_config("deepspeed", ds_config=path)
    assert ds_config_mod.build_ds_config(config)["fp16"] == {"enabled": True}


def test_default_deadline_bounds_a_hang_and_grows_with_the_run():
    from moebench.variants.deepspeed.config import HANG_DEADLINE_FLOOR_S

    quick, chapter = make_config("deepspeed"), make_config("deepspeed", "chapter")
    assert quick.default_timeout_s == HANG_DEADLINE_FLOOR_S == 1800
    # the chapter run (200 steps of ~36 M weights) gets a little more than the floor, not an hour
    assert 1800 < chapter.default_timeout_s < 2400
    longer = make_config("deepspeed", "chapter", epochs=50)
    assert longer.default_timeout_s == pytest.approx(10 * chapter.default_timeout_s, rel=1e-3)
    assert make_config("deepspeed", "chapter", timeout_s=5.0).launch.timeout_s == 5.0


def test_comm_backend_is_what_launch_resolves(monkeypatch):
    import torch.distributed as dist

    assert _resolve().launch.comm_backend == "gloo"
    assert _resolve(world_size=2).launch.comm_backend == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert _resolve(world_size=2).launch.comm_backend == "nccl"
    assert _resolve(world_size=2, comm_backend="gloo").launch.comm_backend == "gloo"


def test_failed_run_with_json_prints_one_json_document(tmp_path, monkeypatch):
    def broken_rank(*args, **kwargs):
        raise RuntimeError("rank 0 broke on purpose")

    from moebench.variants.deepspeed import rank as ds_rank

    monkeypatch.setattr(ds_rank, "train_rank", broken_rank)
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
    assert "Setting accelerator" not in human.output and "No existing process group" not in human.output


# --------------------------------------------------------------------------- in-process runs


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """Two quick in-process runs, with every DeepSpeed op build refused and a private extensions dir."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.builder import OpBuilder

    ext = tmp_path_factory.mktemp("torch_extensions")
    root = tmp_path_factory.mktemp("results")
    calls: list[str] = []
    shm_before = deepspeed.ops.__compatible_ops__.get(ds_comm.SHM_COMM_OP)

    def refuse(self, *args, **kwargs):
        calls.append(self.name)
        raise AssertionError(f"DeepSpeed tried to build op {self.name}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", str(ext))
        mp.setattr(OpBuilder, "load", refuse)
        mp.setattr(OpBuilder, "jit_load", refuse)
        from moebench import train, variants

        config = _resolve()
        variant = variants.by_name("deepspeed")
        outcomes = [train.run_variant(variant, config, results_root=root, show_progress=False) for _ in range(2)]
    return {"outcomes": outcomes, "calls": calls, "ext": ext, "shm_before": shm_before, "config": config}


def test_quick_run_writes_every_file(quick_runs):
    outcome = quick_runs["outcomes"][0]
    assert sorted(p.name for p in outcome.run_path.iterdir()) == [
        "config.json", "env.json", "loss.png", "metrics.jsonl", "params.json", "summary.json"]
    summary = results.read_json(outcome.run_path / "summary.json")
    config = quick_runs["config"]
    assert summary["status"] == "ok" and summary["world_size"] == 1
    assert len(summary["epoch_loss"]) == config.train.epochs
    metrics = results.read_jsonl(outcome.run_path / "metrics.jsonl")
    assert len(metrics) == config.train.total_steps
    first_epoch = [m["loss"] for m in metrics if m["epoch"] == 1]
    assert summary["epoch_loss"][0] == pytest.approx(sum(first_epoch) / len(first_epoch))
    assert summary["test"]["input_shape"] == summary["test"]["output_shape"] == [
        config.train.batch_size, config.train.seq_len, config.model.d_model]
    assert [r["key"] for r in summary["chapter_comparison"]] == [fig.key for fig in published.DEEPSPEED]
    recorded = results.read_json(outcome.run_path / "config.json")
    assert summary["ds_config"]["optimizer"]["params"]["torch_adam"] is True
    # the comm backend: resolved in config.json, what really ran in summary.json (not "auto")
    assert recorded["launch"]["comm_backend"] == summary["comm_backend"] == "gloo"
    assert recorded["launch"]["timeout_s"] == 1800


def test_quick_run_routing_counts_add_up(quick_runs):
    summary = quick_runs["outcomes"][0].summary
    config = quick_runs["config"]
    total = summary["routing"]
    steps, tokens_per_step = config.train.total_steps, config.train.tokens_per_step
    routes_per_layer = steps * tokens_per_step * config.moe.top_k
    for layer in summary["routing"]["per_layer"]:
        assert layer["routes"] == sum(layer["exp_counts"]) == routes_per_layer
        assert sum(layer["tokens_kept_per_expert"]) == routes_per_layer - layer["dropped"]
        assert all(k <= layer["capacity_per_expert"] * steps for k in layer["tokens_kept_per_expert"])
        assert all(k <= c for k, c in zip(layer["tokens_kept_per_expert"], layer["exp_counts"]))
        assert layer["capacity_per_expert"] == max(
            config.moe.min_capacity, -(-tokens_per_step * config.moe.capacity_factor // layer["experts"])
        )
        assert layer["tokens"] == steps * tokens_per_step == total["tokens_per_layer"]
        assert layer["dropped_tokens"] == layer["dropped"]  # top-1
    assert total["dropped"] > 0  # the quick run drops at capacity 1.0: the fractions are not vacuous
    assert total["dropped_route_frac"] == pytest.approx(total["dropped"] / total["routes"])
    layers = total["per_layer"]
    assert total["dropped_token_frac"] == pytest.approx(
        sum(r["dropped_tokens"] for r in layers) / sum(r["tokens"] for r in layers))
    metrics = results.read_jsonl(quick_runs["outcomes"][0].run_path / "metrics.jsonl")
    assert {m["moe_impl"] for m in metrics} == {"deepspeed"}
    # every step routes the same number of tokens, so the step fractions average to the total
    mean = sum(m["dropped_route_frac"] for m in metrics) / len(metrics)
    assert mean == pytest.approx(total["dropped_route_frac"])
    assert all(m["dropped_token_frac"] == m["dropped_route_frac"] for m in metrics)


def test_params_split_by_category(quick_runs):
    outcome = quick_runs["outcomes"][0]
    params = results.read_json(outcome.run_path / "params.json")
    config = quick_runs["config"]
    d, h, e, layers = config.model.d_model, config.moe.d_hidden, config.moe.experts[0], config.model.layers
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
    assert deepspeed.ops.__compatible_ops__.get(ds_comm.SHM_COMM_OP) == quick_runs["shm_before"]


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
    params = summary["params"]["by_category"]
    assert params["experts"] == (4 + 8) * (2 * d * h + h + d)
    assert params["residual"] == 2 * (2 * d * h + h + d) and params["coefficient"] == 2 * (2 * d + 2)
    assert params["gate"] == (4 + 8) * d
    assert Path(summary["run_path"]).parent == root / "deepspeed"

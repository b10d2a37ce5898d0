"""verify-parity --torchtitan-args: a torchtitan launch (torchtitan's own published configs, tests/libraries/fixtures/
torchtitan/) read by torchtitan's ConfigManager into the user rows; each kept setting family changes the rows and
what they compute (a wrong implementation of it fails); the EP+TP launch on the default backend gives torchtitan
0.3.0's grad-left-partial; bad input is one line naming the flag, exit 2, nothing under results/."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moebench.cli.app import app
from moebench.errors import UserError
from moebench.libraries.torchtitan import ADAPTER, TRAIN, user_layout

FIXTURES = Path(__file__).parent / "fixtures" / "torchtitan"
LAUNCHES = [line for line in (FIXTURES / "launches.txt").read_text().splitlines() if line.strip()]
DS16B = LAUNCHES[0]
"""--module deepseek_v3 --config deepseek_v3_16b --parallelism.expert_parallel_degree 8 --training.max_norm 1.0"""
INSTALLED = importlib.util.find_spec("torchtitan") is not None and all(
    importlib.util.find_spec(m) is not None for m in ("spmd_types", "tyro", "docstring_parser"))
pytestmark = pytest.mark.skipif(not INSTALLED, reason="torchtitan is not installed")


@pytest.fixture
def user_module(monkeypatch):
    """The fixture's own config registry importable as `my_titan` (what --allow-import consents to)."""
    monkeypatch.syspath_prepend(str(FIXTURES))
    return "my_titan"


def _read(args: str, allow=()):
    from moebench.libraries.torchtitan.user_setup import read

    return read(args, allow_imports=tuple(allow))


def _mine(config: str) -> str:
    return f"--module my_titan --config {config} --parallelism.expert_parallel_degree 8"


def test_a_published_launch_is_read_by_torchtitans_config_manager():
    settings, notes = _read(DS16B)
    assert {k: settings[k] for k in ("module", "config", "experts", "top_k", "score_func", "route_norm",
                                     "shared_mult", "load_balance_coeff", "ep", "tp", "backend", "max_norm",
                                     "accum", "dtype", "mp_param", "optimizer", "lr", "beta2", "weight_decay")} == {
        "module": "deepseek_v3", "config": "deepseek_v3_16b", "experts": 64, "top_k": 6, "score_func": "softmax",
        "route_norm": False, "shared_mult": 2, "load_balance_coeff": 0.001, "ep": 8, "tp": 1,
        "backend": "spmd_types", "max_norm": 1.0, "accum": 1, "dtype": "float32", "mp_param": "bfloat16",
        "optimizer": "AdamW", "lr": 0.00022, "beta2": 0.95, "weight_decay": 0.1}
    assert notes[0].startswith("kept: 64 experts top-6, softmax") and "2 shared expert(s)" in notes[0]
    assert any(n.startswith("shrunk: dim 2048 -> 32, expert hidden 1408 -> 32, 27 layers") for n in notes)
    assert any(n.startswith("not honoured here: compile (loss)") for n in notes)
    assert any(n.startswith("not honoured here: activation checkpointing (SelectiveAC)") for n in notes)
    assert all("\n" not in n for n in notes)


def test_rows_fit_each_world_size_saying_what_they_shrank():
    settings, _ = _read(DS16B)
    two, four = ADAPTER.rows(2, user_config=settings), ADAPTER.rows(4, user_config=settings)
    assert [r.key() for r in two] == ["torchtitan/deepseek_v3_16b/spmd_types/ep=2/w2",
                                      "torchtitan/deepseek_v3_16b/spmd_types/ep=2/w2/train"]
    assert [r.ep_mode for r in four] == ["ep=4", "ep=4"] and [r.kind for r in four] == ["bf16", TRAIN]
    assert four[0].note == "EP 8 verified at 4, the largest that fits 4 ranks"
    assert all(ADAPTER.skip_reason(r) is None for r in two + four) and ADAPTER.rows(1, user_config=settings) == []
    record = four[1].labels("0.3.0")
    assert record["experts"] == 64 and record["steps"] == 2 and record["patch"].startswith("spmd_types")
    assert user_layout({**settings, "tp": 2, "ep": 4}, 4) == (2, 2, 4, True)
    assert user_layout({**settings, "ep": 2}, 4) == (4, 1, 2, False)  # efsdp 2: the experts' FSDP is kept


# ------------------------------------------------------------ a setting changed in the args changes the rows

FAMILIES = {
    "scoring": (_mine("ds16b_sigmoid"), {"score_func": "sigmoid"}),
    "grouped routing": (_mine("ds16b_grouped"), {"groups": 8, "limited_groups": 4}),
    "normalisation": (_mine("ds16b_route_norm"), {"route_norm": True, "route_scale": 2.0}),
    "shared expert": (_mine("ds16b_no_shared"), {"shared_mult": 0}),
    "bias": (_mine("ds16b_no_bias"), {"load_balance_coeff": None}),
    "clip": (DS16B.replace("max_norm 1.0", "max_norm 0.25"), {"max_norm": 0.25}),
    "accumulation": (DS16B + " --training.global_batch_size 32 --parallelism.data_parallel_shard_degree 2",
                     {"accum": 4, "dp_shard": 2}),
    "precision": (DS16B + " --training.dtype bfloat16", {"dtype": "bfloat16"}),
    "mixed precision": (DS16B + " --training.mixed_precision_param float32", {"mp_param": "float32"}),
    "EP degree": (DS16B.replace("expert_parallel_degree 8", "expert_parallel_degree 2"), {"ep": 2}),
    "TP degree": (DS16B + " --parallelism.tensor_parallel_degree 2", {"tp": 2}),
    "backend": (DS16B + " --parallelism.spmd_backend partial_dtensor", {"backend": "partial_dtensor"}),
    "optimizer": (DS16B.replace("--module deepseek_v3 --config deepseek_v3_16b",
                                "--module qwen3 --config qwen3_30b_a3b --training.disable_cuda_graphs"),
                  {"lr": 0.0008}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_kept_setting_family_changes_the_rows(family, user_module):
    args, changed = FAMILIES[family]
    base, _ = _read(DS16B)
    settings, _ = _read(args, allow=[user_module])
    assert {k: settings[k] for k in changed} == changed, family
    assert {k: base[k] for k in changed} != changed
    rows_base, rows = ADAPTER.rows(4, user_config=base), ADAPTER.rows(4, user_config=settings)
    assert [r.settings for r in rows] != [r.settings for r in rows_base], family


def test_more_experts_than_a_row_builds_are_shrunk_saying_so(user_module):
    settings, notes = _read(_mine("ds16b_many_experts"), allow=[user_module])
    assert settings["experts"] == 256 and settings["experts_user"] == 1024
    assert any(n.startswith("shrunk: num_experts 1024 -> 256") for n in notes)


# ------------------------------------------------------------------ on real ranks


def _run(settings, world_size=2, kinds=("bf16", TRAIN), default_backend=False):
    """The launch's rows on `world_size` ranks; on a torch whose fully_shard refuses spmd_types' plain parameters
    (its trainer cannot run the default backend there: those rows are refused, as tested below), on partial_dtensor
    unless `default_backend`, so that what a test asserts of the rows runs on every torch."""
    from libraries.rows_launch import run_rows

    from moebench.libraries.torchtitan import trainer

    if settings["backend"] == "spmd_types" and not default_backend and trainer.fsdp_refusal("spmd_types"):
        settings = {**settings, "backend": "partial_dtensor"}
    rows = [r for r in ADAPTER.rows(world_size, user_config=settings) if r.kind in kinds]
    return run_rows(ADAPTER, rows, world_size, 0)


def _failed(results) -> list[str]:
    return [c.name for res in results for c in res.comparisons if not c.passed and c.rank == 0]


@pytest.mark.multirank
def test_the_published_deepseek_16b_launch_passes_at_two_ranks():
    """Its bf16 row and its training row (2 AdamW steps, clip binding, the expert bias moving) at W = 2, ~2 s."""
    results = _run(_read(DS16B)[0])
    for result in results:
        assert result.skipped is None and result.passed, result.describe()
    names = [c.name for c in results[1].comparisons if c.rank == 0]
    assert any("the clip binds" in n for n in names) and any("expert bias moved" in n for n in names)
    assert any("global gradient norm (torchtitan's clip_grad_norm_)" in n for n in names)


def _built_with(monkeypatch, **change):
    """The module built with another setting than the row's (its reference keeps the row's): torchtitan
    implementing the user's setting wrongly."""
    from moebench.libraries.torchtitan import api

    build = api.build
    monkeypatch.setattr(api, "build", lambda gen, spec, *a, **k: build(gen, dataclasses.replace(spec, **change),
                                                                      *a, **k))


@pytest.mark.multirank
@pytest.mark.parametrize("family, launch, change", [
    ("scoring", DS16B, {"score_func": "sigmoid"}),
    ("normalisation", _mine("ds16b_sigmoid"), {"route_norm": True}),
    ("grouped routing", DS16B, {"groups": 8, "limited_groups": 2})])
def test_a_routing_setting_implemented_wrongly_fails(monkeypatch, user_module, family, launch, change):
    """The module routes with another setting than the launch's (sigmoid scores normalised over the top-k: softmax's
    top-6 of 64 already sums to ~1 with decisive routes, so normalisation is shown on a sigmoid router)."""
    _built_with(monkeypatch, **change)
    (result,) = _run(_read(launch, allow=[user_module])[0], kinds=("bf16",))
    assert not result.passed
    assert any("the float32 reference is torchtitan's mathematics" in n for n in _failed([result])), family


@pytest.mark.multirank
def test_a_shared_expert_implemented_wrongly_fails(monkeypatch):
    """The shared expert's output halved (torchtitan's FeedForward, its only user in this MoE)."""
    from moebench.libraries.torchtitan import api

    api.load()
    from torchtitan.models.common import feed_forward

    forward = feed_forward.FeedForward.forward
    monkeypatch.setattr(feed_forward.FeedForward, "forward", lambda self, x: forward(self, x) * 0.5)
    (result,) = _run(_read(DS16B)[0], kinds=("bf16",))
    assert not result.passed and any("reference is torchtitan's" in n for n in _failed([result]))


@pytest.mark.multirank
def test_expert_bias_counts_not_summed_over_ranks_fail(monkeypatch, user_module):
    """The load-balancing hook summing no token counts over the data-parallel ranks (each rank's bias from its own
    tokens): the run's expert bias leaves the one-process one."""
    from moebench.libraries.torchtitan import api, train

    api.load()
    from torchtitan.components.optimizer import optimizer as opt_module

    register = opt_module.register_moe_load_balancing_hook
    monkeypatch.setattr(opt_module, "register_moe_load_balancing_hook",
                        lambda o, parts, dims: register(o, parts, train.OneProcessDims()))
    settings, _ = _read(_mine("ds16b_bias_1e2"), allow=[user_module])
    (result,) = _run(settings, kinds=(TRAIN,))
    assert not result.passed and any("expert bias (load balancing update)" in n for n in _failed([result]))


@pytest.mark.multirank
def test_a_clip_norm_missing_the_experts_fails(monkeypatch):
    """torchtitan's EP clip with the experts' norm left out of the total: the norm and the clipped gradients leave
    the truth's."""
    import math

    import torch
    from torch.distributed.tensor import DTensor

    from moebench.libraries.torchtitan import api

    api.load()
    from torchtitan.distributed import utils as dist_utils

    def dense_norm_only(parameters, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh):
        params = [p for p in parameters if p.grad is not None]
        dense = [p.grad for p in params if "ep" not in p.device_mesh.mesh_dim_names]
        total = torch.nn.utils.get_total_norm(dense, norm_type, error_if_nonfinite, foreach)
        total = total.full_tensor() if isinstance(total, DTensor) else total
        assert math.isfinite(float(total))
        for p in params:
            torch.nn.utils.clip_grads_with_norm_([p], max_norm, total, foreach)
        return total

    monkeypatch.setattr(dist_utils, "_clip_grad_norm_with_ep", dense_norm_only)
    (result,) = _run(_read(DS16B)[0], kinds=(TRAIN,))
    failed = _failed([result])
    assert not result.passed and any("global gradient norm" in n for n in failed), failed


@pytest.mark.multirank
def test_accumulation_normalised_per_micro_batch_fails(monkeypatch):
    """Each micro-batch's loss divided by its own tokens instead of the step's (accumulation 4: gradients x 4)."""
    from moebench.libraries.torchtitan import train

    settings, _ = _read(FAMILIES["accumulation"][0])
    assert settings["accum"] == 4
    monkeypatch.setattr(train, "loss_scale", lambda tokens: tokens / 4)
    (result,) = _run(settings, kinds=(TRAIN,))
    assert not result.passed
    assert any("baseline is the truth's mathematics: its gradient norm" in n for n in _failed([result]))


@pytest.mark.multirank
def test_precision_changes_what_the_training_row_computes():
    """training.dtype bfloat16 keeps the parameters in bf16: the baseline's AdamW update is far from float32's
    (updates below bf16's resolution are lost), where float32 masters keep it close; both rows pass."""
    base = {}
    for dtype in ("float32", "bfloat16"):
        args = DS16B + ("" if dtype == "float32" else " --training.dtype bfloat16")
        (result,) = _run(_read(args)[0], kinds=(TRAIN,))
        assert result.passed, result.describe()
        judged = next(c for c in result.comparisons if c.rank == 0 and "step 1" in c.name and "expert update" in
                      c.name)
        base[dtype] = float(judged.name.rsplit("(", 1)[1].rstrip(")"))
    assert base["bfloat16"] > 3 * base["float32"], base


@pytest.mark.multirank
def test_an_ep_degree_built_wrongly_fails(monkeypatch):
    """torchtitan's mesh built without EP while the launch asks EP 2: through the trainer's FSDP the gradients are
    plain data parallelism's (right), but the experts are not sharded over an ep axis, which the row asserts."""
    from moebench.libraries.torchtitan import api

    parallel_dims = api.parallel_dims
    monkeypatch.setattr(api, "parallel_dims", lambda b, layout, w, degrees=None: parallel_dims(
        b, layout, w, (w, 1, 1, False)))
    monkeypatch.setattr(api, "build", _no_ep(api.build))
    (result,) = _run(_read(DS16B)[0], kinds=("bf16",))
    held = [c for c in result.failed if c.name.startswith("every parameter has a gradient")]
    assert held and "not sharded over the experts on an ep mesh axis" in held[0].note, result.describe()


def _no_ep(build):
    return lambda gen, spec, enable_ep, enable_sp, *a, **k: build(gen, spec, False, enable_sp, *a, **k)


@pytest.mark.multirank
def test_an_ep_tp_launch_on_the_default_backend_through_its_trainer_path():
    """TP 2 x EP 4 at W = 4 on spmd_types (torchtitan's default): the bf16 row through the trainer's parallelize of the
    user's model (its FSDP reducing the gradients) passes; the train row, whose FSDP reduction moebench emulates,
    reads grad-left-partial on its router, and the runner names that `emulated-piece` (a question, never
    torchtitan's bug). On a torch whose fully_shard cannot take spmd_types' parameters both rows are refused."""
    from moebench.libraries.torchtitan import trainer
    from moebench.parity.diagnose import summarise
    from moebench.parity.final import on_emulated

    settings, _ = _read(DS16B.replace("expert_parallel_degree 8", "expert_parallel_degree 4")
                        + " --parallelism.tensor_parallel_degree 2")
    assert settings["parallelize_fn"] == "torchtitan.models.deepseek_v3.parallelize:parallelize_deepseekv3"
    bf16, train = _run(settings, world_size=4, default_backend=True)
    assert bf16.row.ep_mode == train.row.ep_mode == "ep=4,tp=2"
    assert "fully_shard through parallelize_deepseekv3" in bf16.row.settings.dense_grads
    if trainer.fsdp_refusal("spmd_types"):  # its trainer cannot run: both rows refused, never run without it
        for result in (bf16, train):
            assert result.refused and "pytorch/pytorch#181519" in result.refused, result.describe()
        return
    assert bf16.passed, bf16.describe()
    verdict = summarise(train.comparisons, 4)
    assert not train.passed and verdict["name"] == "grad-left-partial", verdict
    named = on_emulated(verdict, train.failed, [e.record() for e in train.row.settings.emulated()])
    assert named["name"] == "emulated-piece" and named["details"]["was"]["name"] == "grad-left-partial", named
    assert "torchtitan's FSDP gradient reduction" in named["sentence"], named


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("launch", LAUNCHES)
def test_every_published_launch_passes(launch, world_size):
    results = _run(_read(launch)[0], world_size=world_size)
    for result in results:
        assert result.skipped is None and result.passed, result.describe()


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["partial_dtensor", "full_dtensor"])
def test_ep_tp_passes_on_the_dtensor_backends(backend):
    settings, _ = _read(DS16B.replace("expert_parallel_degree 8", "expert_parallel_degree 4")
                        + f" --parallelism.tensor_parallel_degree 2 --parallelism.spmd_backend {backend}")
    for result in _run(settings, world_size=4):
        assert result.passed, result.describe()


# ------------------------------------------------------------------ bad input, through the real CLI


def _cli(args: str, tmp_path, *more: str):
    return CliRunner().invoke(app, ["verify-parity", f"--torchtitan-args={args}", "--results-dir",
                                    str(tmp_path / "results"), *more])


BAD = [
    ("'--module deepseek_v3", "does not split as a shell would split it"),
    ("--config deepseek_v3_16b", "names no --module"),
    ("--module deepseek_v3 --config deepseek_v3_16b --help", "asks for torchtitan's help"),
    ("--module llama3 --config llama3_8b", "builds a model with no MoE layer"),
    ("--module gpt_oss --config gpt_oss_20b", "not torchtitan's common MoE"),
    ("--module os --config system", "add --allow-import os"),
    ("--module deepseek_v3 --config nope", "Config function 'nope' not found"),
    (DS16B + " --training.maxnorm 3", "Unrecognized options: --training.maxnorm"),
    (DS16B + " --parallelism.spmd_backend foo", "invalid choice 'foo'"),
    (DS16B + " --training.max_norm abc", "Error parsing --training.max-norm"),
    (DS16B.replace("expert_parallel_degree 8", "expert_parallel_degree 0"), "expert_parallel_degree=0 is out of"),
    (DS16B.replace("expert_parallel_degree 8", "expert_parallel_degree 100000000"), "is out of bounds"),
    (DS16B + " --training.local_batch_size 0", "local_batch_size=0 is out of bounds"),
    (DS16B.replace("max_norm 1.0", "max_norm 0"), "max_norm=0"),
    (DS16B + " --training.global_batch_size 7 --parallelism.data_parallel_shard_degree 2", "not a multiple of"),
    (DS16B + " --override.imports my_evil.kernels", "add --allow-import my_evil"),
    ("--module deepseek_v3 --config deepseek_v3_671b_float8", "torchtitan refused it"),
]


@pytest.mark.parametrize("args, words", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_launches_are_one_line_exit_2_nothing_written(tmp_path, args, words):
    result = _cli(args, tmp_path)
    line = result.output.strip()
    assert result.exit_code == 2, result.output
    assert len(line.splitlines()) == 1 and line.startswith("error: --torchtitan-args: "), line
    assert words in line and "Traceback" not in line, line
    assert not (tmp_path / "results").exists()


def test_a_user_module_out_of_bounds_is_refused_after_consent(tmp_path, user_module):
    result = _cli(_mine("ds16b_top_k_too_many"), tmp_path, "--allow-import", user_module)
    assert result.exit_code == 2 and "top_k 100 is more than its 64 experts" in result.output, result.output
    assert not (tmp_path / "results").exists()


def test_the_reader_refuses_a_0_2_release(monkeypatch):
    from moebench.libraries.torchtitan import api, user_setup

    monkeypatch.setattr(api, "generation", lambda: "moe")
    monkeypatch.setattr(api, "tt_version", lambda: "0.2.2")
    with pytest.raises(UserError, match="torchtitan 0.2.2 configures its runs with TOML files"):
        user_setup.read(DS16B)


def test_list_shows_the_user_rows(tmp_path):
    result = CliRunner().invoke(app, ["verify-parity", f"--torchtitan-args={DS16B}", "--list", "-n", "2"])
    assert result.exit_code == 0, result.output
    assert "torchtitan/deepseek_v3_16b/spmd_types/ep=2/w2/train" in result.output

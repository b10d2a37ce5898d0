"""verify-parity --recipe / --hf-config for NeMo Automodel (moebench/libraries/automodel/user_setup.py, user_rows.py):
Automodel's own published Qwen3-MoE recipe (fixtures/automodel/, its source in the README there) with Qwen3-30B-A3B's
config.json, read through Automodel's own loader into rows that keep every routing and gradient setting; a setting
changed in the recipe or the config changes the rows and what they check; the rows pass on the pinned release and
fail, named, on Automodel's own objects broken in the test process; every bad input is one line, exit 2, nothing
written."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import yaml
from helpers.automodel_torch import runs_its_parallelizer
from typer.testing import CliRunner

from moebench.cli.app import app
from moebench.errors import UserError

INSTALLED = importlib.util.find_spec("nemo_automodel") is not None
pytestmark = pytest.mark.skipif(not INSTALLED, reason="nemo-automodel is not installed (make install does it)")

from test_automodel import _router_detached  # noqa: E402  (0.5.0's differentiable=False gather)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RECIPE = FIXTURES / "automodel" / "qwen3_moe_30b_hellaswag.yaml"
QWEN3 = FIXTURES / "hf" / "qwen3_30b_a3b.json"
DEEPSEEK = FIXTURES / "hf" / "deepseek_v3.json"


def _read(recipe=RECIPE, hf=QWEN3, sizes=(2, 4), allow=()):
    from moebench.libraries.automodel.user_setup import read_recipe

    return read_recipe(str(recipe), hf_config=None if hf is None else str(hf), allow_imports=allow,
                       world_sizes=sizes)


def _recipe(tmp_path, change=None, *, name="recipe.yaml") -> Path:
    """The published recipe, parsed, `change`d (a function of the dict), written back."""
    doc = yaml.safe_load(RECIPE.read_text())
    if change is not None:
        change(doc)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _config(tmp_path, base=QWEN3, name="model.json", **changes) -> Path:
    doc = json.loads(base.read_text())
    doc.update(changes)
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def _rows(settings, world_size=2):
    from moebench.libraries.automodel import ADAPTER

    return ADAPTER.rows(world_size, user_config=settings)


def _note(notes, start):
    found = [n for n in notes if n.startswith(start)]
    assert len(found) == 1, (start, notes)
    return found[0]


# ------------------------------------------------------------------ the published recipe, read


def test_the_published_recipe_is_read_into_its_settings_with_a_line_for_each_thing_not_honoured():
    settings, notes = _read()
    assert settings["family"] == "qwen3_moe" and settings["routing"]["num_experts"] == 128
    assert {k: settings["moe"][k] for k in ("n_routed_experts", "n_activated_experts", "score_func", "norm_topk_prob",
                                             "aux_loss_coeff", "gate_bias_update_factor")} == {
        "n_routed_experts": 128, "n_activated_experts": 8, "score_func": "softmax", "norm_topk_prob": True,
        "aux_loss_coeff": 0.001, "gate_bias_update_factor": 0.0}
    assert {k: settings[k] for k in ("ep_size", "grad_acc", "max_norm", "precision", "optimizer",
                                     "activation_checkpointing")} == {
        "ep_size": 8, "grad_acc": 2, "max_norm": 1.0, "precision": "bf16", "optimizer": "AdamW",
        "activation_checkpointing": True}
    assert settings["backend"]["experts"] == "torch_mm" and settings["backend"]["dispatcher"] == "torch"
    assert "not honoured" in _note(notes, "model.backend.dispatcher=deepep")
    assert "not honoured" in _note(notes, "model.backend.attn=te")
    assert "= 2 micro-batch(es) a step; kept" in _note(notes, "step_scheduler: global_batch_size 1024 / "
                                                               "(local_batch_size 64 x dp 8")
    assert "2 at -n 2, 4 at -n 4" in _note(notes, "distributed.ep_size=8: more than the ranks here")
    assert "its default" in _note(notes, "clip_grad_norm.max_norm not set")
    assert "Adam divides" in _note(notes, "optimizer: your AdamW (lr 0.0001) is replaced by SGD")
    assert "hidden_size 2048 -> 32" in _note(notes, "shrunk (only costs time)")
    assert "dataset" in _note(notes, "not used:")
    json.dumps(settings)  # summary.json's "setup": plain data


def test_the_recipes_rows_fit_the_ranks_and_record_their_settings():
    settings, _ = _read()
    for world, ep in ((2, 2), (4, 4)):
        rows = _rows(settings, world)
        assert [r.key() for r in rows] == [f"automodel/qwen3_moe/torch_mm/ep={ep}/w{world}/recipe",
                                           f"automodel/qwen3_moe/torch_mm/ep={ep}/w{world}/recipe+bf16"]
        fp32, bf16 = rows
        assert fp32.settings.recipe_ep_size == 8 and fp32.settings.ep_size == ep
        assert (fp32.settings.num_experts, fp32.settings.top_k, fp32.settings.grad_acc_steps) == (128, 8, 2)
        assert fp32.settings.max_grad_norm == 1.0 and fp32.settings.loss_multiplier == 5.0
        assert fp32.features == ("loss-curve", "clip", "grad-accum") and bf16.features == ("bf16", "grad-accum")
        assert f"ep_size 8 verified at {ep}" in fp32.note
    assert _rows(settings, 1) == []


def test_hf_config_alone_is_automodels_model_with_the_training_steps_defaults(tmp_path):
    from moebench.libraries.automodel.user_setup import read_hf_only

    settings, notes = read_hf_only(str(DEEPSEEK), world_sizes=(2,))
    (row, _) = _rows(settings, 2)
    assert row.key() == "automodel/deepseek_v3/torch_mm/ep=2/w2/hf-config"
    s = row.settings
    assert (s.score_func, s.n_expert_groups, s.n_limited_groups, s.n_shared_experts, s.route_scale) == (
        "sigmoid", 8, 4, 1, 2.5)
    assert s.update_bias and s.gate_bias_update_factor == 0.001 and s.grad_acc_steps == 1 and s.max_grad_norm == 1
    assert "quantization_config: not honoured" in " ".join(notes)


def test_a_local_model_folder_the_recipe_names_gives_its_config_json(tmp_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("my-qwen3")  # outside tmp_path: a config.json there reads as a results file
    (folder / "config.json").write_text(QWEN3.read_text())
    recipe = _recipe(tmp_path, lambda d: d["model"].update(pretrained_model_name_or_path=str(folder)))
    settings, notes = _read(recipe, hf=None)
    assert settings["hf_config"] == str(folder / "config.json") and settings["routing"]["num_experts"] == 128
    assert f"the recipe's folder {folder}" in notes[0]


# ------------------------------------------------------------------ a setting changed changes the rows


def _row_of(recipe=RECIPE, hf=QWEN3, world=2):
    settings, notes = _read(recipe, hf, sizes=(world,))
    return _rows(settings, world)[0], notes


def test_scoring_from_the_recipe_changes_the_rows_routing(tmp_path):
    row, _ = _row_of(_recipe(tmp_path, lambda d: d["model"].update(moe_overrides={"score_func": "sigmoid"})))
    assert row.settings.score_func == "sigmoid" and json.loads(row.settings.moe_overrides) == {"score_func": "sigmoid"}
    assert _row_of()[0].settings.score_func == "softmax"


def test_normalisation_from_the_config_changes_the_rows_routing(tmp_path):
    row, notes = _row_of(hf=_config(tmp_path, norm_topk_prob=False))
    assert row.settings.norm_topk_prob is False and "norm_topk_prob=false" in _note(notes, "kept (Qwen3MoeConfig")


def test_shared_experts_grouped_routing_and_scale_come_from_the_deepseek_config(tmp_path):
    one, _ = _row_of(hf=DEEPSEEK)
    none, _ = _row_of(hf=_config(tmp_path, DEEPSEEK, n_shared_experts=0, n_group=4, topk_group=2,
                                 routed_scaling_factor=1.5))
    assert (one.model, one.settings.n_shared_experts, one.settings.n_expert_groups) == ("deepseek_v3", 1, 8)
    assert (none.settings.n_shared_experts, none.settings.n_expert_groups, none.settings.n_limited_groups,
            none.settings.route_scale) == (0, 4, 2, 1.5)


def test_moe_overrides_of_sizes_are_left_to_the_small_model_and_said(tmp_path):
    """MoEConfig sizes in model.moe_overrides would undo the shrink (4096 x 4096 experts in the parent process):
    the rows drop them, one line says so, and the routing overrides beside them are kept."""
    big = {"dim": 4096, "moe_inter_dim": 4096, "gate_dtype": "float32", "aux_loss_coeff": 0.01}
    row, notes = _row_of(_recipe(tmp_path, lambda d: d["model"].update(moe_overrides=big)))
    line = _note(notes, "model.moe_overrides.dim, model.moe_overrides.moe_inter_dim, model.moe_overrides.gate_dtype")
    assert "the rows' small model has its own" in line
    assert json.loads(row.settings.moe_overrides) == {"aux_loss_coeff": 0.01} and row.settings.aux_loss_coeff == 0.01


def test_the_gate_bias_update_is_kept_where_the_model_class_updates_it(tmp_path):
    deepseek, _ = _row_of(hf=DEEPSEEK)
    off, _ = _row_of(_recipe(tmp_path, lambda d: d["model"].update(moe_overrides={"gate_bias_update_factor": 0.0})),
                     hf=DEEPSEEK)
    assert deepseek.settings.update_bias and "bias-update" in deepseek.features
    assert not off.settings.update_bias and "bias-update" not in off.features
    # Qwen3-MoE's class has no update_moe_gate_bias: its trainer never updates the bias, and the rows say so
    qwen, notes = _row_of(_recipe(tmp_path, lambda d: d["model"].update(moe_overrides={"gate_bias_update_factor":
                                                                                       0.01}), name="q.yaml"))
    assert qwen.settings.gate_bias_update_factor == 0.01 and not qwen.settings.update_bias
    assert "never updates the gate bias" in _note(notes, "gate_bias_update_factor 0.01")


def test_the_clip_from_the_recipe_changes_the_rows(tmp_path):
    half, notes = _row_of(_recipe(tmp_path, lambda d: d.update(clip_grad_norm={"max_norm": 0.5})))
    off, _ = _row_of(_recipe(tmp_path, lambda d: d.update(clip_grad_norm={"max_norm": 0.0}), name="off.yaml"))
    assert (half.settings.max_grad_norm, half.settings.loss_multiplier) == (0.5, 2.5) and "clip" in half.features
    assert "by max_norm / 0.2" in _note(notes, "clip_grad_norm.max_norm 0.5: kept")
    assert off.settings.max_grad_norm == 0 and off.settings.loss_multiplier == 1 and "clip" not in off.features


def test_accumulation_from_the_step_scheduler_changes_the_rows(tmp_path):
    one, _ = _row_of(_recipe(tmp_path, lambda d: d["step_scheduler"].update(global_batch_size=512)))
    many, notes = _row_of(_recipe(tmp_path, lambda d: d["step_scheduler"].update(global_batch_size=8192),
                                  name="many.yaml"))
    assert one.settings.grad_acc_steps == 1 and "grad-accum" not in one.features
    assert (many.settings.grad_acc_steps, many.settings.recipe_grad_acc_steps) == (4, 16)
    assert "shrunk: the rows accumulate 4" in _note(notes, "step_scheduler: global_batch_size 8192")


def test_precision_from_the_recipe_changes_the_rows(tmp_path):
    settings, notes = _read(_recipe(tmp_path, lambda d: d["model"].update(torch_dtype="float32")), sizes=(2,))
    assert [r.key() for r in _rows(settings)] == ["automodel/qwen3_moe/torch_mm/ep=2/w2/recipe"]
    assert "the row compares exactly" in _note(notes, "precision: float32")


def test_ep_and_tp_degrees_from_the_recipe(tmp_path):
    ep2, notes = _row_of(_recipe(tmp_path, lambda d: d["distributed"].update(ep_size=2)), world=4)
    assert ep2.ep_mode == "ep=2" and ep2.settings.ep_size == 2 and ep2.note == ""
    assert "distributed.ep_size=2: kept" in notes
    hsdp, _ = _row_of(_recipe(tmp_path, lambda d: d["distributed"].update(ep_size=2, dp_replicate_size=2),
                              name="hsdp.yaml"), world=4)
    assert hsdp.ep_mode == "ep=2+hsdp=2"
    with pytest.raises(UserError, match="Automodel refuses tensor parallelism for Qwen3MoeForCausalLM"):
        _read(_recipe(tmp_path, lambda d: d["distributed"].update(tp_size=2), name="tp.yaml"))


# ------------------------------------------------------------------ on real ranks


def _launch(rows, world_size, seed=0):
    from libraries.rows_launch import run_rows

    from moebench.libraries.automodel import ADAPTER

    return run_rows(ADAPTER, rows, world_size, seed)


def _assert_all_pass(results):
    for result in results:
        assert result.skipped is None and result.passed, result.describe()
        assert not [c.name for c in result.comparisons if c.vacuous], result.row.key()


@runs_its_parallelizer
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_published_recipe_passes_on_the_pinned_release(world_size):
    settings, _ = _read(sizes=(world_size,))
    (fp32, _bf16) = _rows(settings, world_size)
    (result,) = _launch([fp32], world_size)
    _assert_all_pass([result])
    names = {c.name for c in result.comparisons}
    per = 128 // world_size
    assert {"grad model.layers.0.mlp.gate.weight", "output (logits, micro-batch 1)", "loss curve (3 SGD steps)",
            f"grad model.layers.0.mlp.experts.gate_and_up_projs[experts 0-{per - 1}]",
            "clip norm (training.utils.clip_grad_norm, max_norm 1)"} <= names
    assert any(n.startswith("the clip binds") for n in names)


DEEPSEEK_RECIPE = FIXTURES / "automodel" / "deepseekv3_pretrain.yaml"


@runs_its_parallelizer
@pytest.mark.multirank
def test_the_published_deepseek_v3_pretraining_recipe_passes_with_its_bias_update_and_accumulation():
    """Automodel's DeepSeek-V3 pretraining recipe (EP 16, PP 8, dp_size 16, 4 micro-batches a step) with DeepSeek-V3's
    config.json: sigmoid scoring, 8 groups keeping 4, a shared expert and the gate bias update kept; EP verified at
    2; the pipeline degree not honoured, said in one line."""
    settings, notes = _read(DEEPSEEK_RECIPE, DEEPSEEK, sizes=(2,))
    fp32, _bf16 = _rows(settings, 2)
    s = fp32.settings
    assert (s.recipe_ep_size, s.ep_size, s.grad_acc_steps, s.num_experts) == (16, 2, 4, 256)
    assert (s.score_func, s.n_expert_groups, s.n_limited_groups, s.n_shared_experts, s.route_scale) == (
        "sigmoid", 8, 4, 1, 2.5)
    assert s.update_bias and fp32.features == ("loss-curve", "clip", "grad-accum", "bias-update")
    assert "not honoured" in _note(notes, "distributed.pp_size=8")
    (result,) = _launch([fp32], 2)
    _assert_all_pass([result])
    names = {c.name for c in result.comparisons}
    assert any("bias" in n for n in names), sorted(names)


@runs_its_parallelizer
@pytest.mark.multirank
def test_an_expert_no_token_reaches_fails_the_premise(monkeypatch):
    """Every token routed to the first top-k experts (on both sides: the gate itself is patched): the row would
    compare the other experts' zero gradients with zeros, so it fails its premise, naming how many get none."""
    import torch
    from nemo_automodel.components.moe import layers

    forward = layers.Gate.forward

    def first_experts(self, *args, **kwargs):
        weights, indices, aux = forward(self, *args, **kwargs)
        return weights, torch.arange(indices.shape[-1]).expand_as(indices).contiguous(), aux

    monkeypatch.setattr(layers.Gate, "forward", first_experts)
    (result,) = _launch([_fault_row()], 2)
    assert not result.passed
    failed = [c for c in result.comparisons if not c.passed and c.name.startswith("every expert gets tokens")]
    assert failed and "120 expert(s) get none" in failed[0].note, result.describe()


def _fault_row(hf=QWEN3, recipe=RECIPE):
    settings, _ = _read(recipe, hf, sizes=(2,))
    return _rows(settings, 2)[0]


def _earlier_micro_batches_dropped(monkeypatch):
    """The gradients of the micro-batches before the last zeroed at the accumulation boundary."""
    from nemo_automodel.components.training import utils

    final = utils.prepare_for_final_backward

    def dropped(parts, pp_enabled=False):
        parts[0].zero_grad(set_to_none=True)
        return final(parts, pp_enabled=pp_enabled)

    monkeypatch.setattr(utils, "prepare_for_final_backward", dropped)


def _bias_not_spread(monkeypatch):
    """apply_fsdp leaves the routing bias a plain tensor (before NVIDIA-NeMo/Automodel#3348): each rank updates it
    from its own expert load."""
    from nemo_automodel.components.moe import parallelizer
    from torch.distributed.tensor import Replicate

    spread = parallelizer.distribute_tensor

    def plain(tensor, device_mesh=None, placements=None, **kw):
        if placements and all(isinstance(p, Replicate) for p in placements):
            return tensor
        return spread(tensor, device_mesh, placements, **kw)

    monkeypatch.setattr(parallelizer, "distribute_tensor", plain)


def _experts_summed(monkeypatch):
    """The trainer's EP scaling skipped (scale_grads_and_clip_grad_norm without the MoE mesh)."""
    from nemo_automodel.components.training import utils

    scale = utils.scale_grads_and_clip_grad_norm
    monkeypatch.setattr(utils, "scale_grads_and_clip_grad_norm",
                        lambda max_norm, parts, **kw: scale(max_norm, parts, **{**kw, "moe_mesh": None}))


def _per_rank_norm(monkeypatch):
    """clip_grad_norm's scalar reductions skipped: every rank clips by the norm of what it holds."""
    from nemo_automodel.components.training import utils

    monkeypatch.setattr(utils, "_all_reduce_scalar", lambda scalar, op, mesh, mesh_dim=None: scalar)


FAULTS = [  # (patch, config.json, the row's diagnosis, words of its first failure's sentence)
    (_router_detached, QWEN3, "router-detached", "non-differentiable gather"),
    (_earlier_micro_batches_dropped, QWEN3, "accum-boundary", "the last micro-batch's gradient alone"),
]
SLOW_FAULTS = [
    (_experts_summed, QWEN3, "uniform-scale", "summed instead of averaged over 2 ranks"),
    (_per_rank_norm, QWEN3, "global-norm", "a norm over this rank's own gradients"),
]


def _named(monkeypatch, patch, hf, name, words):
    from moebench.parity.diagnose import summarise

    patch(monkeypatch)
    (result,) = _launch([_fault_row(hf)], 2)
    assert result.skipped is None and not result.passed, result.row.key()
    verdict = summarise(result.comparisons, 2)
    assert verdict["name"] == name, verdict["sentence"]
    assert words in result.failed[0].diagnosis["sentence"], result.failed[0].diagnosis
    return result


@runs_its_parallelizer
@pytest.mark.multirank
@pytest.mark.parametrize("patch,hf,name,words", FAULTS, ids=[f[2] for f in FAULTS])
def test_a_broken_automodel_fails_the_recipes_row_named(monkeypatch, patch, hf, name, words):
    from moebench.parity.diagnose import summarise

    result = _named(monkeypatch, patch, hf, name, words)
    if name == "router-detached":  # the forward is right: only gradients are wrong
        assert "output right" in summarise(result.comparisons, 2)["sentence"]


@runs_its_parallelizer
@pytest.mark.multirank
def test_a_bias_updated_from_each_ranks_own_load_fails_the_bias_comparison():
    """DeepSeek-V3's routing bias: with apply_fsdp leaving it a plain tensor, a rank updates it from its own load:
    the bias comparison fails, and where it matches the per-rank update it is named rank-local."""
    monkeypatch = pytest.MonkeyPatch()
    try:
        _bias_not_spread(monkeypatch)
        (result,) = _launch([_fault_row(DEEPSEEK)], 2)
    finally:
        monkeypatch.undo()
    failed = [c for c in result.comparisons if not c.passed]
    assert failed and all(c.group == "gate/router" for c in failed if "routing bias" in c.name)
    assert failed[0].name.startswith("the routing bias (e_score_correction_bias) after step")
    assert any(c.diagnosis and c.diagnosis["name"] == "rank-local" for c in failed if "routing bias" in c.name)
    assert not [c for c in result.comparisons if c.name.startswith("grad ") and not c.passed]  # gradients right


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("patch,hf,name,words", SLOW_FAULTS, ids=[f[2] for f in SLOW_FAULTS])
def test_more_broken_paths_fail_the_recipes_row_named(monkeypatch, patch, hf, name, words):
    _named(monkeypatch, patch, hf, name, words)


@pytest.mark.slow
@pytest.mark.multirank
def test_experts_summed_fail_the_bf16_row_as_a_uniform_scale(monkeypatch):
    from moebench.parity.diagnose import summarise

    _experts_summed(monkeypatch)
    settings, _ = _read(sizes=(2,))
    (result,) = _launch([_rows(settings, 2)[1]], 2)
    assert not result.passed and summarise(result.comparisons, 2)["name"] == "uniform-scale"


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_whole_user_matrix_passes(tmp_path, world_size, seed):
    """Every row of the published recipe (float32 and bf16), of the DeepSeek-V3 config.json alone and of the recipe
    with the variants the setting families use, at W = 2 and 4 over 3 seeds: no false alarm."""
    from moebench.libraries.automodel.user_setup import read_hf_only

    variants = [
        _recipe(tmp_path, lambda d: d["distributed"].update(ep_size=2, dp_replicate_size=2), name="hsdp.yaml"),
        _recipe(tmp_path, lambda d: (d["model"].update(moe_overrides={"score_func": "sigmoid"}),
                                     d.update(clip_grad_norm={"max_norm": 0.1}),
                                     d["step_scheduler"].update(global_batch_size=4096)), name="other.yaml"),
    ]
    rows = _rows(_read(sizes=(world_size,))[0], world_size)
    rows += _rows(read_hf_only(str(DEEPSEEK), world_sizes=(world_size,))[0], world_size)
    rows += _rows(_read(variants[0], sizes=(world_size,))[0], world_size)
    rows += _rows(_read(variants[1], hf=DEEPSEEK, sizes=(world_size,))[0], world_size)
    _assert_all_pass(_launch(rows, world_size, seed))


# ------------------------------------------------------------------ the command a user runs


def _cli(*args):
    return CliRunner().invoke(app, ["verify-parity", *args])


def _nothing_written() -> bool:
    return not os.path.exists(os.path.join(os.environ["MOEBENCH_RESULTS"], "parity"))


@runs_its_parallelizer
@pytest.mark.multirank
def test_the_command_a_user_runs(tmp_path):
    from moebench.libraries.records import WIDTH

    result = _cli("--recipe", str(RECIPE), "--hf-config", str(QWEN3), "-n", "2")
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.index("--hf-config qwen3_30b_a3b.json, --recipe qwen3_moe_30b_hellaswag.yaml:") < out.index(
        "verify-parity --library:")
    assert not [line for line in out.splitlines() if line.startswith("transformers ")]  # the recipe's model only
    assert not [line for line in out.splitlines() if len(line) > WIDTH and not line.startswith("saved to ")]
    root = os.path.join(os.environ["MOEBENCH_RESULTS"], "parity")
    (run,) = os.listdir(root)
    summary = json.load(open(os.path.join(root, run, "summary.json")))
    settings, notes = _read(sizes=(2,))
    assert summary["setup"]["settings"] == {"automodel": settings} and summary["setup"]["notes"] == notes
    assert [(r["check"], r["verdict"]) for r in summary["rows"]] == [
        ("automodel/qwen3_moe/torch_mm/ep=2/w2/recipe", "pass"), ("automodel/qwen3_moe/torch_mm/ep=2/w2/recipe+bf16",
                                                                  "pass")]


def _refused(result, *words):
    line = result.output.strip()
    assert result.exit_code == 2, result.output
    assert len(line.splitlines()) == 1 and line.startswith("error: --recipe: "), line
    assert "Traceback" not in line and all(w in line for w in words), line
    assert _nothing_written()
    return line


BAD = [  # (the recipe's text, or a change to the published one; words of the refusal)
    ("- just\n- a list\n", ("holds a YAML list, not a mapping",)),
    ("recipe: [unclosed\n", ("is not YAML",)),
    ('{"train_batch_size": 8, "zero_optimization": {"stage": 2}}', ("names no recipe",
                                                                     "a DeepSpeed config? give it to --ds-config")),
    (QWEN3.read_text(), ("names no recipe", "a model's config.json? give it to --hf-config")),
    ("recipe: KnowledgeDistillationRecipeForNextTokenPrediction\nmodel: {}\n",
     ("verify the training step of TrainFinetuneRecipeForNextTokenPrediction",)),
    ("recipe: NoSuchRecipe\n", ("Automodel refuses recipe 'NoSuchRecipe'", "Unknown recipe class")),
    (lambda d: d.update(loss_fn={"_target_": "my_plugin.losses.Loss"}),
     ("loss_fn._target_: 'my_plugin.losses.Loss'", "outside Automodel's own modules", "--allow-import "
                                                                                       "my_plugin.losses")),
    (lambda d: d.update(loss_fn={"_target_": "os.system"}), ("'os.system'", "outside Automodel's own modules")),
    (lambda d: d["dataloader"].update(collate_fn="evil.py:collate"), ("names a Python file",)),
    (lambda d: d.update(distributd={"ep_size": 2}), ("distributd", "did you mean distributed?",
                                                      "Automodel would ignore it")),
    (lambda d: d.update(clip_grad_norm={"max_nrom": 1.0}), ("clip_grad_norm.max_nrom", "would ignore it")),
    (lambda d: d["model"].update(num_expert=64), ("model.num_expert", "neither a Qwen3MoeConfig field")),
    (lambda d: d["model"].update(moe_overrides={"scor_func": "sigmoid"}), ("model.moe_overrides.scor_func",
                                                                           "MoEConfig has no field")),
    (lambda d: d["model"].update(moe_config={"dim": 8}), ("model.moe_config", "refuses it")),
    (lambda d: d["step_scheduler"].update(global_batch_sise=8), ("Automodel's config loader refuses "
                                                                 "step_scheduler", "global_batch_sise")),
    (lambda d: d["distributed"].update(frobnicate=True), ("Automodel's config loader refuses distributed",
                                                          "frobnicate")),
    (lambda d: d["model"].update(pretrained_model_name_or_path="${NOT_SET_ANYWHERE_4711}"),
     ("Automodel's config loader refuses it", "NOT_SET_ANYWHERE_4711")),
    (lambda d: d["distributed"].update(ep_size=0), ("distributed.ep_size=0", "from 1 to 65536")),
    (lambda d: d["distributed"].update(ep_size=10**9), ("distributed.ep_size=1000000000",)),
    (lambda d: d["distributed"].update(tp_size=2), ("Automodel refuses tensor parallelism",)),
    (lambda d: d["step_scheduler"].update(global_batch_size=-1), ("step_scheduler.global_batch_size=-1",)),
    (lambda d: d["step_scheduler"].update(global_batch_size=1000), ("global_batch_size (1000) must be divisible",)),
    (lambda d: d.update(clip_grad_norm={"max_norm": float("nan")}), ("clip_grad_norm.max_norm=nan",)),
    (lambda d: d.update(clip_grad_norm={"max_norm": -1}), ("clip_grad_norm.max_norm=-1",)),
    (lambda d: d["model"].update(num_experts_per_tok=1000), ("num_experts_per_tok=1000",)),
    (lambda d: d["model"]["backend"].update(_target_="torch.save", obj=1, f="written.pt"),
     ("model.backend", '_target_ "torch.save"', "must be Automodel's BackendConfig")),
    (lambda d: d["model"]["backend"].update(extra={"_target_": "torch.save", "obj": 1, "f": "written.pt"}),
     ("model.backend", "a _target_ nested in extra")),
    (lambda d: d["model"].update(norm_topk_prob="yes"), ("norm_topk_prob",)),
    (lambda d: d["model"].update(moe_overrides={"gate_bias_update_factor": 1e9}),
     ("model.moe_overrides.gate_bias_update_factor=1000000000.0",)),
    (lambda d: d["model"].update(_target_="transformers.AutoModelForCausalLM.from_pretrained"),
     ("model._target_", "--library transformers --hf-config")),
]


@pytest.mark.parametrize("doc,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_recipe_is_one_line_exit_2_and_nothing_written(tmp_path, doc, words):
    path = _recipe(tmp_path, doc) if callable(doc) else tmp_path / "recipe.yaml"
    if not callable(doc):
        path.write_text(doc)
    _refused(_cli("--recipe", str(path), "--hf-config", str(QWEN3), "-n", "2"), str(path), *words)


def test_a_recipe_without_a_config_json_says_to_pass_hf_config(tmp_path):
    _refused(_cli("--recipe", str(RECIPE), "-n", "2"), "names the model 'Qwen/Qwen3-30B-A3B'",
             "pass its config.json with --hf-config FILE")


def test_a_config_json_of_a_family_automodels_rows_do_not_build_is_refused(tmp_path):
    result = _cli("--recipe", str(RECIPE), "--hf-config", str(FIXTURES / "hf" / "mixtral_8x7b.json"), "-n", "2")
    line = result.output.strip()
    assert result.exit_code == 2 and line.startswith("error: --hf-config: ") and "'mixtral' model" in line, line
    assert _nothing_written()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "200 MB"])
def test_a_special_or_huge_file_is_refused_before_reading_it(tmp_path, kind):
    path = {"fifo": tmp_path / "fifo.yaml", "dev-zero": Path("/dev/zero"), "200 MB": tmp_path / "big.yaml"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "200 MB":
        with open(path, "wb") as f:
            f.truncate(200 * 1024 * 1024)
    words = ("not a regular file",) if kind != "200 MB" else ("209,715,200 bytes",)
    _refused(_cli("--recipe", str(path), "--hf-config", str(QWEN3), "-n", "2"), *words)


def test_code_a_recipe_names_is_imported_only_with_consent(tmp_path, monkeypatch):
    """Nothing of it runs before --allow-import names it (Automodel's own loader would import anything importable);
    with consent, Automodel's loader imports it as it would."""
    package = tmp_path / "plugins" / "my_plugin"
    package.mkdir(parents=True)
    marker = tmp_path / "imported"
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Loss:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    recipe = _recipe(tmp_path, lambda d: d.update(loss_fn={"_target_": "my_plugin.Loss"}))
    _refused(_cli("--recipe", str(recipe), "--hf-config", str(QWEN3), "--list"), "'my_plugin.Loss'",
             "--allow-import my_plugin")
    assert not marker.exists()
    result = _cli("--recipe", str(recipe), "--hf-config", str(QWEN3), "--allow-import", "my_plugin", "-n", "2",
                  "--list")
    assert result.exit_code == 0, result.output
    assert marker.exists() and "automodel/qwen3_moe/torch_mm/ep=2/w2/recipe" in result.output

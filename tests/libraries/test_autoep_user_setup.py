"""--hf-config (with or without --ds-config) for the AutoEP rows: the model AutoEP converts is the user's config.json
(moebench/libraries/autoep/user_config.py), its engine settings the user's ds_config or DeepSpeed's defaults.

A published config runs as rows at W = 2 and 4 and passes on the pinned DeepSpeed; DeepSpeed#8475 (ZeRO 0 clipping
with autoep_size > 1 clips by the mean of the ranks' own norms) is caught from a config.json plus a ds_config with
ZeRO 0 and gradient_clipping, and from a config.json alone (DeepSpeed's default gradient_clipping is 1.0); each kept
setting family changed in a file changes the rows and what they check, and a wrong implementation of it (a fault made
here by wrapping DeepSpeed's own objects in the test process, inherited by the forked ranks) fails the row."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from moebench.libraries import matrix
from moebench.libraries.autoep import ADAPTER
from moebench.libraries.autoep.user_config import MODEL_CLIP, deepspeed_default_clip, read_setup
from moebench.libraries.records import rows_of
from moebench.parity.runner import ParityConfig, run_checks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
import autoep_faults  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
QWEN3 = FIXTURES / "qwen3_30b_a3b.json"
DEEPSEEK = FIXTURES / "deepseek_v3.json"
MIXTRAL = FIXTURES / "mixtral_8x7b.json"
ZERO1 = {"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "expert_parallel": {"enabled": True}}
ZERO0_CLIP = {"zero_optimization": {"stage": 0}, "gradient_clipping": 1.0,
              "expert_parallel": {"enabled": True, "autoep_size": 2}}
FINDING = "is the MEAN over ranks of each rank's own-parameter norm"


def _write(tmp_path, name: str, doc: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def _model(tmp_path, source: Path, name: str, **changes) -> str:
    return _write(tmp_path, f"{name}.json", {**json.loads(source.read_text()), **changes})


def _setup(hf: Path | str, ds: dict | None = None, tmp_path=None) -> tuple[dict, list[str]]:
    ds_path = _write(tmp_path, "ds.json", ds) if ds is not None else None
    return read_setup(types.SimpleNamespace(hf_config=str(hf), ds_config=ds_path))


def _run(world_size: int, settings: dict, seed: int = 0) -> dict[str, dict]:
    """Every row of the user's setup at `world_size`, as verify-parity runs them -> rows_of by key (each with the
    run's vacuous_total)."""
    checks = matrix.row_checks([ADAPTER], (world_size,), user_configs={"autoep": settings})
    with matrix.registered(checks):
        summary = run_checks(ParityConfig(world_size=world_size, timeout_s=300.0, seed=seed,
                                          checks=tuple(c.name for c in checks)))
    return {r["check"].removeprefix("autoep/"): {**r, "vacuous_total": summary["vacuous_total"]}
            for r in rows_of(summary)}


def _only(found: dict[str, dict]) -> dict:
    (row,) = found.values()
    return row


# ------------------------------------------------------------------ rows (no ranks)


def test_a_published_config_with_a_ds_config_gives_the_users_row_at_2_and_4(tmp_path):
    for path, family, experts, top_k in ((QWEN3, "qwen3_moe", 128, 8), (DEEPSEEK, "deepseek_v3", 256, 8),
                                         (MIXTRAL, "mixtral", 8, 2)):
        settings, notes = _setup(path, ZERO1, tmp_path)
        for world in (2, 4):
            (row,) = ADAPTER.rows(world, user_config=settings)
            s = row.settings
            assert row.key() == f"autoep/{family}/zero1/ep={world}/w{world}/hf-config"
            assert (s.family, s.num_experts, s.top_k, s.zero_stage, s.clip, s.autoep_size) == (
                family, experts, top_k, 1, 1.0, world)
            assert s.loss_multiplier == 1.0 / MODEL_CLIP and ADAPTER.skip_reason(row) is None
            assert s.hf_config == str(path.resolve()) and len(s.hf_sha256) == 16
        assert any(n.startswith(f"AutoEP's {family} preset converts the whole model") for n in notes)


def test_hf_config_alone_verifies_deepspeeds_defaults_and_says_so(tmp_path):
    settings, notes = _setup(MIXTRAL, None, tmp_path)
    assert deepspeed_default_clip() == 1.0  # DeepSpeed 0.19's GRADIENT_CLIPPING_DEFAULT: it clips unless told not to
    assert (settings["zero_stage"], settings["clip"], settings["grad_accum"], settings["precision"]) == (
        0, 1.0, 1, "fp32")
    assert any(n.startswith("no --ds-config: DeepSpeed's defaults for the engine") for n in notes)
    (row,) = ADAPTER.rows(2, user_config=settings)
    assert row.key() == "autoep/mixtral/zero0/ep=2/w2/hf-config"


def test_engine_settings_of_the_ds_config_change_the_rows(tmp_path):
    """ZeRO stage, clip, accumulation, precision and autoep_size (the EP degree) each come from the ds_config."""
    base, _ = _setup(MIXTRAL, ZERO1, tmp_path)
    (plain,) = ADAPTER.rows(4, user_config=base)
    for change, field, value in ((dict(zero_optimization={"stage": 2}), "zero_stage", 2),
                                 (dict(gradient_clipping=0.0), "clip", 0.0),
                                 (dict(gradient_accumulation_steps=2), "grad_accum", 2),
                                 (dict(expert_parallel={"enabled": True, "autoep_size": 2}), "autoep_size", 2)):
        settings, _ = _setup(MIXTRAL, {**ZERO1, **change}, tmp_path)
        (row,) = ADAPTER.rows(4, user_config=settings)
        assert getattr(row.settings, field) == value != getattr(plain.settings, field), field
    bf16, _ = _setup(MIXTRAL, {**ZERO1, "bf16": {"enabled": True}}, tmp_path)
    assert [(r.key(), r.settings.precision) for r in ADAPTER.rows(2, user_config=bf16)] == [
        ("autoep/mixtral/zero1/ep=2/w2/hf-config", "bf16"),
        ("autoep/mixtral/zero1/ep=2/w2/hf-config+fp32", "fp32")]  # the float32 twin localises a bf16 failure
    # an autoep_size the machine cannot hold is verified at the largest that fits, saying so
    eight, _ = _setup(MIXTRAL, {**ZERO1, "expert_parallel": {"enabled": True, "autoep_size": 8}}, tmp_path)
    (row,) = ADAPTER.rows(4, user_config=eight)
    assert row.settings.autoep_size == 4 and "verified at autoep_size=4, the largest that fits" in row.note


def test_model_settings_of_the_config_json_change_the_rows(tmp_path):
    """The family, experts and top-k come from the config.json (the routing keys reach AutoEP through the model's
    config, which its presets read: norm_topk_prob, routed_scaling_factor, n_group / topk_group, scoring_func)."""
    from moebench.libraries.autoep.run import model_kwargs

    six = _model(tmp_path, QWEN3, "q64", num_experts=64, num_experts_per_tok=4, norm_topk_prob=False)
    settings, _ = _setup(six, ZERO1, tmp_path)
    (row,) = ADAPTER.rows(2, user_config=settings)
    assert (row.settings.num_experts, row.settings.top_k) == (64, 4)
    kwargs = model_kwargs(row.settings)
    assert (kwargs["num_local_experts"], kwargs["num_experts_per_tok"], kwargs["norm_topk_prob"]) == (64, 4, False)
    softmax = _model(tmp_path, DEEPSEEK, "ds_softmax", scoring_func="softmax")
    _, notes = _setup(softmax, ZERO1, tmp_path)
    assert any(n.startswith('scoring_func="softmax": AutoEP reads it from the model\'s config') for n in notes)


# ------------------------------------------------------------------ the published configs pass (multirank)


@pytest.mark.multirank
def test_published_configs_pass_at_2_and_4_with_a_zero_1_ds_config(tmp_path):
    qwen3, _ = _setup(QWEN3, ZERO1, tmp_path)
    row = _only(_run(2, qwen3))
    assert row["verdict"] == "pass" and row["vacuous_total"] == 0, row
    mixtral, _ = _setup(MIXTRAL, ZERO1, tmp_path)
    row = _only(_run(4, mixtral))
    assert row["verdict"] == "pass" and row["vacuous_total"] == 0, row


@pytest.mark.multirank
def test_aux_loss_a_file_with_output_router_logits_counts_the_load_balancing_loss(tmp_path, monkeypatch):
    """output_router_logits true: the model's loss adds router_aux_loss_coef x its load-balancing loss, on the engine
    (AutoEP's layer) and in the reference alike, and the row passes; an engine whose loss leaves it out fails."""
    from moebench.libraries.autoep import rowmath

    path = _model(tmp_path, QWEN3, "aux", output_router_logits=True, router_aux_loss_coef=0.05)
    settings, _ = _setup(path, ZERO1, tmp_path)
    row = _only(_run(2, settings))
    assert row["verdict"] == "pass" and row["vacuous_total"] == 0, row

    def without_aux(model, ids, multiplier=1.0, labels=None):
        out = model(input_ids=ids, labels=ids if labels is None else labels, output_router_logits=False)
        return out.loss.float() * multiplier

    monkeypatch.setattr(rowmath, "loss_of", without_aux)
    row = _only(_run(2, settings))
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "forward-differs", row["diagnosis"]


@pytest.mark.multirank
def test_normalisation_at_top_1_the_router_is_held_to_zero_not_compared_as_rounding(tmp_path):
    """norm_topk_prob at top-1: the weight is s / s = 1, so the router's gradient is zero in exact arithmetic and
    both sides hold rounding; the row asserts that it stays rounding (it once compared it element-wise and failed,
    reduced-grad-wrong). With output_router_logits the load-balancing loss gives it a gradient: compared again."""
    from moebench.libraries.autoep.rowmath import router_gets_gradient

    assert not router_gets_gradient("qwen3_moe", 1, normalised=True)
    assert router_gets_gradient("qwen3_moe", 1, normalised=False) and router_gets_gradient("qwen3_moe", 2, True)
    assert router_gets_gradient("qwen3_moe", 1, normalised=True, aux=True)
    settings, _ = _setup(_model(tmp_path, QWEN3, "top1", num_experts_per_tok=1), ZERO1, tmp_path)
    row = _only(_run(2, settings))
    assert row["verdict"] == "pass" and row["vacuous_total"] == 0, row


# ------------------------------------------------------------------ DeepSpeed#8475 through the user's files


@pytest.mark.multirank
def test_deepspeed_8475_is_caught_from_a_config_json_and_a_zero_0_clipping_ds_config(tmp_path):
    settings, _ = _setup(QWEN3, ZERO0_CLIP, tmp_path)
    row = _only(_run(2, settings))
    assert row["check"] == "autoep/qwen3_moe/zero0/ep=2/w2/hf-config"
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "global-norm", row["diagnosis"]
    assert "first divergence at ZeRO 0, step 1, all groups, on ranks 0, 1" in row["diagnosis"]
    assert FINDING in row["diagnosis"]


@pytest.mark.multirank
def test_a_config_json_alone_meets_8475_through_deepspeeds_default_clip(tmp_path):
    """No ds_config: DeepSpeed clips at 1.0 by default, at ZeRO 0, with autoep_size = W > 1: #8475 again."""
    settings, _ = _setup(MIXTRAL, None, tmp_path)
    row = _only(_run(2, settings))
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "global-norm", row["diagnosis"]
    assert FINDING in row["diagnosis"]


# ------------------------------------------------------------------ each kept setting, and a wrong implementation


@pytest.mark.multirank
def test_scoring_a_softmax_config_makes_autoep_route_otherwise_than_transformers(tmp_path):
    """scoring_func is read by AutoEP (its deepseek_v3 preset takes the model config's), never by transformers'
    DeepseekV3 (always sigmoid): a config saying softmax makes AutoEP's router score otherwise than the model it
    converts, and the row shows it from the first loss."""
    settings, _ = _setup(_model(tmp_path, DEEPSEEK, "ds_softmax", scoring_func="softmax"), ZERO1, tmp_path)
    row = _only(_run(2, settings))
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "forward-differs", row["diagnosis"]
    assert "first divergence at ZeRO 1, step 1, output" in row["diagnosis"]


@pytest.mark.multirank
def test_bias_autoep_losing_the_score_correction_bias_fails_the_deepseek_row(tmp_path, monkeypatch):
    """The e_score_correction_bias is carried into AutoEP's router; an AutoEP that does not find it (as
    DeepSpeed#8369 did on 0.19.2-0.19.5) routes otherwise and fails the published DeepSeek-V3 row."""
    import deepspeed.module_inject.auto_ep_layer as auto_ep_layer

    monkeypatch.setattr(auto_ep_layer, "_copy_e_score_correction_bias", lambda *args, **kwargs: None)
    settings, _ = _setup(DEEPSEEK, ZERO1, tmp_path)
    row = _only(_run(2, settings))
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "forward-differs", row["diagnosis"]


@pytest.mark.multirank
def test_normalisation_autoep_ignoring_norm_topk_prob_fails_only_where_the_file_turns_it_off(tmp_path, monkeypatch):
    """AutoEP reads norm_topk_prob from the model's config (resolve_route_norm); one that always normalises passes
    the published Qwen3 (norm_topk_prob true) and fails the same file with it false."""
    from deepspeed.module_inject.auto_ep_presets import base

    monkeypatch.setattr(base.AutoEPPresetAdapter, "resolve_route_norm",
                        lambda self, config, preset, model_config: True)
    published, _ = _setup(QWEN3, ZERO1, tmp_path)
    assert _only(_run(2, published))["verdict"] == "pass"
    off, _ = _setup(_model(tmp_path, QWEN3, "no_norm", norm_topk_prob=False), ZERO1, tmp_path)
    row = _only(_run(2, off))
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "forward-differs", row["diagnosis"]


@pytest.mark.multirank
def test_clip_a_per_rank_clip_norm_fails_the_users_clipping_row(tmp_path, monkeypatch):
    autoep_faults.FAULTS["per-rank-clip-norm"](monkeypatch.setattr)
    settings, _ = _setup(MIXTRAL, ZERO1, tmp_path)
    row = _only(_run(2, settings))
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "global-norm", row["diagnosis"]
    assert "the ranks disagree on the global norm" in row["diagnosis"]


def _loss_divided_twice(monkeypatch) -> None:
    """The engine's backward divides the loss by gradient_accumulation_steps twice (DeepSpeed#8245 on 0.19.2)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    backward = DeepSpeedEngine.backward

    def twice(self, loss, *args, **kwargs):
        return backward(self, loss / self.gradient_accumulation_steps(), *args, **kwargs)

    monkeypatch.setattr(DeepSpeedEngine, "backward", twice)


@pytest.mark.multirank
def test_accumulation_a_double_division_fails_only_where_the_ds_config_accumulates(tmp_path, monkeypatch):
    _loss_divided_twice(monkeypatch)
    one, _ = _setup(MIXTRAL, {**ZERO1, "gradient_clipping": 0.0}, tmp_path)
    assert _only(_run(2, one))["verdict"] == "pass"  # one micro-step: dividing by 1 twice changes nothing
    two, _ = _setup(MIXTRAL, {**ZERO1, "gradient_clipping": 0.0, "gradient_accumulation_steps": 2}, tmp_path)
    row = _only(_run(2, two))
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "accum-boundary", row["diagnosis"]
    assert "divided by grad_accum = 2 twice" in row["diagnosis"]


@pytest.mark.multirank
def test_precision_a_bf16_ds_config_runs_bf16_and_its_fp32_twin_and_catches_summed_experts(tmp_path, monkeypatch):
    settings, _ = _setup(MIXTRAL, {**ZERO1, "bf16": {"enabled": True}}, tmp_path)
    found = _run(2, settings)
    assert {k: r["verdict"] for k, r in found.items()} == {"mixtral/zero1/ep=2/w2/hf-config": "pass",
                                                           "mixtral/zero1/ep=2/w2/hf-config+fp32": "pass"}
    autoep_faults.FAULTS["expert-grads-summed"](monkeypatch.setattr)
    found = _run(2, settings)
    for row in found.values():  # the bf16 row by the noise model, its float32 twin per element: both named
        assert row["diagnosis_name"] == "expert-grad-scale", row["diagnosis"]
        assert "expert gradients scaled by 2" in row["diagnosis"]


# ------------------------------------------------------------------ the whole user setups (slow)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_published_config_with_zero_1_and_with_zero_0_clipping(tmp_path, world_size):
    """Each published config: passes with a ZeRO 1 ds_config, fails as #8475 with ZeRO 0 + clipping."""
    for path in (QWEN3, DEEPSEEK, MIXTRAL):
        settings, _ = _setup(path, ZERO1, tmp_path)
        row = _only(_run(world_size, settings))
        assert row["verdict"] == "pass" and row["vacuous_total"] == 0, row
        settings, _ = _setup(path, ZERO0_CLIP, tmp_path)
        row = _only(_run(world_size, settings))
        assert row["diagnosis_name"] == "global-norm" and FINDING in row["diagnosis"], row["diagnosis"]

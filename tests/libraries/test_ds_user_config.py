"""verify-parity --ds-config: a user's DeepSpeed config read into the engine rows' settings, with one note
per key not honoured here; bad files are one line naming --ds-config, exit 2, nothing written."""

from __future__ import annotations

import json
import os

import pytest
from helpers import library_checks
from typer.testing import CliRunner

from moebench.cli.app import app
from moebench.errors import UserError
from moebench.libraries.deepspeed.user_config import DEFAULTS, FP16_DEFAULTS, TRAINER_AUTO, read_user_config
from moebench.libraries.records import WIDTH

USER = {
    "train_batch_size": 64,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "offload_optimizer": {"device": "nvme"}},
    "steps_per_print": 10,
    "prescale_gradients": True,
}


def _file(tmp_path, doc, name="ds.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def _note(notes: list[str], start: str) -> str:
    found = [n for n in notes if n.startswith(start)]
    assert len(found) == 1, (start, notes)
    return found[0]


def test_settings_come_from_the_file_and_each_unhonoured_key_has_its_line(tmp_path):
    settings, notes = read_user_config(_file(tmp_path, USER))
    assert settings == {"zero_stage": 2, "clip": 1.0, "grad_accum": 2, "precision": "bf16"}
    assert "not honoured" in _note(notes, "zero_optimization.offload_optimizer.device='nvme'")
    optimizer = _note(notes, "optimizer: your AdamW (lr 0.0003) is replaced by SGD")
    assert "Adam divides" in optimizer and "scaled uniformly" in optimizer
    assert "WarmupLR" in _note(notes, "scheduler WarmupLR")
    rest = _note(notes, "not passed on")
    assert "prescale_gradients" in rest and "zero_optimization.overlap_comm" in rest
    assert "steps_per_print" not in rest  # logging only


def test_an_empty_file_verifies_deepspeeds_defaults_and_still_names_the_optimizer(tmp_path):
    settings, notes = read_user_config(_file(tmp_path, {}))
    assert settings == DEFAULTS
    assert notes == [_note(notes, "optimizer: the optimizer your code passes to deepspeed.initialize")]


@pytest.mark.parametrize("doc, settings, note", [
    ({"zero_optimization": {"stage": 3}}, {"zero_stage": 2}, "zero_optimization.stage=3: DeepSpeed's MoE refuses"),
    ({"fp16": {"enabled": True}}, {"precision": "fp16", **FP16_DEFAULTS}, None),
    ({"fp16": {"enabled": True, "loss_scale": 128, "auto_cast": True}},
     {"precision": "fp16", **FP16_DEFAULTS, "loss_scale": 128.0}, "fp16.auto_cast=true: not honoured"),
    ({"fp16": {"enabled": True, "hysteresis": 1, "initial_scale_power": 12, "loss_scale_window": 5,
               "consecutive_hysteresis": True, "min_loss_scale": 4}},
     {"precision": "fp16", "loss_scale": 0.0, "hysteresis": 1, "initial_scale_power": 12, "loss_scale_window": 5,
      "consecutive_hysteresis": True, "min_loss_scale": 4}, None),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, {"precision": "bf16"},
     "bf16.bf16_master_weights_and_grads=true: not honoured; the rows keep fp32 masters"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}}, {"precision": "bf16"},
     "bf16.immediate_grad_update=true: not honoured; DeepSpeed's default (false) is used"),
    ({"fp16": {"enabled": False, "auto_cast": True}}, {}, None),  # a section that is off is not read further
    ({"bfloat16": {"enabled": True}}, {"precision": "bf16"}, None),
    ({"gradient_accumulation_steps": "auto"}, {"grad_accum": 1}, 'gradient_accumulation_steps="auto"'),
    ({"gradient_clipping": 0.04, "zero_optimization": {"stage": 1}}, {"clip": 0.04, "zero_stage": 1}, None),
    # a clip the small model's gradient never reaches: the rows multiply the loss so that it binds
    ({"gradient_clipping": 1.0}, {"clip": 1.0}, "gradient_clipping 1: the small model's gradient norm (0.15-0.4) "
                                                "never reaches it, so each row multiplies its loss by 20"),
])
def test_what_is_not_honoured_is_replaced_and_named(tmp_path, doc, settings, note):
    got, notes = read_user_config(_file(tmp_path, doc))
    assert got == {**DEFAULTS, **settings}
    if note:
        _note(notes, note)
    else:
        assert len(notes) == 1  # the optimizer's line only


BAD = [
    ('{"zero_optimization": ', "is not valid JSON"),
    ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage in"),
    ({"zero_optimization": {"stage": 4}}, "must be at most 3 (DeepSpeed's stages), got 4"),
    ({"zero_optimization": [2]}, "must be a JSON object"),
    ({"gradient_clipping": -1}, "gradient_clipping in"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps in"),
    ({"gradient_accumulation_steps": 1.5}, "must be a whole number"),
    ({"gradient_accumulation_steps": 10**21}, "must be at most 1024"),
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled in"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enables both fp16 and bf16"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale in"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis in"),
    ({"fp16": {"enabled": True, "initial_scale_power": 65}}, "must be at most 64"),
    ({"fp16": {"enabled": "auto", "loss_scale": "auto"}}, "fp16.loss_scale in"),  # the Trainer fills only enabled
    ([1, 2], "holds a list, not a JSON object"),
    ("null", "holds null, not a JSON object"),
    ('{"a": 1, "a": 2}', "gives the key 'a' twice"),
    ({"optimizer": {"type": "os.system"}}, "is neither a DeepSpeed optimizer"),
    ({"scheduler": {"type": "Frobnicate"}}, "is not one of DeepSpeed's schedulers"),
]


def test_comments_are_read_as_deepspeed_reads_them(tmp_path):
    settings, _ = read_user_config(_file(tmp_path, '// my run\n{"zero_optimization": {"stage": 1}, # ZeRO\n}'))
    assert settings["zero_stage"] == 1


def test_fp16_defaults_are_deepspeeds_own():
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    fields = DeepSpeedFP16Config.model_fields
    assert FP16_DEFAULTS == {k: fields[k].default for k in FP16_DEFAULTS}


def test_the_trainers_defaults_are_transformers_own():
    transformers = pytest.importorskip("transformers")
    fields = {f.name: f.default for f in __import__("dataclasses").fields(transformers.TrainingArguments)}
    for dotted, (argument, default) in TRAINER_AUTO.items():
        names = [a.removeprefix("--") for a in argument.split() if a.startswith("--")]
        if default is None or not names:
            continue
        got = [fields[n] for n in names]
        assert (got if len(got) > 1 else got[0]) == default, (dotted, got)


TEMPLATE = {  # the Hugging Face Trainer's ZeRO 2 template (docs: "DeepSpeed" integration)
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                          "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_every_auto_of_the_trainers_template_is_filled_as_the_trainer_does_one_line_per_key(tmp_path):
    settings, notes = read_user_config(_file(tmp_path, TEMPLATE))
    assert settings == {"zero_stage": 2, "clip": 1.0, "grad_accum": 1, "precision": "fp32"}
    for key, shown in (("fp16.enabled", "off"), ("bf16.enabled", "off"), ("gradient_clipping", "1"),
                       ("gradient_accumulation_steps", "1")):
        line = _note(notes, f'{key}="auto": filled as the Hugging Face Trainer fills it')
        assert f"verifying {shown}" in line
    assert "write true to verify fp16" in _note(notes, 'fp16.enabled="auto"')
    unused = _note(notes, '"auto" (the Trainer fills these from its arguments; the rows do not use them)')
    assert "optimizer.params.lr (--learning_rate)" in unused and "train_batch_size" in unused
    on = {**TEMPLATE, "fp16": {**TEMPLATE["fp16"], "enabled": True}}
    settings, _ = read_user_config(_file(tmp_path, on, name="on.json"))
    assert settings == {"zero_stage": 2, "clip": 1.0, "grad_accum": 1, "precision": "fp16", **FP16_DEFAULTS}


@pytest.mark.parametrize("doc, needle", BAD)
def test_a_bad_value_is_a_user_error_naming_the_flag(tmp_path, doc, needle):
    with pytest.raises(UserError) as err:
        read_user_config(_file(tmp_path, doc))
    assert err.value.flag == "--ds-config" and needle in str(err.value), str(err.value)


def _invoke(*args):
    return CliRunner().invoke(app, ["verify-parity", *args])


def _nothing_written() -> bool:
    return not os.path.exists(os.path.join(os.environ["MOEBENCH_RESULTS"], "parity"))


@pytest.mark.parametrize("doc, extra, needle", [
    (BAD[1][0], (), BAD[1][1]),
    ("null", (), "holds null, not a JSON object"),
    ({"optimizer": {"type": "os.system"}}, (), "is neither a DeepSpeed optimizer"),
    ({"gradient_accumulation_steps": 10**21}, (), "must be at most 1024"),
    (BAD[0][0], (), BAD[0][1]),
    ({}, ("--checks", "deepspeed-moe-ep"), "not checks; drop --checks or --ds-config"),
    ({}, ("--library", "fairscale"), "add deepspeed or autoep to --library or drop --ds-config"),
])
def test_bad_ds_config_on_the_cli_is_one_line_exit_2_and_nothing_written(tmp_path, doc, extra, needle):
    result = _invoke("--ds-config", _file(tmp_path, doc), *extra)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --ds-config: ") and needle in lines[0], lines
    assert _nothing_written()


def test_row_checks_hand_the_settings_to_the_adapter_and_label_the_rows():
    settings = {"zero_stage": 1, "clip": 0.5, "grad_accum": 2, "precision": "fp32"}
    checks = library_checks(["deepspeed"], (2, 4), user_configs={"deepspeed": settings})
    assert checks
    for check in checks:
        labels = dict(check.check.labels)
        assert {k: labels[k] for k in settings} == settings and labels["ep_size"] >= 1
        assert check.check.world_size % labels["ep_size"] == 0


@pytest.mark.multirank
def test_ds_config_runs_the_engine_rows_with_the_users_settings(tmp_path):
    path = _file(tmp_path, USER, name="user.json")
    result = _invoke("--ds-config", path, "-n", "2")
    # every row passes on the pinned DeepSpeed: the user's clip (1.0, far above the small model's gradient
    # norm) binds because the rows multiply the loss by 20; before, every row failed as vacuous
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.index("--ds-config user.json:") < out.index("verify-parity --library:")  # notes before the table
    assert "verifies ZeRO 2, gradient_clipping 1, gradient_accumulation_steps 2, bf16, SGD" in out
    assert "replaced by SGD" in out
    assert not [line for line in out.splitlines() if len(line) > WIDTH and not line.startswith("saved to ")]
    root = os.path.join(os.environ["MOEBENCH_RESULTS"], "parity")
    (run,) = os.listdir(root)
    summary = json.load(open(os.path.join(root, run, "summary.json")))
    settings, notes = read_user_config(path)
    assert summary["ds_config"] == {"path": path, "settings": settings, "notes": notes}
    assert summary["rows"] and all(r["library"] == "deepspeed" for r in summary["rows"])
    for row in summary["rows"]:
        assert {k: row[k] for k in settings} == settings and row["world_size"] == 2
        assert row["verdict"] == "pass" and row["loss_multiplier"] == 20
        assert row["version"] and row["verdict"] in ("pass", "fail")

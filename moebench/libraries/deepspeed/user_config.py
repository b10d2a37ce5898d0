"""verify-parity --ds-config: the settings of a user's DeepSpeed config that the engine rows verify.

The file is read as `run deepspeed --ds-config` reads it (variants/deepspeed/ds_config.read_checked: hjson, a key
given twice refused, every number within its bound, the optimizer and scheduler types DeepSpeed builds), then
checked by DeepSpeed's own section models. From it the rows take what touches expert gradients: the ZeRO stage,
gradient clipping, gradient accumulation, the precision and the whole fp16 section (the loss scale: static, or
dynamic with its power, window, hysteresis and floor). Every key of the fp16 / bf16 sections (as DeepSpeed's
models list them) is honoured or named in one line; so is every other key not honoured, and the optimizer, which
the rows always replace by SGD.

"auto" (the Hugging Face Trainer's template) follows one rule: filled as the Trainer fills it, from its
TrainingArguments' defaults, with one line per key the rows use (the others in one line); an "auto" the Trainer
does not fill is refused, as DeepSpeed would refuse it.
"""

from __future__ import annotations

import copy
from typing import Any

from moebench.errors import UserError
from moebench.libraries.deepspeed.rowmath import FP16_KEYS
from moebench.variants.deepspeed.ds_config import read_checked, validate_with_deepspeed

FLAG = "--ds-config"
VERIFIED_ZERO_STAGES = (0, 1, 2)
"""The ZeRO stages the engine rows run: DeepSpeed's own MoE refuses stage 3 ("MoE not supported with Stage 3")."""
STAGE_3_STANDIN = 2
"""Stage 3 is verified at stage 2: the nearest stage that also partitions the gradients and the optimizer state."""
BINDING_CLIP = 0.05
"""A gradient_clipping that binds at every step on the engine rows' small model: its unclipped global norm
is 0.15-0.4 (measured). The default matrix's clip rows use it (engine.CLIP)."""
FP16_DEFAULTS = {"loss_scale": 0.0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                 "consecutive_hysteresis": False, "min_loss_scale": 1}
"""DeepSpeed's fp16 defaults (DeepSpeedFP16Config; tests/libraries/test_ds_user_config.py holds them to it)."""
DEFAULTS: dict[str, Any] = {"zero_stage": 0, "clip": 0.0, "grad_accum": 1, "precision": "fp32"}
"""DeepSpeed's own defaults for a key the file does not set (no ZeRO, no clipping, one micro-step, fp32); an fp16
config's settings add its fp16 section over FP16_DEFAULTS."""
OPTIMIZER_WHY = ("Adam divides each step by the gradient's own running size, so a gradient scaled "
                 "uniformly by k would step the same and a mis-scaled reduction would pass")
"""Why the rows replace the user's optimizer by SGD (whose step is proportional to the gradient)."""
HONOURED_KEYS = ("zero_optimization", "gradient_clipping", "gradient_accumulation_steps", "fp16", "bf16",
                 "bfloat16", "optimizer", "scheduler", "train_batch_size", "train_micro_batch_size_per_gpu")
"""Top-level keys this module reads or names on its own line; every other key gets one shared line."""
LOGGING_KEYS = ("steps_per_print", "wall_clock_breakdown", "comms_logger", "flops_profiler", "tensorboard", "wandb",
                "csv_monitor", "comet", "dump_state", "memory_breakdown")
"""Top-level keys that change only what DeepSpeed logs: not worth a note."""
ZERO_KEYS_READ = ("stage", "offload_optimizer", "offload_param")
"""zero_optimization keys with their own handling; its other keys (bucket sizes, overlap_comm, ...) are listed."""
HALF_HONOURED = {"fp16": ("enabled", *FP16_KEYS), "bf16": ("enabled",)}
"""The keys of DeepSpeed's fp16 / bf16 sections the rows honour; any other key of a section (DeepSpeed's model
lists them) set to another value than DeepSpeed's default is named as not honoured."""
HALF_WHY = {"auto_cast": "the rows cast their inputs to fp16 themselves",
            "fp16_master_weights_and_grads": "fp16 master weights need DeepSpeedCPUAdam (a compiled op); the rows "
                                             "keep fp32 masters, as their reference does",
            "bf16_master_weights_and_grads": "the rows keep fp32 masters, as their reference does",
            "bf16_optimizer_states": "the rows keep fp32 masters and SGD has no state"}
"""Why a half-precision key is not honoured (one line each; any other: DeepSpeed's default is used)."""
TRAINER_AUTO = {
    "gradient_accumulation_steps": ("--gradient_accumulation_steps", 1),
    "gradient_clipping": ("--max_grad_norm", 1.0),
    "fp16.enabled": ("--fp16", False),
    "bf16.enabled": ("--bf16", False),
    "bfloat16.enabled": ("--bf16", False),
    "train_micro_batch_size_per_gpu": ("--per_device_train_batch_size", 8),
    "train_batch_size": ("world size x micro batch x accumulation", None),
    "optimizer.params.lr": ("--learning_rate", 5e-05),
    "optimizer.params.betas": ("--adam_beta1 --adam_beta2", [0.9, 0.999]),
    "optimizer.params.eps": ("--adam_epsilon", 1e-08),
    "optimizer.params.weight_decay": ("--weight_decay", 0.0),
    "scheduler.params.warmup_min_lr": ("0", 0),
    "scheduler.params.warmup_max_lr": ("--learning_rate", 5e-05),
    "scheduler.params.warmup_num_steps": ("--warmup_steps", None),
    "scheduler.params.total_num_steps": ("the run's steps", None),
    "zero_optimization.reduce_bucket_size": ("the model's hidden size squared", None),
    "zero_optimization.stage3_prefetch_bucket_size": ("the model's hidden size", None),
    "zero_optimization.stage3_param_persistence_threshold": ("the model's hidden size", None),
}
"""What the Hugging Face Trainer fills each "auto" with (transformers' HfTrainerDeepSpeedConfig): the argument it
reads and that argument's TrainingArguments default (None: computed from the run or the model; the rows do not
use those keys). tests/libraries/test_ds_user_config.py holds the defaults to transformers' own."""
ROW_KEYS = ("gradient_accumulation_steps", "gradient_clipping", "fp16.enabled", "bf16.enabled", "bfloat16.enabled")
"""The "auto" keys the rows use: one line each."""


def read_user_config(path: str) -> tuple[dict[str, Any], list[str]]:
    """(settings, notes): settings = {"zero_stage", "clip", "grad_accum", "precision", and for fp16 the fp16
    section's FP16_KEYS} taken from the file (DeepSpeed's defaults where it sets none); notes = one line per key
    not honoured here, per "auto" filled, and one naming the optimizer replaced by SGD. Bad values raise UserError
    naming --ds-config."""
    user = read_checked(path)
    notes: list[str] = []
    user = _fill_auto(user, path, notes)
    validate_with_deepspeed(user, path)
    settings = dict(DEFAULTS)
    zero = user.get("zero_optimization", {})
    if "stage" in zero:
        stage = int(zero["stage"])
        if stage == 3:
            notes.append(f"zero_optimization.stage=3: DeepSpeed's MoE refuses ZeRO 3; verifying stage "
                         f"{STAGE_3_STANDIN} (also partitions gradients and optimizer state)")
            stage = STAGE_3_STANDIN
        settings["zero_stage"] = stage
    for key, what in (("offload_optimizer", "optimizer state"), ("offload_param", "parameters")):
        device = zero.get(key, {}).get("device") if isinstance(zero.get(key), dict) else None
        if device not in (None, "none"):
            notes.append(f"zero_optimization.{key}.device={device!r}: not honoured; nothing is offloaded "
                         f"(offloading the {what} needs DeepSpeedCPUAdam, a compiled op): that path is not "
                         "verified")
    if "gradient_accumulation_steps" in user:
        settings["grad_accum"] = int(user["gradient_accumulation_steps"])
    settings["precision"] = _precision(user, path, notes)
    if settings["precision"] == "fp16":
        settings.update({**FP16_DEFAULTS, **{k: user["fp16"][k] for k in FP16_KEYS if k in user["fp16"]}})
        settings["loss_scale"] = float(settings["loss_scale"])
        settings["min_loss_scale"] = int(settings["min_loss_scale"])
    if "gradient_clipping" in user:
        settings["clip"] = float(user["gradient_clipping"])
        note = clip_note(settings["clip"], settings["precision"])
        if note:
            notes.append(note)
    notes.append(_optimizer_note(user.get("optimizer")))
    scheduler = user.get("scheduler")
    if isinstance(scheduler, dict) and scheduler.get("type"):
        notes.append(f"scheduler {scheduler['type']}: not used; the rows take a few steps at one fixed "
                     "learning rate")
    if any(k in user for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        notes.append("train_batch_size / micro batch: not used; every row runs the small model's own "
                     "global batch, as its one-process reference does")
    others = [k for k in user if k not in HONOURED_KEYS and k not in LOGGING_KEYS]
    others += [f"zero_optimization.{k}" for k in zero if k not in ZERO_KEYS_READ]
    if others:
        notes.append(f"not passed on (DeepSpeed's defaults are used): {', '.join(others)}")
    return settings, notes


def clip_multiplier(clip: float, precision: str) -> float:
    """What a row multiplies its loss by (engine and reference alike) so that a user's gradient_clipping binds on
    the small model: clip / BINDING_CLIP when the clip is larger than that, else 1. An unclipped norm below the clip
    would make the clip row vacuous (a wrong global norm could not change the update). fp16 rows never multiply it
    (their scaled gradients would overflow): they clip at BINDING_CLIP instead (row_clip)."""
    return clip / BINDING_CLIP if clip > BINDING_CLIP and precision != "fp16" else 1.0


def row_clip(clip: float, precision: str) -> float:
    """The gradient_clipping a row passes to DeepSpeed: the user's, but BINDING_CLIP for an fp16 row whose clip the
    small model's norm never reaches (clipping is the same mathematics at any threshold the norm exceeds)."""
    return BINDING_CLIP if clip > BINDING_CLIP and precision == "fp16" else clip


def clip_note(clip: float, precision: str) -> str:
    """The line that says how a user's clip binds on the small model ("" when it binds as it is)."""
    if clip <= BINDING_CLIP:
        return ""
    if precision == "fp16":
        return (f"gradient_clipping {clip:g}: the small model's gradient norm (0.15-0.4) never reaches it, and "
                "multiplying the loss to reach it would overflow fp16's scaled gradients, so the fp16 rows clip at "
                f"{BINDING_CLIP:g} (the same mathematics at any threshold the norm exceeds)")
    multiplier = clip_multiplier(clip, precision)
    return (f"gradient_clipping {clip:g}: the small model's gradient norm (0.15-0.4) never reaches it, so each row "
            f"multiplies its loss by {multiplier:g}, engine and reference alike: your clip then binds at every step, "
            f"as on a real model (clipping at {clip:g} with the loss x {multiplier:g} is clipping at "
            f"{BINDING_CLIP:g} with the loss as it is)")


def verified_line(settings: dict[str, Any]) -> str:
    """What the rows verify, in the file's own terms."""
    precision = settings["precision"]
    if precision == "fp16":
        s = {**FP16_DEFAULTS, **settings}
        precision = (f"fp16 (static loss scale {s['loss_scale']:g})" if s["loss_scale"] > 0 else
                     f"fp16 (dynamic loss scale from 2^{s['initial_scale_power']}, window {s['loss_scale_window']}, "
                     f"hysteresis {s['hysteresis']}, min {s['min_loss_scale']})")
    return (f"verifies ZeRO {settings['zero_stage']}, gradient_clipping {settings['clip']:g}, "
            f"gradient_accumulation_steps {settings['grad_accum']}, {precision}, SGD")


def _show(value: Any) -> str:
    import json

    return json.dumps(value)[:40]


def _fill_auto(user: dict, path: str, notes: list[str]) -> dict:
    """The config with every "auto" filled as the Hugging Face Trainer fills it (its arguments' defaults), a note
    per key the rows use and one for the others; an "auto" the Trainer does not fill: UserError."""
    from moebench.variants.deepspeed.ds_schema import auto_paths

    autos = auto_paths(user)
    unknown = [a for a in autos if a not in TRAINER_AUTO]
    if unknown:
        raise UserError(f"{', '.join(unknown)} in {path}: \"auto\", which the Hugging Face Trainer does not fill "
                        "(DeepSpeed would refuse it): give a value", flag=FLAG)
    filled = copy.deepcopy(user)
    unused = []
    for dotted in autos:
        argument, default = TRAINER_AUTO[dotted]
        *parents, leaf = dotted.split(".")
        tree = filled
        for key in parents:
            tree = tree[key]
        if dotted not in ROW_KEYS:
            unused.append(f"{dotted} ({argument})")
            del tree[leaf]  # not used by the rows: DeepSpeed's default stands in
            continue
        tree[leaf] = default
        shown = ("off" if default is False else f"{default:g}")
        then = f"; write true to verify {parents[0]}" if default is False else ""
        notes.append(f"{dotted}=\"auto\": filled as the Hugging Face Trainer fills it, from {argument} "
                     f"(default {shown}): verifying {shown}{then}")
    if unused:
        notes.append(f"\"auto\" (the Trainer fills these from its arguments; the rows do not use them): "
                     f"{', '.join(unused)}")
    return filled


def _precision(user: dict, path: str, notes: list[str]) -> str:
    """"fp16", "bf16" (or its old name bfloat16) when enabled, else "fp32"; every key of an enabled section that is
    not honoured is named (DeepSpeed's models list them)."""
    enabled = []
    for key in ("fp16", "bf16", "bfloat16"):
        section = user.get(key)
        if section is None:
            continue
        if not isinstance(section.get("enabled", False), bool):
            raise UserError(f"{key}.enabled in {path} must be true or false, got {_show(section['enabled'])}; "
                            "fix the file", flag=FLAG)
        if section.get("enabled"):
            enabled.append(key)
            notes += _not_honoured(key, section)
    if "fp16" in enabled and len(enabled) > 1:
        raise UserError(f"{path} enables both fp16 and {enabled[1]}; DeepSpeed takes one; fix the file", flag=FLAG)
    return "fp16" if enabled == ["fp16"] else "bf16" if enabled else "fp32"


def _not_honoured(key: str, section: dict) -> list[str]:
    """One line per key of an enabled fp16 / bf16 section the rows do not honour (set to another value than
    DeepSpeed's default, as DeepSpeed's own model of that section declares it)."""
    from moebench.variants.deepspeed.ds_schema import _section_models

    model = dict(_section_models())[key]
    honoured = HALF_HONOURED["fp16" if key == "fp16" else "bf16"]
    out = []
    for name, field in model.model_fields.items():
        if name in honoured or name not in section or section[name] == field.default:
            continue
        why = HALF_WHY.get(name, f"DeepSpeed's default ({_show(field.default)}) is used")
        out.append(f"{key}.{name}={_show(section[name])}: not honoured; {why}")
    return out


def _optimizer_note(optimizer: Any) -> str:
    if isinstance(optimizer, dict) and optimizer.get("type"):
        lr = (optimizer.get("params") or {}).get("lr") if isinstance(optimizer.get("params"), dict) else None
        yours = f"your {optimizer['type']}" + (f" (lr {lr})" if isinstance(lr, (int, float)) else "")
    else:
        yours = "the optimizer your code passes to deepspeed.initialize (none in the file)"
    return f"optimizer: {yours} is replaced by SGD: {OPTIMIZER_WHY}"


def read_setup(request) -> tuple[dict[str, Any], list[str]]:
    """The engine rows' reader of a verify-parity request (libraries/setups.py): its --ds-config."""
    return read_user_config(request.ds_config)

"""verify-parity --ds-config: the settings of a user's DeepSpeed config that the engine rows verify.

From the user's file (read by the run command's defensive loader) the rows take what touches expert
gradients: the ZeRO stage, gradient clipping, gradient accumulation and the precision. What cannot be
honoured on this machine, or is not passed on, is named in one line each (`notes`); so is the
optimizer, which the rows always replace by SGD.
"""

from __future__ import annotations

from typing import Any

from moebench.errors import UserError
from moebench.variants.deepspeed.ds_config import load_ds_config

FLAG = "--ds-config"
VERIFIED_ZERO_STAGES = (0, 1, 2)
"""The ZeRO stages the engine rows run: DeepSpeed's own MoE refuses stage 3 ("MoE not supported with Stage 3")."""
STAGE_3_STANDIN = 2
"""Stage 3 is verified at stage 2: the nearest stage that also partitions the gradients and the optimizer state."""
BINDING_CLIP = 0.05
"""A gradient_clipping that binds at every step on the engine rows' small model: its unclipped global norm
is 0.15-0.4 (measured). The default matrix's clip rows use it (engine.CLIP)."""
DEFAULTS: dict[str, Any] = {"zero_stage": 0, "clip": 0.0, "grad_accum": 1, "precision": "fp32"}
"""DeepSpeed's own defaults for a key the file does not set (no ZeRO, no clipping, one micro-step, fp32)."""
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


def read_user_config(path: str) -> tuple[dict[str, Any], list[str]]:
    """(settings, notes): settings = {"zero_stage", "clip", "grad_accum", "precision"} taken from the
    file (DeepSpeed's defaults where it sets none); notes = one line per key not honoured here, and
    one naming the optimizer replaced by SGD. Bad values raise UserError naming --ds-config."""
    user = load_ds_config(path)
    notes: list[str] = []
    settings = dict(DEFAULTS)
    zero = user.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise UserError(f"zero_optimization in {path} must be a JSON object, got {_show(zero)}; fix the file",
                        flag=FLAG)
    stage = _number(zero, "stage", path, "zero_optimization.", kind=int, low=0, notes=notes)
    if stage is not None:
        if stage not in (*VERIFIED_ZERO_STAGES, 3):
            raise UserError(f"zero_optimization.stage={stage} in {path}: DeepSpeed's stages are 0-3; fix the file",
                            flag=FLAG)
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
    clip = _number(user, "gradient_clipping", path, kind=float, low=0.0, notes=notes)
    if clip is not None:
        settings["clip"] = float(clip)
        multiplier = clip_loss_multiplier(float(clip))
        if multiplier > 1:
            notes.append(f"gradient_clipping {clip:g}: the small model's gradient norm (0.15-0.4) never reaches "
                         f"it, so each row multiplies its loss by {multiplier:g}, engine and reference alike: "
                         f"your clip then binds at every step, as on a real model (clipping at {clip:g} with "
                         f"the loss x {multiplier:g} is clipping at {BINDING_CLIP:g} with the loss as it is)")
    accum = _number(user, "gradient_accumulation_steps", path, kind=int, low=1, notes=notes)
    if accum is not None:
        settings["grad_accum"] = accum
    settings["precision"] = _precision(user, path, notes)
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


def clip_loss_multiplier(clip: float) -> float:
    """What a row multiplies its loss by (engine and reference alike) so that a user's gradient_clipping binds
    on the small model: clip / BINDING_CLIP when the clip is larger than that, else 1. An unclipped norm below
    the clip would make the clip row vacuous (a wrong global norm could not change the update)."""
    return clip / BINDING_CLIP if clip > BINDING_CLIP else 1.0


def verified_line(settings: dict[str, Any]) -> str:
    """What the rows verify, in the file's own terms."""
    return (f"verifies ZeRO {settings['zero_stage']}, gradient_clipping {settings['clip']:g}, "
            f"gradient_accumulation_steps {settings['grad_accum']}, {settings['precision']}, SGD")


def _show(value: Any) -> str:
    import json

    return json.dumps(value)[:40]


def _number(tree: dict, key: str, path: str, prefix: str = "", *, kind: type, low: float,
            notes: list[str]) -> Any:
    """tree[key] as `kind` (>= low); None when absent or "auto" (a note says so)."""
    if key not in tree:
        return None
    value = tree[key]
    if value == "auto":  # Hugging Face's Trainer fills these in; without it, DeepSpeed's default
        notes.append(f"{prefix}{key}=\"auto\": filled in by the Hugging Face Trainer; verifying DeepSpeed's "
                     "default")
        return None
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not integral) \
            or value != value or value in (float("inf"), float("-inf")) or value < low:
        want = "a whole number" if kind is int else "a number"
        raise UserError(f"{prefix}{key}={_show(value)} in {path}: must be {want} >= {low:g}; fix the file",
                        flag=FLAG)
    return int(value) if kind is int else float(value)


def _precision(user: dict, path: str, notes: list[str]) -> str:
    """"bf16" when bf16 (or its old name bfloat16) is enabled, else "fp32"; fp16 is noted, not honoured."""
    enabled = []
    for key in ("fp16", "bf16", "bfloat16"):
        section = user.get(key)
        if section is None:
            continue
        if not isinstance(section, dict) or not isinstance(section.get("enabled", False), bool):
            raise UserError(f"{key} in {path} must be an object with \"enabled\": true or false, got "
                            f"{_show(section)}; fix the file", flag=FLAG)
        if section.get("enabled"):
            enabled.append(key)
    if "fp16" in enabled and len(enabled) > 1:
        raise UserError(f"{path} enables both fp16 and {enabled[1]}; DeepSpeed takes one; fix the file", flag=FLAG)
    if enabled == ["fp16"]:
        notes.append("fp16.enabled: not honoured; DeepSpeed's fp16 optimizer (loss scaling) needs CUDA and "
                     "these ranks are CPU: verifying fp32")
        return "fp32"
    return "bf16" if enabled else "fp32"


def _optimizer_note(optimizer: Any) -> str:
    if isinstance(optimizer, dict) and optimizer.get("type"):
        lr = (optimizer.get("params") or {}).get("lr") if isinstance(optimizer.get("params"), dict) else None
        yours = f"your {optimizer['type']}" + (f" (lr {lr})" if isinstance(lr, (int, float)) else "")
    else:
        yours = "the optimizer your code passes to deepspeed.initialize (none in the file)"
    return f"optimizer: {yours} is replaced by SGD: {OPTIMIZER_WHY}"

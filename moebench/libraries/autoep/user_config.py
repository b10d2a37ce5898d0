"""verify-parity --ds-config and --hf-config for the AutoEP rows.

--ds-config: what the engine rows take from a user's DeepSpeed config (the DeepSpeed package's reader: ZeRO stage,
clipping, accumulation, precision, each key not honoured named in one line), plus what an AutoEP config adds:
`expert_parallel.autoep_size` and `use_data_before_expert_parallelism`. A file that sets no gradient_clipping is
verified at DeepSpeed's own default (1.0 in 0.19, read from deepspeed.runtime.constants), as the engine clips.

--hf-config: the model AutoEP converts, a config.json read by transformers (moebench.libraries.hf_config: its
routing kept, its sizes shrunk), of a family AutoEP has a preset for (shape.FAMILIES); the row builds that model
instead of the tiny family configs, with the file's experts and top-k, and a micro-batch grown with the experts so
that every expert gets tokens. Without --ds-config the engine settings are DeepSpeed's defaults (said in a note).

A clip larger than the small models' gradient norm would not bind; as on the engine rows, the loss is then
multiplied (engine and reference alike) so that it does, and a note says by how much.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from moebench.errors import UserError
from moebench.libraries.autoep.shape import CLIP
from moebench.libraries.deepspeed import user_config as ds_user_config
from moebench.libraries.spec import SETTING_MAX_CHARS
from moebench.variants.deepspeed.ds_config import load_ds_config

FLAG = ds_user_config.FLAG
AUTOEP_KEYS = ("expert_parallel", "use_data_before_expert_parallelism")
"""Top-level keys the AutoEP rows read (the engine rows' reader lists them as not passed on)."""
EXPERT_PARALLEL_READ = ("enabled", "autoep_size")
"""expert_parallel keys the rows take; its others (preset_model, use_grouped_mm, ...) are named in a note."""


def read_user_config(path: str) -> tuple[dict[str, Any], list[str]]:
    """(settings, notes) for the AutoEP rows: the engine rows' settings plus autoep_size (None: W),
    data_before_expert and loss_multiplier; bad values are a UserError naming --ds-config."""
    settings, notes = ds_user_config.read_user_config(path)
    user = load_ds_config(path)
    notes = [kept for n in notes if not n.startswith("gradient_clipping ") and (kept := _without_autoep_keys(n))]
    if "gradient_clipping" not in user:  # DeepSpeed clips at its default then, and so must the row
        settings["clip"] = deepspeed_default_clip()
        notes.append(f"gradient_clipping not set: DeepSpeed's default {settings['clip']:g} "
                     "(deepspeed.runtime.constants.GRADIENT_CLIPPING_DEFAULT) clips your engine, so the rows clip at "
                     "it too")
    section = user.get("expert_parallel", {})
    if not isinstance(section, dict):
        raise UserError(f"expert_parallel in {path} must be a JSON object, got {type(section).__name__}; fix the file",
                        flag=FLAG)
    size = section.get("autoep_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise UserError(f"expert_parallel.autoep_size={size!r} in {path}: must be a whole number >= 1; fix the file",
                        flag=FLAG)
    if section.get("enabled") is not True:
        notes.append("expert_parallel.enabled is not true in the file: the AutoEP rows turn it on")
    notes.append(f"expert_parallel.autoep_size={size}: used where it divides the world size and the experts, "
                 "else autoep_size = the world size" if size else
                 "expert_parallel.autoep_size not set: verifying autoep_size = the world size")
    others = [f"expert_parallel.{k}" for k in section if k not in EXPERT_PARALLEL_READ]
    if others:
        notes.append(f"not passed on (AutoEP's defaults are used): {', '.join(others)}")
    data_before = user.get("use_data_before_expert_parallelism", False)
    if not isinstance(data_before, bool):
        raise UserError(f"use_data_before_expert_parallelism={data_before!r} in {path}: must be true or false; fix "
                        "the file", flag=FLAG)
    multiplier = settings["clip"] / CLIP if settings["clip"] > CLIP else 1.0
    if multiplier > 1:
        notes.append(f"gradient_clipping {settings['clip']:g}: the small models' gradient norm (1.1-1.8) never "
                     f"reaches it, so each AutoEP row multiplies its loss by {multiplier:g}, engine and reference "
                     "alike: your clip then binds at every step, as on a real model")
    return {**settings, "autoep_size": size if size and size > 1 else None, "data_before_expert": data_before,
            "loss_multiplier": multiplier}, notes


def _without_autoep_keys(note: str) -> str:
    """The engine rows' "not passed on" note without the keys the AutoEP rows do read."""
    head = "not passed on (DeepSpeed's defaults are used): "
    if not note.startswith(head):
        return note
    keys = [k for k in note[len(head):].split(", ") if k not in AUTOEP_KEYS]
    return head + ", ".join(keys) if keys else ""


def deepspeed_default_clip() -> float:
    """The gradient_clipping DeepSpeed applies when its config sets none (1.0 in 0.19), read from DeepSpeed."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    return float(GRADIENT_CLIPPING_DEFAULT)


def engine_defaults() -> tuple[dict[str, Any], list[str]]:
    """(settings, notes) of the engine when no --ds-config is given: DeepSpeed's own defaults."""
    settings = {**ds_user_config.DEFAULTS, "clip": deepspeed_default_clip(), "autoep_size": None,
                "data_before_expert": False}
    multiplier = settings["clip"] / CLIP if settings["clip"] > CLIP else 1.0
    notes = [f"no --ds-config: DeepSpeed's defaults for the engine (ZeRO 0, gradient_clipping {settings['clip']:g} "
             "- DeepSpeed's GRADIENT_CLIPPING_DEFAULT -, one micro-step, fp32, autoep_size = the world size); give "
             "your ds_config with --ds-config to verify yours"]
    if multiplier > 1:
        notes.append(f"gradient_clipping {settings['clip']:g}: each AutoEP row multiplies its loss by {multiplier:g}, "
                     "engine and reference alike, so that the clip binds at every step, as on a real model")
    return {**settings, "loss_multiplier": multiplier}, notes


MODEL_CLIP = 0.2
"""The clip that binds on a --hf-config row's model: the shrunk copies' unclipped norm is 0.47-1.5 (measured on the
Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V3 configs at W = 2 and 4, seeds 0-2, both steps), at least 2.3 x this; a
larger gradient_clipping multiplies the loss by clip / MODEL_CLIP (engine and reference alike) so that it binds."""
SEQS_MIN = 4
"""The default rows' micro-batch (rowmath.SEQS): a --hf-config row never has fewer sequences a rank."""
TOKENS_PER_EXPERT = 48
"""Routed slots per expert over ranks 0 and 1's first micro-batches (what rowmath.build checks on the reference):
48 on average. The whole model runs, so the router's inputs are far from independent (embedding and attention):
measured on DeepSeek-V3's config, 16 routes per expert left 9-17 of 256 experts without tokens, 48 left 0-3 (and
rowmath.build draws again until none is left)."""


def vocab_for(experts: int) -> int:
    """The vocabulary of a --hf-config row's model: the whole causal LM runs, so each token id's embedding is much of
    a router input; 16 ids (hf_config's shrunk vocabulary) would reach few of 128-256 experts. rowmath.VOCAB (32) or
    two ids per expert, whichever is more (an embedding row of 32 floats costs nothing)."""
    from moebench.libraries.autoep.rowmath import VOCAB

    return max(VOCAB, 2 * experts)


def seqs_for(experts: int, top_k: int) -> int:
    """Sequences per rank's micro-batch of a --hf-config row: TOKENS_PER_EXPERT routes per expert on average over
    the first micro-batches of ranks 0 and 1."""
    from moebench.libraries.autoep.rowmath import SEQ_LEN

    return max(SEQS_MIN, math.ceil(TOKENS_PER_EXPERT * experts / (2 * SEQ_LEN * top_k)))


def read_model(path: str) -> tuple[dict[str, Any], list[str]]:
    """(model, notes) of a --hf-config for the AutoEP rows: the family, experts, top-k, the file's path and digest."""
    from moebench.libraries import hf_config
    from moebench.libraries.autoep.shape import FAMILIES

    setup = hf_config.read(path, families=FAMILIES)
    shown = os.path.abspath(path)
    if len(shown) > SETTING_MAX_CHARS or not shown.isprintable():
        raise UserError(f"{path}: its absolute path has {len(shown)} characters (or unprintable ones); a row records "
                        f"it in at most {SETTING_MAX_CHARS}: copy the file to a shorter path", flag=hf_config.FLAG)
    if setup.top_k > setup.num_experts:
        raise UserError(f"{path}: top-{setup.top_k} of {setup.num_experts} experts; fix the file", flag=hf_config.FLAG)
    notes = [n for n in setup.notes if not n.startswith("scoring_func=")]
    config = hf_config.build_config(setup.model_type, setup.kwargs)
    scoring = getattr(config, "scoring_func", None)
    if setup.model_type == "deepseek_v3":
        if scoring in ("softmax", "sigmoid") and scoring != "sigmoid":
            notes.append(f"scoring_func={json.dumps(scoring)}: AutoEP reads it from the model's config and routes "
                         "with it, while transformers' DeepseekV3 model (the reference, and your model without "
                         "AutoEP) always scores with sigmoid: the rows will show where the two differ")
        else:
            notes.append("scoring: sigmoid with e_score_correction_bias (transformers' DeepseekV3 router, and "
                         "AutoEP's deepseek_v3 preset; the rows draw the bias N(0, 0.01^2) so that it moves choices)")
    seqs = seqs_for(setup.num_experts, setup.top_k)
    notes.append(f"AutoEP's {setup.model_type} preset converts the whole model; vocab_size -> "
                 f"{vocab_for(setup.num_experts)} for these rows (each token id's embedding is much of a router "
                 f"input) and {seqs} sequences of 16 tokens a rank, so that each of the {setup.num_experts} experts "
                 f"gets {TOKENS_PER_EXPERT} routes on average (each row asserts that none gets none)")
    if setup.dtype == "bfloat16":
        notes.append("torch_dtype=bfloat16 in the config.json: the engine's precision is the ds_config's "
                     "(bf16.enabled), as DeepSpeed casts the model itself")
    model = {"path": shown, "sha256": setup.sha256, "model_type": setup.model_type,
             "num_experts": setup.num_experts, "top_k": setup.top_k, "kwargs": setup.kwargs,
             "norm_topk_prob": bool(setup.routing.get("norm_topk_prob")),
             "aux_loss": bool(setup.routing.get("output_router_logits"))}
    return model, notes


def read_setup(request) -> tuple[dict[str, Any], list[str]]:
    """The AutoEP rows' reader of a verify-parity request (libraries/setups.py): its --ds-config and --hf-config,
    together (the engine's settings from the one, the model from the other) or alone (--hf-config alone: DeepSpeed's
    defaults for the engine; --ds-config alone: every family's tiny model)."""
    if request.hf_config is None:
        return read_user_config(request.ds_config)
    model, notes = read_model(request.hf_config)
    settings, more = read_user_config(request.ds_config) if request.ds_config is not None else engine_defaults()
    clip = settings["clip"]
    multiplier = clip / MODEL_CLIP if clip > MODEL_CLIP else 1.0
    more = [n for n in more if not (n.startswith("gradient_clipping ") and "multipl" in n)]
    if multiplier > 1:
        more.append(f"gradient_clipping {clip:g}: your model's shrunk copy has a gradient norm of 0.47-1.5 (measured: "
                    f"Mixtral, Qwen3-MoE and DeepSeek-V3 configs, W = 2 and 4), so each row multiplies its loss by "
                    f"{multiplier:g}, engine and reference alike: your clip then binds at every step, as on the real "
                    "model (each row asserts it)")
    return {**settings, "loss_multiplier": multiplier, "model": model}, [*notes, *more]

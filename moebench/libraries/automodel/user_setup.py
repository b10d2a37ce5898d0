"""--recipe and --hf-config for the Automodel rows: the recipe YAML a user launches (`automodel finetune llm -c
recipe.yaml`, or `examples/llm_finetune/finetune.py --config recipe.yaml`) read by Automodel's own config loader, and
the model's config.json the recipe names (nothing is downloaded here), read by transformers (libraries/hf_config.py).

A recipe is read (recipe.py: the file's bounds, its YAML, its imports, its top-level sections, the sections the rows
use through Automodel's own objects), then fitted to the rows (fit.py: the model section, `model.backend`,
`distributed:`, the accumulation, the clip, the optimizer, the loss), each refusal one line naming the flag and the
file, before any rank starts. Then the rows' settings (plain data: summary.json's "setup") and one note per thing
kept, shrunk or not honoured, here. `--hf-config` alone (no recipe) is Automodel's HF model built from that
config.json with the training step's defaults (max_norm 1.0, one micro-batch) and expert parallelism over every rank.
"""

from __future__ import annotations

import json
import os
from typing import Any

from moebench.errors import UserError
from moebench.libraries.automodel import fit, recipe
from moebench.libraries.automodel.recipe import HF, RECIPE

FAMILIES = ("qwen3_moe", "deepseek_v3")
"""The model types whose Automodel classes the rows build (components/models/qwen3_moe, deepseek_v3)."""
MOE_RECORDED = ("n_routed_experts", "n_activated_experts", "score_func", "norm_topk_prob", "softmax_before_topk",
                "n_expert_groups", "n_limited_groups", "n_shared_experts", "route_scale", "gate_bias_update_factor",
                "aux_loss_coeff", "train_gate", "router_bias", "expert_bias", "expert_activation",
                "router_weights_fp32")
"""The MoEConfig fields a row records (as Automodel's model class resolves them); the others the recipe overrides
travel in the row's `moe_overrides`."""


# ------------------------------------------------------------------ the request


def read_setup(request) -> tuple[dict[str, Any], list[str]]:
    """The Automodel rows' reader of a verify-parity request (libraries/setups.py): its --recipe and --hf-config
    (either or both). Returns (settings, notes)."""
    from moebench.libraries.matrix import DEFAULT_WORLD_SIZES

    sizes = (request.world_size,) if request.world_size else DEFAULT_WORLD_SIZES
    allow = tuple(request.allow_imports or ())
    if request.recipe is not None:
        return read_recipe(request.recipe, hf_config=request.hf_config, allow_imports=allow, world_sizes=sizes)
    return read_hf_only(request.hf_config, world_sizes=sizes)


def read_hf_only(path: str, *, world_sizes: tuple[int, ...]) -> tuple[dict[str, Any], list[str]]:
    """--hf-config with no recipe: Automodel's model for that config.json, the training step's defaults."""
    from moebench.libraries import hf_config

    with _quiet():
        hf = hf_config.read(path, flag=HF, families=FAMILIES)
    model = fit.resolve_model(hf, {}, {}, flag=HF, path=path)
    settings = _settings(hf, model, recipe=None, hf_path=os.path.abspath(path), ep_size=None, dp_replicate=None,
                         ac=False, max_norm=fit.DEFAULT_MAX_NORM, grad_acc=1,
                         precision=fit.precision(hf.dtype, None), optimizer=None, lr=None,
                         backend=fit.backend({}, [], flag=HF, path=path))
    notes = [f"no --recipe: Automodel's {hf.model_type} model for this config.json, its training step's defaults "
             f"(clip_grad_norm.max_norm {fit.DEFAULT_MAX_NORM:g}, one micro-batch a step, experts torch_mm, the "
             "torch dispatcher), expert parallelism over every rank"]
    notes += _model_notes(hf, model, settings)
    notes += _row_notes(settings, world_sizes)
    notes.append(fit.clip_line(fit.DEFAULT_MAX_NORM, default=True))
    notes.append(f"optimizer: SGD: {fit.OPTIMIZER_WHY}")
    return settings, notes


def read_recipe(path: str, *, hf_config: str | None = None, allow_imports: tuple[str, ...] = (),
                world_sizes: tuple[int, ...] = (2, 4)) -> tuple[dict[str, Any], list[str]]:
    """(settings, notes) from a recipe (and the model's config.json: --hf-config, or a local folder the recipe
    names); UserError naming the flag for anything wrong."""
    raw, nodes, later = recipe.load(path, allow_imports)  # later: what is not honoured or not used
    model_raw = raw.get("model")
    if not isinstance(model_raw, dict):
        raise UserError(f"{path} has no model section (Automodel's recipe builds its model from `model:`); fix the "
                        "file", flag=RECIPE)
    named, local = recipe.model_named(path, model_raw)
    hf_path, hf_flag = recipe.config_json(path, named, local, hf_config)
    from moebench.libraries import hf_config as hfc

    with _quiet():
        hf = hfc.read(hf_path, flag=hf_flag, families=FAMILIES)
    notes = [f"model: {named} ({hf.model_type}), its config.json from "
             + (os.path.basename(hf_path) if hf_config else f"the recipe's folder {local}")]
    overrides, moe_overrides = fit.model_keys(path, model_raw, hf, later)
    backend = fit.backend(nodes.get("model.backend"), later, flag=RECIPE, path=path)
    model = fit.resolve_model(hf, overrides, moe_overrides, flag=RECIPE, path=path)
    dist = fit.distributed(path, raw.get("distributed") or {}, nodes, model, later)
    steps: list[str] = []
    grad_acc = fit.accumulation(path, nodes, dist, steps)
    max_norm = fit.clip(path, raw.get("clip_grad_norm"), steps, later)
    precision = fit.precision(hf.dtype, fit.model_dtype(path, model_raw))
    if precision not in ("fp32", "bf16"):
        later.append(f"precision {precision}: not honoured; the rows run float32, compared exactly")
        precision = "fp32"
    optimizer, lr = fit.optimizer(nodes, steps)
    fit.loss(raw, later)
    settings = _settings(hf, model, recipe=os.path.abspath(path),
                         hf_path=os.path.abspath(hf_path), ep_size=dist["ep_size"],
                         dp_replicate=dist["dp_replicate_size"], ac=dist["activation_checkpointing"],
                         max_norm=max_norm, grad_acc=grad_acc, precision=precision, optimizer=optimizer, lr=lr,
                         backend=backend)
    notes += _model_notes(hf, model, settings)
    notes += _row_notes(settings, world_sizes) + steps
    unused = [k for k in raw if k in recipe.NOT_USED or k.startswith(("validation_dataset", "validation_dataloader"))]
    if unused:
        later.append(f"not used: {', '.join(unused)} (the rows train on moebench's random tokens, a few steps at "
                     "one learning rate)")
    return settings, notes + later


def _quiet():
    """transformers' config warnings off the console (hf_config.quiet)."""
    from moebench.libraries.hf_config import quiet

    return quiet()


# ------------------------------------------------------------------ the settings and their notes


def _settings(hf, model: dict, *, recipe: str | None, hf_path: str, ep_size: int | None,
              dp_replicate: int | None, ac: Any, max_norm: float, grad_acc: int, precision: str,
              optimizer: str | None, lr: float | None, backend: dict[str, Any]) -> dict[str, Any]:
    return {"recipe": recipe, "hf_config": hf_path, "family": hf.model_type, "routing": model["routing"],
            "q_lora_rank": hf.kwargs.get("q_lora_rank") if hf.model_type == "deepseek_v3" else None,
            "moe": model["moe"], "moe_overrides": model["moe_overrides"], "update_bias": model["update_bias"],
            "backend": backend, "ep_size": ep_size, "dp_replicate_size": dp_replicate,
            "activation_checkpointing": ac, "max_norm": max_norm, "grad_acc": grad_acc,
            "precision": precision, "optimizer": optimizer, "lr": lr}


def _model_notes(hf, model: dict, settings: dict) -> list[str]:
    """The config.json's notes (kept, shrunk, not declared, ...), what Automodel's class resolves them to, the
    precision."""
    moe = model["moe"]
    kept = ", ".join(f"{k}={json.dumps(moe[k])}" for k in MOE_RECORDED if k in moe)
    out = list(hf.notes)
    out.insert(1, f"kept (Automodel's MoEConfig for {settings['family']}, as its model class maps the config"
               + (" and model.moe_overrides" if model["moe_overrides"] else "") + f"): {kept}")
    from moebench.libraries.automodel.api import USER_VOCAB

    out.insert(3, f"vocab_size -> {USER_VOCAB} for these rows (each token id's embedding is much of a router input) "
               "and every expert's router row drawn at one norm, so that every expert gets tokens at step 1 (each "
               "row asserts it)")
    if moe.get("gate_bias_update_factor", 0) > 0 and not model["update_bias"]:
        out.append(f"gate_bias_update_factor {moe['gate_bias_update_factor']:g}: Automodel's {settings['family']} "
                   "class has no update_moe_gate_bias, so its trainer never updates the gate bias; the rows do as "
                   "the trainer does")
    out.append(f"precision: {'bfloat16' if settings['precision'] == 'bf16' else 'float32'}"
               + (": kept in a bf16 row judged by the noise model; the float32 row compares exactly"
                  if settings["precision"] == "bf16" else ": the row compares exactly"))
    return out


def _row_notes(settings: dict, world_sizes: tuple[int, ...]) -> list[str]:
    experts = settings["moe"]["n_routed_experts"]
    want = settings["ep_size"]
    fits = {w: fit.fit_ep(want, w, experts) for w in world_sizes}
    if want is None:
        return [f"expert parallelism over every rank (ep_size = W: {', '.join(str(e) for e in fits.values())})"]
    if all(e == want for e in fits.values()):
        return [f"distributed.ep_size={want}: kept"]
    shown = ", ".join(f"{e} at -n {w}" for w, e in fits.items())
    return [f"distributed.ep_size={want}: more than the ranks here; verified at the largest EP degree that fits "
            f"({shown}; each rank holds {experts} / ep experts)"]

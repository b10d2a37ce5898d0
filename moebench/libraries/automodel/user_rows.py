"""The rows of a user's own Automodel setup (--recipe, --hf-config; user_setup.py reads them): the recipe's model,
shrunk, parallelized and trained as Automodel's trainer does it, against the same model on one process.

Here: a row's settings (RecipeSettings, its JSON fields) and the rows at a world size, fitted to it (fit.fit_ep, the
accumulation shrunk to fit.MAX_ACCUM, the loss multiplier that makes the recipe's clip bind). Each rank runs a row in
user_run.py (the model built and compared), through user_step.py (Automodel's trainer step and its one-process
reference, side by side).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from moebench.libraries.automodel import api
from moebench.libraries.automodel.fit import BINDING_NORM, MAX_ACCUM, fit_ep
from moebench.libraries.spec import BF16, Row, Settings

KIND = "recipe"
"""The kind of a user row in float32 (a bf16 row is spec.BF16)."""
STEPS = 3
LR = 0.1
SEQ_LEN = 8
ROUTES_PER_EXPERT = 16
"""Routes per expert a micro-batch gives on average (its sequences per rank grow with the experts / top-k): every
expert must get tokens at step 1 (asserted), or its gradient compares zero with zero inside its rank's block."""
MAX_SEQS = 64
"""Sequences per rank in one micro-batch at most (DeepSeek-V3's 256 experts, top-8, take 32 at W = 2)."""
MP_FP32 = "float32 (param, reduce, output): the float32 rows' reference"
MP_BF16 = "bfloat16 params, float32 reduce (FSDP2Config's default)"
PARALLELIZER = "Automodel's parallelize_model: apply_ep, activation checkpointing, apply_fsdp (FSDP2)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeSettings(Settings):
    """One user row's settings (its JSON fields): what the recipe and the config.json set, as the row runs them."""

    source: str
    """"recipe" (--recipe, with its config.json) or "hf-config" (--hf-config alone)."""
    routing: str
    """The config.json's routing keys (JSON), after the recipe's model-section overrides."""
    moe_overrides: str = "{}"
    """The recipe's model.moe_overrides (JSON): onto the MoEConfig Automodel's class maps from the config."""
    q_lora_rank: int | None = None
    num_experts: int
    top_k: int
    score_func: str
    norm_topk_prob: bool
    n_expert_groups: int
    n_limited_groups: int
    n_shared_experts: int
    route_scale: float
    gate_bias_update_factor: float
    aux_loss_coeff: float
    update_bias: bool
    """The class has update_moe_gate_bias (the trainer calls it after every step)."""
    experts: str
    rms_norm: str = "torch"
    fake_balanced_gate: bool = False
    gate_precision: str | None = None
    dispatcher: str = "torch"
    ep_size: int
    recipe_ep_size: int | None
    """distributed.ep_size as the recipe has it (None: --hf-config alone, EP over every rank)."""
    dp_replicate_size: int | None = None
    activation_checkpointing: str = "off"
    max_grad_norm: float
    loss_multiplier: float = 1.0
    """The loss (and the aux-loss scale) is multiplied by this, reference alike, so that max_grad_norm binds."""
    grad_acc_steps: int = 1
    recipe_grad_acc_steps: int = 1
    precision: str = "fp32"
    seqs_per_rank: int
    seq_len: int = SEQ_LEN
    steps: int = STEPS
    optimizer: str = "SGD"
    recipe_optimizer: str | None = None
    mp_policy: str = MP_FP32
    parallelizer: str = PARALLELIZER
    patch: str = ""
    torch_compile: str = api.TORCH_COMPILE


def user_rows(world_size: int, user: dict[str, Any]) -> list[Row]:
    """The rows of a user's setup at `world_size`: its float32 row, and its bf16 row when the recipe trains in
    bf16 (none below 2 ranks)."""
    if world_size < 2:
        return []
    moe = user["moe"]
    experts = moe["n_routed_experts"]
    ep = fit_ep(user["ep_size"], world_size, experts)
    acc = min(user["grad_acc"], MAX_ACCUM)
    max_norm = float(user["max_norm"])
    ac = user["activation_checkpointing"]
    seqs = max(2, min(MAX_SEQS, math.ceil(ROUTES_PER_EXPERT * experts / (moe["n_activated_experts"] * SEQ_LEN *
                                                                          world_size))))
    base = RecipeSettings(
        source="recipe" if user.get("recipe") else "hf-config", routing=json.dumps(user["routing"], sort_keys=True),
        moe_overrides=json.dumps(user["moe_overrides"], sort_keys=True),
        q_lora_rank=user.get("q_lora_rank"), num_experts=experts, top_k=moe["n_activated_experts"],
        score_func=moe["score_func"], norm_topk_prob=bool(moe["norm_topk_prob"]),
        n_expert_groups=moe["n_expert_groups"], n_limited_groups=moe["n_limited_groups"],
        n_shared_experts=moe["n_shared_experts"], route_scale=float(moe["route_scale"]),
        gate_bias_update_factor=float(moe["gate_bias_update_factor"]), aux_loss_coeff=float(moe["aux_loss_coeff"]),
        update_bias=bool(user["update_bias"]) and moe["gate_bias_update_factor"] > 0,
        experts=user["backend"]["experts"], rms_norm=user["backend"]["rms_norm"],
        fake_balanced_gate=user["backend"]["fake_balanced_gate"], gate_precision=user["backend"]["gate_precision"],
        ep_size=ep, recipe_ep_size=user["ep_size"], dp_replicate_size=_replicate(user, world_size),
        activation_checkpointing=("selective" if ac == "selective" else "full" if ac else "off"),
        max_grad_norm=max_norm, loss_multiplier=max(1.0, max_norm / BINDING_NORM) if max_norm > 0 else 1.0,
        grad_acc_steps=acc, recipe_grad_acc_steps=user["grad_acc"], seqs_per_rank=seqs,
        recipe_optimizer=user.get("optimizer"), patch=api.QWEN3_PATCH if user["family"] == "qwen3_moe" else "")
    fitted = "" if user["ep_size"] in (None, ep) else (
        f"ep_size {user['ep_size']} verified at {ep}: the largest EP degree that fits {world_size} ranks")
    rows = [_row(user["family"], base, world_size, fitted)]
    if user["precision"] == "bf16":
        rows.append(_row(user["family"], dataclasses.replace(base, precision="bf16", mp_policy=MP_BF16, steps=1),
                         world_size, fitted))
    return rows


def _replicate(user: dict, world_size: int) -> int | None:
    """distributed.dp_replicate_size where it fits (HSDP: replicas x shards = W), else None (a note says so)."""
    r = user.get("dp_replicate_size")
    return r if r and 1 < r < world_size and world_size % r == 0 else None


def _row(family: str, s: RecipeSettings, world_size: int, note: str) -> Row:
    features = ["loss-curve"] if s.precision == "fp32" else ["bf16"]
    if s.max_grad_norm > 0 and s.precision == "fp32":
        features.append("clip")
    if s.grad_acc_steps > 1:
        features.append("grad-accum")
    if s.update_bias and s.precision == "fp32":
        features.append("bias-update")
    ep_mode = f"ep={s.ep_size}" + (f"+hsdp={s.dp_replicate_size}" if s.dp_replicate_size else "")
    variant = s.source if s.precision == "fp32" else f"{s.source}+bf16"
    return Row(library="automodel", model=family, backend=s.experts, ep_mode=ep_mode, world_size=world_size,
               kind=KIND if s.precision == "fp32" else BF16, settings=s, features=tuple(features), variant=variant,
               note=note)

"""--hf-config for the transformers rows: a model's config.json, read by transformers (moebench.libraries.hf_config),
shrunk to fit a CPU, and the rows built from it.

What the rows keep of the file: the family (its model_type picks transformers' own classes), every routing setting
transformers reads (the number of experts and top-k, norm_topk_prob, DeepSeek-V3's grouped top-k n_group / topk_group,
routed_scaling_factor, shared experts and its sigmoid scoring with the e_score_correction_bias, GPT-OSS's router with
its bias and clamped SwiGLU, Mixtral's softmax top-k), the activation, and the precision (torch_dtype bfloat16 adds
the bf16 rows). What they shrink: the sizes (hidden_size, heads, vocabulary, layers: hf_config.FAMILIES), and the
number of experts only where it must (it does not split over the world size), saying so in the row's note.

Every row carries the file's absolute path and the first 16 hex digits of its sha256 (a row's settings are JSON scalars
of at most 200 characters: the shrunk config itself is ~1.5 KB); each rank reads the file again through the same
reader, refuses one changed since, and builds the config with hf_config.build_config. The shrunk config's whole
constructor arguments are in summary.json (`setup.settings.transformers.kwargs`).

The batch grows with the experts so that every expert gets tokens (tokens are cheap at hidden 32): at least
TOKENS_PER_EXPERT routed slots per expert over the global batch, asserted on the reference at step 1 of every row.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from moebench.errors import UserError
from moebench.libraries import hf_config
from moebench.libraries.spec import BF16, SETTING_MAX_CHARS, Row, Settings

FLAG = hf_config.FLAG
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
"""The model types the transformers rows build from a --hf-config (hf_config.FAMILIES, every one)."""
VARIANT = "hf-config"
TOKENS_PER_EXPERT = 16
"""Routed slots (tokens x top-k) per expert over the global batch: with the tiny model's random router the
routing is near uniform, so each expert expects 16 routes and none is left without (asserted in every row)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFConfigSettings(Settings):
    """A --hf-config row's settings (its JSON fields): where the config is, and what the row made of it."""

    hf_config: str
    """The config.json's absolute path (every rank reads it again)."""
    hf_sha256: str
    """The first 16 hex digits of its sha256: a rank refuses the file if it changed since it was read."""
    num_experts: int
    """Routed experts the row builds: the file's, unless they do not split over the world size."""
    file_experts: int
    """Routed experts the file declares."""
    top_k: int
    seqs_per_rank: int
    """Sequences in each rank's part of the global batch (grown with the experts: TOKENS_PER_EXPERT)."""
    seq_len: int
    dtype: str
    """The file's torch_dtype ("" when it sets none)."""


def read_setup(request) -> tuple[dict[str, Any], list[str]]:
    """The transformers rows' reader of a verify-parity request (libraries/setups.py): its --hf-config."""
    return read(request.hf_config)


def read(path: str) -> tuple[dict[str, Any], list[str]]:
    """(settings, notes) of a --hf-config for the transformers rows; a UserError naming the flag for anything wrong."""
    setup = hf_config.read(path, families=FAMILIES)
    shown = os.path.abspath(path)
    if len(shown) > SETTING_MAX_CHARS or not shown.isprintable():
        raise UserError(f"{path}: its absolute path has {len(shown)} characters (or unprintable ones); a row records "
                        f"it in at most {SETTING_MAX_CHARS}: copy the file to a shorter path", flag=FLAG)
    config = hf_config.build_config(setup.model_type, setup.kwargs)
    settings = {"path": shown, "sha256": setup.sha256, "model_type": setup.model_type,
                "config_class": setup.config_class, "num_experts": setup.num_experts, "top_k": setup.top_k,
                "n_group": getattr(config, "n_group", None) if setup.model_type == "deepseek_v3" else None,
                "topk_group": getattr(config, "topk_group", None) if setup.model_type == "deepseek_v3" else None,
                "dtype": setup.dtype or "", "kwargs": setup.kwargs}
    return settings, [*setup.notes, *_notes(setup)]


def _notes(setup: hf_config.HFSetup) -> list[str]:
    notes = []
    if setup.model_type == "deepseek_v3":
        from moebench.libraries.transformers.sizes import USER_BIAS_SCALE

        notes.append("scoring: sigmoid with e_score_correction_bias (transformers' DeepseekV3TopkRouter: the bias "
                     f"moves the choice, not the weights); the rows draw the bias N(0, {USER_BIAS_SCALE}^2) so that "
                     "it does")
    if setup.model_type == "gpt_oss":
        notes.append("router: GPT-OSS's `router` (a biased linear, softmax over its top-k) and experts with biases "
                     "and the clamped SwiGLU (swiglu_limit), as transformers' GptOssMLP builds them")
    aux = [k for k in ("router_aux_loss_coef", "output_router_logits") if k in setup.routing]
    if aux:
        causal_lm = setup.config_class.removesuffix("Config") + "ForCausalLM"
        notes.append(f"{' / '.join(aux)}: read, not exercised by these rows: they drive the MoE block "
                     f"(model.layers.0.mlp), and transformers adds the load-balancing loss in {causal_lm} from "
                     "every layer's router logits (the AutoEP and Automodel rows run the whole model)")
    if setup.dtype == "bfloat16":
        notes.append("torch_dtype=bfloat16: the bf16 rows (the model loaded with dtype=torch.bfloat16, judged by the "
                     "noise model) as well as the float32 rows")
    elif setup.dtype in (None, "float32"):
        notes.append(f"torch_dtype={setup.dtype or 'not set'}: float32 rows only (write \"bfloat16\" to add the bf16 "
                     "rows)")
    else:
        notes.append(f"torch_dtype={setup.dtype}: not honoured here (transformers' expert parallelism in that dtype "
                     "has no rows); float32 rows only")
    notes.append(f"batch: every expert gets at least {TOKENS_PER_EXPERT} routes on average (global tokens = "
                 f"{TOKENS_PER_EXPERT} x experts / top-k, at least 32 a rank); each row asserts that none gets none")
    return notes


def fit_experts(settings: dict, world_size: int) -> int | None:
    """The routed experts a row builds at `world_size`: the file's when they split over the ranks, else the largest
    count below that does (and that DeepSeek-V3's groups still split, with top-k still reachable); None: none does."""
    experts, top_k = settings["num_experts"], settings["top_k"]
    groups, topk_group = settings.get("n_group") or 1, settings.get("topk_group") or 1
    step = world_size * groups // math.gcd(world_size, groups)
    for count in range(experts - experts % step, 0, -step):
        if count >= top_k and top_k <= topk_group * count // groups:
            return count
    return None


def seqs_per_rank(experts: int, top_k: int, world_size: int, seq_len: int, at_least: int) -> int:
    """Sequences per rank so that the global batch routes TOKENS_PER_EXPERT slots per expert on average."""
    tokens = math.ceil(TOKENS_PER_EXPERT * experts / top_k)
    return max(at_least, math.ceil(tokens / (world_size * seq_len)))


def user_rows(world_size: int, settings: dict) -> list[Row]:
    """The rows of a --hf-config at `world_size`: every experts backend x EP mode in float32, and with torch_dtype
    bfloat16 the bf16 row of each mode; variant "hf-config"."""
    from moebench.libraries.transformers.sizes import (
        BACKENDS,
        BF16_BACKEND,
        EP_MODES,
        SEQ_LEN,
        SEQS_PER_RANK,
    )

    if world_size < 2:
        return []
    fitted = fit_experts(settings, world_size)
    experts = fitted or settings["num_experts"]
    note = ""
    if fitted is not None and fitted != settings["num_experts"]:
        note = (f"experts {settings['num_experts']} -> {fitted}: {settings['num_experts']} do not split over "
                f"{world_size} ranks" + (f" in {settings['n_group']} groups" if settings.get("n_group") else ""))
    s = HFConfigSettings(hf_config=settings["path"], hf_sha256=settings["sha256"], num_experts=experts,
                         file_experts=settings["num_experts"], top_k=settings["top_k"],
                         seqs_per_rank=seqs_per_rank(experts, settings["top_k"], world_size, SEQ_LEN, SEQS_PER_RANK),
                         seq_len=SEQ_LEN, dtype=settings["dtype"])
    model = settings["model_type"]
    rows = [Row(library="transformers", model=model, backend=backend, ep_mode=mode, world_size=world_size,
                features=("loss-curve", VARIANT), settings=s, variant=VARIANT, note=note)
            for backend in BACKENDS for mode in EP_MODES]
    if settings["dtype"] == "bfloat16":
        rows += [Row(library="transformers", model=model, backend=BF16_BACKEND, ep_mode=mode, world_size=world_size,
                     kind=BF16, features=("bf16", VARIANT), settings=s, variant=f"{VARIANT}+bf16", note=note)
                 for mode in EP_MODES]
    return rows


def skip_reason(row: Row) -> str | None:
    """Why a --hf-config row cannot run here (None: it can), beyond what every transformers row needs."""
    s = row.settings
    if row.model not in FAMILIES:
        return f"unknown transformers model family {row.model!r}"
    if s.num_experts % row.world_size:
        return (f"no count of experts up to the file's {s.file_experts} splits over {row.world_size} ranks with "
                f"top-{s.top_k} reachable")
    return None


def config_of(row: Row):
    """(config class, causal-LM class, constructor kwargs) of a --hf-config row, in a rank: the file read again
    through hf_config (refused if it changed since the parent read it), with the row's number of experts."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    s = row.settings
    setup = hf_config.reread(s.hf_config, s.hf_sha256, families=FAMILIES)
    kwargs = hf_config.with_experts(setup.kwargs, s.num_experts)
    config = hf_config.build_config(setup.model_type, kwargs)
    return type(config), MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], kwargs

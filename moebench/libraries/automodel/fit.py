"""Fitting a user's NeMo Automodel recipe (read by recipe.py) to the rows: what each section sets, through
Automodel's own objects where it has one, kept, shrunk or not honoured, one note each (user_setup.py gathers them).

- the model section: its keys (config overrides of routing keys, `moe_overrides` onto Automodel's `MoEConfig`, the
  `from_pretrained` arguments the rows do not take; any other key refused by name), its dtype, and Automodel's model
  class built small with them (its refusals are refused with its message);
- `model.backend` (Automodel's `BackendConfig`): the experts as it resolves them with the torch dispatcher, CUDA-only
  kernels not honoured;
- `distributed:` (Automodel's `parse_distributed_section`): the sizes bounded, EP / HSDP / activation checkpointing
  kept, TP refused where the class has no plan, PP / CP / other strategies not honoured;
- `step_scheduler:`: the accumulation as StepScheduler computes it (at most MAX_ACCUM a row); `clip_grad_norm:` (its
  unknown keys refused by name); the optimizer (replaced by SGD, said why); the loss;
- fit_ep: the EP degree a row verifies at a world size.
"""

from __future__ import annotations

import math
from typing import Any

from moebench.errors import UserError
from moebench.libraries.automodel.recipe import RECIPE, bounded, loader_refuses, show

CLIP_KEYS = ("max_norm", "backend")
"""`clip_grad_norm` keys train_ft reads (clip_grad_norm.max_norm, clip_grad_norm.backend)."""
MODEL_KEYS_READ = ("_target_", "pretrained_model_name_or_path", "config", "backend", "torch_dtype", "dtype",
                   "moe_overrides", "trust_remote_code")
MODEL_KEYS_NOT_HONOURED = {
    "use_liger_kernel": "Liger's fused kernels (Triton, CUDA)",
    "use_sdpa_patching": "attention kernels: the rows use torch's sdpa",
    "sdpa_method": "attention kernels: the rows use torch's sdpa",
    "attn_implementation": "attention kernels: the rows use torch's sdpa",
    "quantization_config": "quantized weights need their kernels",
    "force_hf": "the rows build Automodel's own model class for the config",
    "qat_config": "torchao's fake-quant kernels", "fp8_config": "Transformer Engine / torchao FP8 on a GPU",
    "compile_config": "the rows run eager (the same mathematics)", "peft_config": "the rows train every parameter",
    "has_packed_sequence": "the rows' batches are not packed", "cache_dir": "nothing is downloaded",
    "revision": "nothing is downloaded", "local_files_only": "nothing is downloaded",
    "subfolder": "nothing is downloaded", "force_download": "nothing is downloaded", "token": "nothing is downloaded",
    "use_cache": "training: no KV cache",
}
"""NeMoAutoModelForCausalLM.from_pretrained's other parameters (0.7.0, _transformers/auto_model.py), not taken by
the rows (a note each); any other model key that is not a config field of the model is refused."""
DISTRIBUTED_SIZES = ("tp_size", "pp_size", "cp_size", "ep_size", "dp_size", "dp_replicate_size")
MAX_DEGREE = 1 << 16
"""A parallel degree (the largest MoE runs use a few thousand ranks)."""
MAX_BATCH = 1 << 24
MAX_NORM = 1e6
MAX_FACTOR = 1e4
BINDING_NORM = 0.2
"""A max_norm the small models' step-1 gradient norm exceeds at every seed (the clip rows of the default matrix use
it): a user's larger max_norm is reached by multiplying the loss by max_norm / BINDING_NORM, reference alike (the row
asserts that the clip binds)."""
MAX_ACCUM = 4
"""Micro-batches a row accumulates: a recipe's count above it is shrunk to it (accumulation over 4 micro-batches
exercises the same path as over 400, and each costs a forward and backward)."""
BACKEND_CPU = {"attn": "sdpa", "linear": "torch", "rope_fusion": False, "enable_hf_state_dict_adapter": False}
"""BackendConfig fields every row sets on CPU (attention, linear layers: kernels, not MoE mathematics)."""
CUDA_DISPATCHERS = ("deepep", "hybridep", "uccl_ep", "mok")
CUDA_RMS_NORMS = ("te", "quack")
OPTIMIZER_WHY = ("Adam divides each step by the gradient's own running size, so a gradient scaled "
                 "uniformly by k would step the same and a mis-scaled reduction would pass")
DEFAULT_MAX_NORM = 1.0
"""train_ft's clip when the recipe sets no clip_grad_norm.max_norm ("using default value of 1.0")."""


# ------------------------------------------------------------------ the model


def _config_fields(hf) -> set[str]:
    from moebench.libraries.hf_config import build_config

    return set(build_config(hf.model_type, hf.kwargs).to_dict()) | {"torch_dtype", "dtype"}


def model_keys(path: str, model: dict, hf, notes: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config overrides of routing keys, moe_overrides) from the model section; a note per key not taken; an
    unknown key refused (NeMoAutoModelForCausalLM hands it to AutoConfig, whose class does not declare it)."""
    from moebench.libraries.hf_config import FAMILIES as HF_FAMILIES

    family = HF_FAMILIES[hf.model_type]
    fields = _config_fields(hf)
    overrides: dict[str, Any] = {}
    sized: list[str] = []
    for key, value in model.items():
        if key in MODEL_KEYS_READ:
            continue
        if key == "moe_config":
            raise UserError(f"model.moe_config in {path}: Automodel's NeMoAutoModelForCausalLM refuses it "
                            "(\"Distributed settings must be passed with distributed_setup\"); set MoE fields with "
                            "model.moe_overrides; fix the file", flag=RECIPE)
        if key in MODEL_KEYS_NOT_HONOURED:
            if value not in (None, False):
                notes.append(f"model.{key}={show(value)}: not honoured; {MODEL_KEYS_NOT_HONOURED[key]}")
            continue
        if key in fields:
            if key in family.routing:
                overrides[key] = value
            else:
                sized.append(f"model.{key}")
            continue
        raise UserError(f"model.{key} in {path} is neither a {hf.config_class} field nor an argument of "
                        "NeMoAutoModelForCausalLM (Automodel would pass it to AutoConfig, which ignores it); fix "
                        "the file", flag=RECIPE)
    if sized:
        notes.append(f"{', '.join(sized)}: config overrides of keys that only size or position the model; the rows' "
                     "small model has its own")
    if model.get("trust_remote_code"):
        notes.append("model.trust_remote_code=true: no remote code runs; Automodel's own class for "
                     f"{hf.model_type} is built")
    moe = model.get("moe_overrides") or {}
    if not isinstance(moe, dict):
        raise UserError(f"model.moe_overrides in {path} must be a mapping of MoEConfig fields; fix the file",
                        flag=RECIPE)
    from moebench.libraries.automodel.api import MOE_DTYPES, MOE_SIZES

    sized = [k for k in moe if k in MOE_SIZES or k in MOE_DTYPES]  # the rows' small model has its own
    if sized:
        notes.append(f"{', '.join(f'model.moe_overrides.{k}' for k in sized)}: MoEConfig sizes and dtypes; the "
                     "rows' small model has its own (shrunk), its precision the row's")
    return overrides, {k: v for k, v in moe.items() if k not in sized}


def model_dtype(path: str, model: dict) -> str | None:
    value = model.get("dtype", model.get("torch_dtype"))
    if value in (None, "auto"):
        return None
    known = ("float32", "float", "bfloat16", "bf16", "float16", "half", "fp16")
    if not isinstance(value, str) or value.replace("torch.", "") not in known:
        raise UserError(f"model.torch_dtype={show(value)} in {path} must be a dtype name ({', '.join(known)}, "
                        "auto); fix the file", flag=RECIPE)
    return value


def precision(config_dtype: str | None, model_dtype: str | None) -> str:
    """"bf16" or "fp32": what Automodel builds the model in (model.torch_dtype, else the config's; Automodel's
    default bfloat16)."""
    name = (model_dtype or config_dtype or "bfloat16").replace("torch.", "")
    return "fp32" if name in ("float32", "float") else "bf16" if name in ("bfloat16", "bf16") else "fp16"



def resolve_model(hf, overrides: dict[str, Any], moe_overrides: dict[str, Any], *, flag: str,
                   path: str) -> dict[str, Any]:
    """Automodel's model class for the config, built small with the recipe's overrides (as its
    NeMoAutoModelForCausalLM would: config fields onto the config, moe_overrides onto the MoEConfig its class maps
    from the config): {"routing": the config's routing keys, "moe": the resolved MoEConfig fields (JSON),
    "moe_overrides": what the recipe overrides, "update_bias": whether the class updates its gate bias}."""
    from moebench.libraries.automodel import api
    from moebench.libraries.hf_config import FAMILIES as HF_FAMILIES
    from moebench.libraries.hf_config import quiet

    family = HF_FAMILIES[hf.model_type]
    routing = {k: v for k, v in hf.routing.items() if v is not None}
    routing.update(overrides)
    for key, value in routing.items():
        if key in ("hidden_act",) or isinstance(value, bool):
            continue
        if isinstance(value, int):
            bounded(path, flag, key, value, 0, 4096)
        elif isinstance(value, float):
            bounded(path, flag, key, value, 0, MAX_FACTOR, whole=False)
    experts = bounded(path, flag, family.experts, routing.get(family.experts), 1, 4096)
    bounded(path, flag, "num_experts_per_tok", routing.get("num_experts_per_tok"), 1, experts)
    fields = api.moe_fields()
    for key, value in moe_overrides.items():
        if key not in fields:
            raise UserError(f"model.moe_overrides.{key} in {path}: MoEConfig has no field {key!r} (Automodel's "
                            "MoEConfig refuses it); fix the file", flag=flag)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            bounded(path, flag, f"model.moe_overrides.{key}", value, 0, MAX_FACTOR if isinstance(value, float)
                     else 4096, whole=isinstance(value, int))
        elif not isinstance(value, (str, bool, type(None))):
            raise UserError(f"model.moe_overrides.{key}={show(value)} in {path}: must be a number, a name or "
                            "true/false; fix the file", flag=flag)
    try:
        with quiet():  # transformers' config warnings off the console
            moe, update_bias, supports_tp = api.resolved_moe(hf.model_type, routing, moe_overrides)
    except Exception as exc:  # noqa: BLE001 - what Automodel's classes raise (huggingface_hub's strict-dataclass
        # validators raise their own error class, not a ValueError) is its refusal, in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UserError(f"Automodel refuses the model of {path}: {type(exc).__name__}: {first}; fix the file",
                        flag=flag) from None
    if moe["n_routed_experts"] < 1 or not 1 <= moe["n_activated_experts"] <= moe["n_routed_experts"]:
        raise UserError(f"{path}: {moe['n_activated_experts']} experts a token of {moe['n_routed_experts']}: "
                        "top-k must be from 1 to the number of experts; fix the file", flag=flag)
    groups = moe["n_expert_groups"]
    if groups > 1 and (moe["n_routed_experts"] % groups or not 1 <= moe["n_limited_groups"] <= groups):
        raise UserError(f"{path}: {groups} expert groups of {moe['n_routed_experts']} experts, "
                        f"{moe['n_limited_groups']} kept: the groups must divide the experts and the kept groups be "
                        "from 1 to their number; fix the file", flag=flag)
    return {"family": hf.model_type, "routing": routing, "moe": moe, "moe_overrides": moe_overrides,
            "update_bias": update_bias, "supports_tp": supports_tp}


def backend(loaded: Any, notes: list[str], *, flag: str, path: str) -> dict[str, Any]:
    """The row's BackendConfig fields: the recipe's experts (Automodel's own BackendConfig resolves te / gmm with the
    torch dispatcher to torch_mm), the torch dispatcher, CPU attention and linear layers; a note per field not
    honoured."""
    from moebench.libraries.automodel import api

    given: dict[str, Any] = {}
    if loaded is not None:
        given = {f: getattr(loaded, f) for f in api.backend_fields() if hasattr(loaded, f)} \
            if not isinstance(loaded, dict) else dict(loaded)
    wanted = {"experts": given.get("experts", "torch_mm"), "dispatcher": "torch",
              "rms_norm": given.get("rms_norm", "torch"), "fake_balanced_gate": bool(given.get("fake_balanced_gate")),
              "gate_precision": given.get("gate_precision")}
    dispatcher = given.get("dispatcher", "torch")
    if dispatcher in CUDA_DISPATCHERS:
        notes.append(f"model.backend.dispatcher={dispatcher}: not honoured; its kernels need CUDA: verified with "
                     "Automodel's torch dispatcher (all-gather / all-reduce over the EP ranks)")
    if wanted["experts"] in ("te", "gmm"):
        notes.append(f"model.backend.experts={wanted['experts']}: not honoured; "
                     + ("Transformer Engine's grouped experts need CUDA: " if wanted["experts"] == "te" else "")
                     + "with the torch dispatcher Automodel's BackendConfig runs torch_mm (torch._grouped_mm)")
    elif wanted["experts"] == "torch_mm_mxfp8":
        notes.append("model.backend.experts=torch_mm_mxfp8: not honoured; MXFP8 needs torchao and sm_100: verified "
                     "with torch_mm, what it falls back to")
        wanted["experts"] = "torch_mm"
    if wanted["rms_norm"] in CUDA_RMS_NORMS:
        notes.append(f"model.backend.rms_norm={wanted['rms_norm']}: not honoured; its kernels need CUDA: torch's "
                     "RMSNorm")
        wanted["rms_norm"] = "torch"
    for key in ("attn", "linear"):
        if given.get(key) not in (None, BACKEND_CPU[key]):
            notes.append(f"model.backend.{key}={given[key]}: not honoured; CUDA kernels: {BACKEND_CPU[key]}")
    if wanted["gate_precision"] is not None:
        wanted["gate_precision"] = str(wanted["gate_precision"]).replace("torch.", "")
    resolved = api.backend_of(wanted)  # Automodel's own BackendConfig: te / gmm with the torch dispatcher -> torch_mm
    wanted["experts"] = resolved.experts
    return wanted


# ------------------------------------------------------------------ distributed, steps, clip, optimizer


def distributed(path: str, section: Any, nodes: dict, model: dict, notes: list[str]) -> dict[str, Any]:
    """The sizes and layout from `distributed:`, parsed by Automodel's parse_distributed_section (its refusals are
    the loader's); TP / PP / CP as Automodel would take them with this model."""
    if not isinstance(section, dict):
        raise UserError(f"distributed in {path} must be a mapping; fix the file", flag=RECIPE)
    for key in DISTRIBUTED_SIZES:
        value = section.get(key)
        if value is not None:
            bounded(path, RECIPE, f"distributed.{key}", value, 1, MAX_DEGREE)
    node = nodes["root"].get("distributed", None)
    parsed: dict[str, Any] = {}
    try:
        from nemo_automodel.recipes._dist_utils import parse_distributed_section

        parsed = parse_distributed_section(node.to_dict() if node is not None else {})
    except ImportError:
        pass
    except (Exception, RecursionError) as exc:  # noqa: BLE001 - Automodel's refusal, in one line
        raise loader_refuses(path, exc, "distributed") from None
    get = (lambda k, d: parsed.get(k, d)) if parsed else (lambda k, d: section.get(k) or d)
    tp, pp, cp, ep = get("tp_size", 1), get("pp_size", 1), get("cp_size", 1), get("ep_size", 1)
    if tp > 1:
        cls = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[model["family"]]
        if not model["supports_tp"]:
            raise UserError(f"distributed.tp_size={tp} in {path}: Automodel refuses tensor parallelism for {cls} "
                            f"(\"Tensor parallelism (tp_size={tp}) requested but {cls} has no TP plan\"); fix the "
                            "file", flag=RECIPE)
    if pp > 1:
        notes.append(f"distributed.pp_size={pp}: not honoured; the rows' one-layer model is one pipeline stage")
    if cp > 1:
        notes.append(f"distributed.cp_size={cp}: not honoured; the rows' sequences are not split over ranks")
    strategy = str(section.get("strategy", "fsdp2")).lower()
    if strategy != "fsdp2":
        notes.append(f"distributed.strategy={strategy}: not honoured; verified with fsdp2 (the strategy Automodel's "
                     "MoE parallelizer applies)")
    dp = get("dp_size", None)
    if dp is not None:
        notes.append(f"distributed.dp_size={dp}: the rows' data parallelism is the world size (an FSDP degree larger "
                     "than the ranks here cannot be)")
    replicate = get("dp_replicate_size", None)
    if replicate:
        notes.append(f"distributed.dp_replicate_size={replicate}: HSDP kept where it fits the ranks (replicas x "
                     "shards = W, both > 1), else FSDP over every rank")
    ac = get("activation_checkpointing", False)
    if ac:
        notes.append(f"distributed.activation_checkpointing={show(ac)}: kept (Automodel's apply_ac; the recompute "
                     "runs the router again)")
    moe = section.get("moe")
    if isinstance(moe, dict) and moe:
        notes.append(f"distributed.moe ({', '.join(map(str, moe))}): not passed on; Automodel's MoE parallelizer "
                     "defaults")
    others = [k for k in section if k not in (*DISTRIBUTED_SIZES, "strategy", "activation_checkpointing", "moe",
                                              "pipeline", "sequence_parallel")]
    if others:
        notes.append(f"distributed: {', '.join(map(str, others))}: not passed on (FSDP2Config's defaults)")
    return {"ep_size": ep, "dp_size": dp, "dp_replicate_size": replicate, "cp_size": cp, "tp_size": tp,
            "activation_checkpointing": ac if isinstance(ac, (bool, str)) else bool(ac)}


def accumulation(path: str, nodes: dict, dist: dict, notes: list[str]) -> int:
    """The recipe's micro-batches a step: global_batch_size / (local_batch_size x dp), as Automodel's StepScheduler
    computes it, at the recipe's data-parallel size (dp_size, else the smallest world its ep_size runs on)."""
    section = nodes["root"].get("step_scheduler", None)
    raw = section.to_dict() if section is not None else {}
    global_bs = raw.get("global_batch_size", 32)  # StepSchedulerConfig's default
    local_bs = raw.get("local_batch_size", 1)  # train_ft's cfg.get("step_scheduler.local_batch_size", 1)
    bounded(path, RECIPE, "step_scheduler.global_batch_size", global_bs, 1, MAX_BATCH)
    bounded(path, RECIPE, "step_scheduler.local_batch_size", local_bs, 1, MAX_BATCH)
    for key in ("max_steps", "num_epochs", "ckpt_every_steps", "val_every_steps"):
        if raw.get(key) is not None:
            bounded(path, RECIPE, f"step_scheduler.{key}", raw[key], 1, 1 << 40)
    tpcp = dist["tp_size"] * dist["cp_size"]
    dp = dist["dp_size"] or max(1, dist["ep_size"] // math.gcd(dist["ep_size"], tpcp))
    where = (f"dp_size {dp}" if dist["dp_size"]
             else f"dp {dp}, the smallest world its ep_size {dist['ep_size']} runs on")
    if global_bs % (local_bs * dp):  # StepScheduler's own rule
        raise UserError(f"step_scheduler in {path}: Automodel refuses it: global_batch_size ({global_bs}) must be "
                        f"divisible by local_batch_size * dp_size ({local_bs} * {dp}, {where}); fix the file",
                        flag=RECIPE)
    acc = global_bs // (local_bs * dp)
    line = (f"step_scheduler: global_batch_size {global_bs} / (local_batch_size {local_bs} x {where}) = {acc} "
            f"micro-batch(es) a step")
    if acc > MAX_ACCUM:
        line += f"; shrunk: the rows accumulate {MAX_ACCUM} (the same path; each costs a forward and backward)"
    else:
        line += "; kept"
    notes.append(line + "; each micro-batch shrunk to a few sequences of 8 tokens a rank")
    return acc


def clip_line(max_norm: float, *, default: bool) -> str:
    head = (f"clip_grad_norm.max_norm not set: Automodel's trainer clips at {max_norm:g} (its default)" if default
            else f"clip_grad_norm.max_norm {max_norm:g}")
    if max_norm <= 0:
        return head + ": no clip"
    if max_norm <= BINDING_NORM:
        return head + ": kept (the small model's gradient norm exceeds it: the clip binds as it is; asserted)"
    return (head + f": kept; the small model's gradient norm is below it, so each row multiplies its loss (and the "
            f"aux-loss scale) by max_norm / {BINDING_NORM:g}, reference alike, and your clip binds (the row records "
            "the factor and asserts that it binds)")


def clip(path: str, section: Any, notes: list[str], later: list[str]) -> float:
    if section is None:
        notes.append(clip_line(DEFAULT_MAX_NORM, default=True))
        return DEFAULT_MAX_NORM
    if not isinstance(section, dict):
        raise UserError(f"clip_grad_norm in {path} must be a mapping (max_norm:, backend:); fix the file",
                        flag=RECIPE)
    unknown = [k for k in section if k not in CLIP_KEYS]
    if unknown:
        raise UserError(f"clip_grad_norm.{unknown[0]} in {path}: Automodel's trainer reads only "
                        f"clip_grad_norm.max_norm and .backend and would ignore it; fix the file", flag=RECIPE)
    value = section.get("max_norm")
    if value is None:
        notes.append(clip_line(DEFAULT_MAX_NORM, default=True))
        return DEFAULT_MAX_NORM
    value = float(bounded(path, RECIPE, "clip_grad_norm.max_norm", value, 0, MAX_NORM, whole=False))
    notes.append(clip_line(value, default=False))
    norm_backend = section.get("backend")
    if norm_backend not in (None, "torch"):
        later.append(f"clip_grad_norm.backend={show(norm_backend)}: not honoured; its Triton kernel needs CUDA: "
                     "Automodel's torch norm")
    return value


def optimizer(nodes: dict, notes: list[str]) -> tuple[str | None, float | None]:
    raw = nodes["root"].get("optimizer", None)
    if raw is None:
        notes.append(f"optimizer: none in the recipe; the rows step with SGD: {OPTIMIZER_WHY}")
        return None, None
    target = raw.get_as_string("_target_", default="?") if hasattr(raw, "get_as_string") else "?"
    name = target.rsplit(".", 1)[-1]
    lr = raw.get("lr", None)
    lr = float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr) else None
    notes.append(f"optimizer: your {name}" + (f" (lr {lr:g})" if lr is not None else "")
                 + f" is replaced by SGD: {OPTIMIZER_WHY}")
    return name, lr


def loss(raw: dict, notes: list[str]) -> None:
    section = raw.get("loss_fn")
    target = section.get("_target_") if isinstance(section, dict) else None
    if target is None or target.endswith(("MaskedCrossEntropy", "FusedLinearCrossEntropy", "ChunkedCrossEntropy")):
        return
    notes.append(f"loss_fn {target.rsplit('.', 1)[-1]}: not honoured; the rows' loss is cross-entropy summed over "
                 "the label tokens / their global count (MaskedCrossEntropy's, as train_ft normalises it)")


def fit_ep(ep_size: int | None, world: int, experts: int) -> int:
    """The EP degree a row verifies: the recipe's (None: every rank), else the largest that fits `world` ranks and
    splits the experts (Automodel needs ep | world and ep | experts)."""
    want = world if ep_size is None else ep_size
    return max(e for e in range(1, min(want, world) + 1) if world % e == 0 and experts % e == 0)

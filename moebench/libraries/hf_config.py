"""--hf-config: a model's config.json, read by transformers' own parser, and the same model shrunk to fit a CPU.

The file is read as `from_pretrained` reads it (`transformers.AutoConfig.from_pretrained(path)`: its model_type
picks transformers' own config class; `auto_map` / remote code is never trusted). Then:
- kept: every setting that touches routing or gradients (the family's ROUTING keys: experts, top-k, the score
  function and normalisation, grouped routing, the scaling factor, shared experts, auxiliary losses, ...);
- shrunk: what only costs time (the family's SHRINK keys: hidden sizes, layers, vocabulary, heads, positions), each
  named with its value before and after, one line;
- not honoured: what cannot run here (a quantization_config's kernels, ...), one line each.
A key transformers' config class does not declare is named (transformers keeps it as an attribute that only code
asking for it reads); one that looks like a misspelt routing key is refused, since the model would silently train
without it. Every count is bounded; a file that is not a config.json is refused; all before any rank starts.

`HFSetup.kwargs` is the shrunk config's constructor arguments (JSON), so a row carries it as one string field and
builds the same config class from it in each rank (`build_config`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
from typing import Any

from moebench.errors import UserError

FLAG = "--hf-config"
MAX_BYTES = 1024 * 1024
"""A config.json is a few KiB (DeepSeek-V3's, with its quantization section: 1.6 KiB); past 1 MiB it is not one."""
MAX_EXPERTS = 4096
"""Routed experts a config may declare (the largest published MoE configs have 384); more is not a model's."""
MAX_SIZE = 1 << 20
"""Any width, count of layers, heads or vocabulary entries (the largest published: vocabularies of ~260k)."""
MAX_FACTOR = 1e4
"""A routing scale or auxiliary-loss coefficient (published ones are 0.001-16)."""


@dataclasses.dataclass(frozen=True)
class Family:
    """What a model family's config says about its MoE, in its own key names."""

    experts: str
    """The key of its routed expert count."""
    routing: tuple[str, ...]
    """Keys that touch routing or gradients: kept as the file has them."""
    shrink: dict[str, Any]
    """Keys that only cost time -> the value a row uses (None: left to the class default)."""
    fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keys set so that the one layer a row keeps is an MoE layer (first_k_dense_replace=0, ...), with why."""


_SIZES = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=16,
              max_position_embeddings=64)
FAMILIES: dict[str, Family] = {
    "mixtral": Family("num_local_experts",
                      ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits",
                       "hidden_act"),
                      dict(_SIZES, intermediate_size=16, head_dim=16)),
    "qwen2_moe": Family("num_experts",
                        ("num_experts", "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef",
                         "output_router_logits", "hidden_act"),
                        dict(_SIZES, intermediate_size=32, moe_intermediate_size=16,
                             shared_expert_intermediate_size=16),
                        {"decoder_sparse_step": 1, "mlp_only_layers": []}),
    "qwen3_moe": Family("num_experts",
                        ("num_experts", "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef",
                         "output_router_logits", "hidden_act"),
                        dict(_SIZES, intermediate_size=32, moe_intermediate_size=16, head_dim=16),
                        {"decoder_sparse_step": 1, "mlp_only_layers": []}),
    "olmoe": Family("num_experts",
                    ("num_experts", "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef",
                     "output_router_logits", "hidden_act"),
                    dict(_SIZES, intermediate_size=16)),
    "deepseek_v3": Family("n_routed_experts",
                          ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group",
                           "routed_scaling_factor", "norm_topk_prob", "hidden_act"),
                          dict(_SIZES, intermediate_size=32, moe_intermediate_size=16, kv_lora_rank=16,
                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
                          {"first_k_dense_replace": 0, "num_mtp_layers": 0}),
    "gpt_oss": Family("num_local_experts",
                      ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits",
                       "swiglu_limit", "swiglu_alpha"),
                      dict(_SIZES, intermediate_size=16, head_dim=16), {"layer_types": ["full_attention"]}),
}
"""The MoE families a --hf-config may be (transformers' model_type); each library's rows say which they build."""
LEGACY_KEYS = ("torch_dtype", "rope_theta", "rope_scaling", "_name_or_path", "model_type")
"""Keys of published files that transformers 5 reads under another name (dtype, rope_parameters) or itself."""
NOT_HONOURED = {
    "quantization_config": "its quantized weights need the quantization kernels (CUDA); the rows train "
                           "unquantized float weights",
    "auto_map": "it names remote code; transformers' own classes are built (trust_remote_code is never set)",
}
RANDOM = ("router_jitter_noise",)
"""Keys that draw random numbers in training besides the *dropout keys: set to 0 in the rows (the one-process
reference cannot draw what each rank draws, so exact parity needs them off), said in one line."""
PUBLISHED_ONLY = {
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
}
"""Keys a family's published files carry that transformers does not read, with the value transformers' code
implements: the file saying otherwise is named (transformers would silently train the other way)."""


@dataclasses.dataclass(frozen=True)
class HFSetup:
    """A read --hf-config: what a row builds from it."""

    path: str
    model_type: str
    config_class: str
    kwargs: dict[str, Any]
    """The shrunk config's constructor arguments (JSON values)."""
    routing: dict[str, Any]
    """The kept routing keys, as the parsed config has them."""
    dtype: str | None
    """The file's dtype (torch_dtype), e.g. "bfloat16"; None when it sets none."""
    notes: tuple[str, ...]
    sha256: str
    """The first DIGEST_CHARS hex digits of the text read (the ranks refuse a file changed since: reread)."""

    @property
    def num_experts(self) -> int:
        return int(self.routing[FAMILIES[self.model_type].experts])

    @property
    def top_k(self) -> int:
        return int(self.routing["num_experts_per_tok"])

    def kwargs_json(self) -> str:
        return json.dumps(self.kwargs, sort_keys=True)


def read(path: str, *, flag: str = FLAG, families: tuple[str, ...] | None = None) -> HFSetup:
    """The file, parsed by transformers, checked, and shrunk (a UserError naming `flag` for anything wrong).
    `families`: the model types the caller's rows build (default: every family here)."""
    from moebench.userfiles import read_text

    text = read_text(path, flag=flag, kind="a model's config.json", max_bytes=MAX_BYTES)
    try:
        raw = json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); give a model's config.json", flag=flag) from None
    except RecursionError:
        raise UserError(f"{path} nests too deep to be a config.json; give a model's config.json", flag=flag) from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} holds a JSON {type(raw).__name__}, not an object; give a model's config.json "
                        "(such as {\"model_type\": \"qwen3_moe\", ...})", flag=flag)
    model_type = raw.get("model_type")
    known = tuple(families or FAMILIES)
    if not isinstance(model_type, str):
        hint = " (a DeepSpeed config? give it to --ds-config)" if "zero_optimization" in raw or \
            "train_batch_size" in raw else ""
        raise UserError(f"{path} has no model_type, so it is not a model's config.json{hint}; give one whose "
                        f"model_type is one of {', '.join(known)}", flag=flag)
    if model_type not in known:
        raise UserError(f"{path} is a {model_type!r} model; the rows build {', '.join(known)}: give one of those "
                        "(docs/libraries/transformers.md#your-launch)", flag=flag)
    config = _parse(path, raw, flag)
    family = FAMILIES[model_type]
    _check_routing(path, raw, config, family, flag)
    notes = _notes(path, raw, config, family, flag)
    kwargs, shrunk = _shrunk_kwargs(config, family)
    notes.insert(1, shrunk)
    try:  # the ranks build this: whatever transformers refuses of the shrunk config is said here, once
        build_config(model_type, kwargs)
    except Exception as exc:  # noqa: BLE001 - see _parse
        said = " ".join(str(exc).split()) or type(exc).__name__
        raise UserError(f"transformers refuses the shrunk copy of {path}: {said[:300]} (a key moebench does not "
                        "shrink alongside the sizes?); report it, or fix the file", flag=flag) from None
    routing = {k: getattr(config, k, None) for k in family.routing}
    dtype = raw.get("torch_dtype", raw.get("dtype"))
    import hashlib

    return HFSetup(path=path, model_type=model_type, config_class=type(config).__name__, kwargs=kwargs,
                   routing=routing, dtype=dtype if isinstance(dtype, str) else None, notes=tuple(notes),
                   sha256=hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS])


def build_config(model_type: str, kwargs: dict[str, Any] | str):
    """The shrunk config, in a rank: transformers' class for `model_type` from the kwargs (or their JSON)."""
    from transformers import AutoConfig

    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    return AutoConfig.for_model(model_type, **kwargs)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number in JSON")


@contextlib.contextmanager
def quiet():
    """transformers' config warnings (deprecated names, checks of the unshrunk file) off the console: the notes say
    what matters."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _parse(path: str, raw: dict, flag: str):
    from transformers import AutoConfig

    try:
        with quiet():
            return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - whatever transformers' parser raises is its refusal, in one line
        # (its strict-dataclass validators raise huggingface_hub's StrictDataclassClassValidationError, not a
        # ValueError, with the reason on a second line)
        said = " ".join(str(exc).split()) or type(exc).__name__
        raise UserError(f"transformers refuses {path}: {said[:300]}; fix the file", flag=flag) from None


def _bounded_int(path, flag, key, value, low, high):
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UserError(f"{key}={value!r} in {path}: must be a whole number from {low} to {high:,}; fix the file",
                        flag=flag)
    return value


def _check_routing(path: str, raw: dict, config, family: Family, flag: str) -> None:
    experts = _bounded_int(path, flag, family.experts, getattr(config, family.experts, None), 1, MAX_EXPERTS)
    _bounded_int(path, flag, "num_experts_per_tok", getattr(config, "num_experts_per_tok", None), 1, experts)
    for key in family.shrink:  # sizes the rows replace: still bounded, as the file's own values
        value = raw.get(key)
        if value is not None:
            _bounded_int(path, flag, key, value, 0, MAX_SIZE)
    for key in ("routed_scaling_factor", "router_aux_loss_coef", "router_jitter_noise", "swiglu_limit",
                "swiglu_alpha"):
        value = getattr(config, key, None) if key in family.routing or key in RANDOM else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                not 0 <= value <= MAX_FACTOR:
            raise UserError(f"{key}={value!r} in {path}: must be a finite number from 0 to {MAX_FACTOR:g}; fix the "
                            "file", flag=flag)
    if "n_group" in family.routing:
        groups = _bounded_int(path, flag, "n_group", getattr(config, "n_group", 1) or 1, 1, experts)
        if experts % groups:
            raise UserError(f"n_group={groups} in {path} does not divide n_routed_experts={experts} (transformers "
                            "splits the experts into equal groups); fix the file", flag=flag)
        _bounded_int(path, flag, "topk_group", getattr(config, "topk_group", 1) or 1, 1, groups)
        if config.num_experts_per_tok > (getattr(config, "topk_group", 1) or 1) * experts // groups:
            raise UserError(f"num_experts_per_tok={config.num_experts_per_tok} in {path} is more than the "
                            f"{config.topk_group} group(s) of {experts // groups} experts it may pick from; fix the "
                            "file", flag=flag)
        _bounded_int(path, flag, "n_shared_experts", getattr(config, "n_shared_experts", 0) or 0, 0, 64)
    for key in ("norm_topk_prob", "output_router_logits"):
        if key in family.routing and key in raw and not isinstance(raw[key], bool):
            raise UserError(f"{key}={raw[key]!r} in {path}: must be true or false; fix the file", flag=flag)


def _declared(config) -> set[str]:
    import inspect

    from transformers import PretrainedConfig

    cls = type(config)
    names = set(inspect.signature(cls.__init__).parameters) | set(inspect.signature(PretrainedConfig.__init__)
                                                                  .parameters)
    names |= set(getattr(cls, "attribute_map", {})) | set(cls().to_dict()) | set(LEGACY_KEYS)
    return names - {"self", "kwargs"}


def _notes(path: str, raw: dict, config, family: Family, flag: str) -> list[str]:
    model_type = config.model_type
    routing = ", ".join(f"{k}={json.dumps(getattr(config, k, None))}" for k in family.routing)
    notes = [f"kept ({type(config).__name__}, read by transformers): {routing}"]
    declared = _declared(config)
    undeclared = [k for k in raw if k not in declared and k not in NOT_HONOURED and k not in family.shrink
                  and k not in family.fixed]
    published = PUBLISHED_ONLY.get(model_type, {})
    for key in undeclared:
        if key in published:
            continue
        close = difflib.get_close_matches(key, family.routing, n=1, cutoff=0.85)
        if close:
            raise UserError(f"{key} in {path} is not a {type(config).__name__} key: did you mean {close[0]}? "
                            f"(transformers would ignore it and train without it); fix the file", flag=flag)
    for key, implemented in published.items():
        if key in raw and raw[key] != implemented:
            notes.append(f"{key}={json.dumps(raw[key])}: transformers' {model_type} does not read it and always "
                         f"uses {implemented}: your model trains with {implemented}, and so do the rows")
    others = [k for k in undeclared if k not in published]
    if others:
        notes.append(f"not declared by {type(config).__name__} (transformers keeps them as attributes, read only "
                     f"where its modeling code asks for them): {', '.join(others)}")
    for key, why in NOT_HONOURED.items():
        if raw.get(key) is not None:
            notes.append(f"{key}: not honoured; {why}")
    drawn = [f"{k}={json.dumps(v)}" for k, v in _random_keys(config.to_dict()).items()]
    if drawn:
        notes.append(f"not honoured: {', '.join(drawn)} -> 0 (random draws in training: the one-process reference "
                     "cannot draw what each rank draws, so the rows turn them off)")
    for key, value in family.fixed.items():
        before = raw.get(key)
        if before is not None and before != value:
            notes.append(f"{key}={json.dumps(before)} -> {json.dumps(value)}: the one layer a row keeps is an MoE "
                         "layer")
    return notes


def _random_keys(values: dict) -> dict[str, Any]:
    """The keys of a config's values that draw random numbers in training, where they are not 0."""
    return {k: v for k, v in values.items() if (k in RANDOM or k.endswith("dropout")) and isinstance(v, (int, float))
            and not isinstance(v, bool) and v != 0}


def _derived(config, family: Family) -> set[str]:
    """Attributes the config class computes itself from its sizes (DeepseekV3Config's qk_head_dim and head_dim from
    the head sizes): not constructor arguments, and different once the sizes are shrunk, so the shrunk config
    rebuilds them from its own sizes instead of carrying the file's."""
    import inspect

    cls = type(config)
    declared = set(inspect.signature(cls.__init__).parameters)
    sizes = {k: v for k, v in family.shrink.items() if v is not None and k in declared}
    full, small = cls().to_dict(), cls(**sizes).to_dict()
    return {k for k in full if k not in declared and full[k] != small.get(k)}


def _shrunk_kwargs(config, family: Family) -> tuple[dict[str, Any], str]:
    """The config's own values (its to_dict, minus what is not a constructor argument), with the SHRINK and fixed
    keys replaced; and the one line naming what was shrunk, before -> after."""
    values = config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "_name_or_path", "quantization_config",
                "auto_map", "dtype", "torch_dtype", "id2label", "label2id"):
        values.pop(key, None)
    changed = []
    rope = values.get("rope_parameters") or values.get("rope_scaling") or {}
    for key, small in family.shrink.items():
        if key == "max_position_embeddings" and isinstance(rope, dict) and "original_max_position_embeddings" in rope:
            continue  # YaRN's factor is this over the original length: shrinking it alone makes transformers warn
        before = getattr(config, key, None)
        if before is None and key in ("head_dim",):
            values[key] = small
            continue
        if before is None or before == small:
            continue
        values[key] = small
        changed.append(f"{key} {before} -> {small}")
    values.update(family.fixed)
    if isinstance(values.get("layer_types"), list) and "layer_types" not in family.fixed:
        values["layer_types"] = values["layer_types"][:values.get("num_hidden_layers", 1)]  # one per layer kept
    values.update({k: 0.0 for k in _random_keys(values)})
    for key in _derived(config, family):  # recomputed from the shrunk sizes; the file's would override them
        values.pop(key, None)
    vocab = values.get("vocab_size", 0)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids of the shrunk vocabulary
        ids = values.get(key)
        if isinstance(ids, list) or (isinstance(ids, int) and not 0 <= ids < vocab):
            values[key] = 0
    if config.model_type == "deepseek_v3" and getattr(config, "q_lora_rank", None):
        changed.append(f"q_lora_rank {config.q_lora_rank} -> 16")
        values["q_lora_rank"] = 16
    line = "shrunk (only costs time): " + (", ".join(changed) if changed else "nothing (already this small)")
    return json.loads(json.dumps(values)), line


DIGEST_CHARS = 16
"""A row records the first 16 hex digits of its config.json's sha256 (a row's settings are JSON scalars of at most
200 characters: the shrunk config itself is ~1.5 KB, so a row carries the file's path and digest instead)."""


def reread(path: str, expected: str, *, families: tuple[str, ...] | None = None) -> HFSetup:
    """In a rank: the file read again as `read` reads it, refused (RuntimeError, one line) when it cannot be read
    or changed since the parent read it (its digest is not `expected`)."""
    import hashlib

    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise RuntimeError(f"{path} cannot be read any more ({exc.strerror or exc})") from None
    found = hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]
    if found != expected:
        raise RuntimeError(f"{path} changed since it was read (sha256 {found}..., read as {expected}...): run "
                           "verify-parity again")
    try:
        return read(path, families=families)
    except UserError as exc:
        raise RuntimeError(str(exc)) from None


def with_experts(kwargs: dict[str, Any], count: int) -> dict[str, Any]:
    """The shrunk config's kwargs with `count` routed experts (under whichever key its class keeps them)."""
    out = dict(kwargs)
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if key in out:
            out[key] = count
    return out

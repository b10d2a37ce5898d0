"""--ds-config: a user's DeepSpeed config, read as DeepSpeed reads it (hjson: JSON with comments, a key given
twice refused), checked before any work (ds_schema: every value within its bound, the optimizer and scheduler
types; the same for verify-parity --ds-config), and merged under moebench's flags.

moebench's defaults <- the file <- the flags. A few keys belong to flags too (FLAG_OWNED_KEYS): the
file's value is used unless the flag is given, and a flag given with another value is a conflict.
No cold JIT compile unless --compiled-ops: the optimizer is torch's Adam (`"torch_adam": true`), not
DeepSpeed's FusedAdam (~90 s cold), and settings that would build an op are refused with the fix.
"""

from __future__ import annotations

import copy
import json
import os
import re

import torch

from moebench.errors import UserError
from moebench.variants.deepspeed.config import DeepSpeedRunConfig

NO_COMPILE_OPTIMIZERS = ("adam", "adamw", "adagrad")
"""ds_config optimizer types that run without a compiled op (plus any torch.optim class name)."""
HALF_PRECISION_KEYS = ("fp16", "bf16", "bfloat16")
"""ds_config sections that switch DeepSpeed to half precision ("bfloat16" is bf16's old name)."""
NEVER_PRINT = 2**31 - 1
"""steps_per_print: moebench prints its own progress."""
MAX_DS_CONFIG_BYTES = 1024 * 1024
"""A DeepSpeed config is a few KiB; anything past 1 MiB is not one (/dev/zero, a wrong file)."""
MAX_DS_CONFIG_DEPTH = 32
"""DeepSpeed's deepest section is 4 levels down; 32 leaves room and keeps json.loads far from recursion limits."""

FLAG_OWNED_KEYS: dict[tuple[str, ...], tuple[tuple[str, ...], str]] = {
    ("train_micro_batch_size_per_gpu",): (("train", "batch_size"), "--batch-size"),
    ("zero_optimization", "stage"): (("engine", "zero_stage"), "--zero-stage"),
    ("optimizer", "params", "lr"): (("train", "lr"), "--lr"),
}
"""ds_config keys a flag also sets (file key -> config field, flag). The file's micro batch is per
rank; --batch-size is global, so it counts as micro batch x world size."""


def _depth(value, limit: int) -> int:
    """Nesting depth of parsed JSON, without recursion (a 200k-deep file must not blow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _object(pairs: list) -> dict:
    """An object of the file, refusing a key given twice (DeepSpeed's reader refuses them too)."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    names = {list: "a list", str: "a string", int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def load_ds_config(path: str) -> dict:
    """The file's object, read as DeepSpeed reads it (hjson: JSON with comments; a key given twice refused); bad
    input (not a regular file, > 1 MiB, not UTF-8, not an object, too deep) names the fix."""
    import hjson

    from moebench.userfiles import read_text

    text = read_text(path, flag="--ds-config", kind="a DeepSpeed JSON file", max_bytes=MAX_DS_CONFIG_BYTES)
    too_deep = UserError(f"{path} nests deeper than {MAX_DS_CONFIG_DEPTH} levels; a DeepSpeed config is a few "
                         "levels deep: fix the file", flag="--ds-config")
    try:
        value = hjson.loads(text, object_pairs_hook=_object)
    except _DuplicateKey as exc:
        raise UserError(f"{path} gives the key {exc.key!r} twice; DeepSpeed refuses a duplicate key: keep one",
                        flag="--ds-config") from None
    except hjson.HjsonDecodeError as exc:
        if re.search(r"[:\[,]\s*[-+]?(NaN|Infinity)\b", text):
            raise UserError(f"{path} holds NaN or Infinity, which are not numbers in JSON (DeepSpeed's reader, "
                            "hjson, refuses them); give a finite number", flag="--ds-config") from None
        raise UserError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                        "fix the file", flag="--ds-config") from None
    except RecursionError:
        raise too_deep from None
    except (OverflowError, ValueError):  # hjson: 1e999 -> "cannot convert float infinity to integer"
        raise UserError(f"{path} holds a number beyond float range (such as 1e999); give a finite number",
                        flag="--ds-config") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} holds {_kind(value)}, not a JSON object (a DeepSpeed config such as "
                        "{\"train_batch_size\": 8}); give a DeepSpeed config file", flag="--ds-config")
    if _depth(value, MAX_DS_CONFIG_DEPTH) > MAX_DS_CONFIG_DEPTH:
        raise too_deep
    return value


def read_checked(path: str) -> dict:
    """load_ds_config, then every value within its bound and the optimizer / scheduler types DeepSpeed builds
    (ds_schema: the one check `run` and `verify-parity` share). Imports DeepSpeed."""
    from moebench.models.deepspeed_moe import set_accelerator_env
    from moebench.variants.deepspeed import ds_schema

    user = load_ds_config(path)
    set_accelerator_env("cuda" if torch.cuda.is_available() else "cpu")  # before DeepSpeed is imported
    ds_schema.check_values(user, path)
    ds_schema.check_types(user, path)
    return user


def refuse_auto(user: dict, path: str) -> None:
    """`run deepspeed` takes no "auto" (the Hugging Face Trainer fills those from its own arguments): one line."""
    from moebench.variants.deepspeed.ds_schema import auto_paths

    autos = auto_paths(user)
    if autos:
        raise UserError(f"{path} leaves {', '.join(autos)} \"auto\" (the Hugging Face Trainer fills them from its "
                        "arguments; run does not): give their values", flag="--ds-config")


def file_values(path: str | None, explicit: dict[tuple[str, ...], object], world_size: int) -> dict:
    """The config fields the file sets (by field path), checked against the flags given."""
    if path is None:
        return {}
    user = read_checked(path)
    refuse_auto(user, path)
    values: dict[tuple[str, ...], object] = {}
    for key, (field, name) in FLAG_OWNED_KEYS.items():
        _require_objects_along(user, key, path)  # the value's own type is checked by the config
        value = _get(user, key)
        if value is None:
            continue
        if field == ("train", "batch_size") and isinstance(value, int) and not isinstance(value, bool):
            value = value * world_size
        given = explicit.get(field)
        if given is not None and given != value:
            raise UserError(f"{path} sets {'.'.join(key)}={_get(user, key)!r} but {name} {given!r} was given; "
                            "drop one of them", flag="--ds-config")
        values[field] = value
    return values


def file_notes(path: str | None, values: dict, preset_config: DeepSpeedRunConfig) -> list[str]:
    """One line per flag-owned key of the file that replaces the preset's value (no flag was
    given for it: a flag given with another value is refused in `file_values`)."""
    if path is None:
        return []
    user = load_ds_config(path)
    notes = []
    for key, (field, name) in FLAG_OWNED_KEYS.items():
        if field not in values:
            continue
        section = getattr(preset_config, field[0])
        before = getattr(section, field[1])
        if values[field] == before:
            continue
        now = f"{name} {values[field]!r}"
        if field == ("train", "batch_size"):
            ranks = preset_config.launch.world_size
            now += f" ({_get(user, key)} per rank x {ranks} rank{'s' if ranks > 1 else ''})"
        notes.append(f"--ds-config: {'.'.join(key)}={_get(user, key)!r} in {os.path.basename(path)} replaces "
                     f"preset {preset_config.preset}'s {name} {before!r}: the run uses {now}")
    return notes


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _require_objects_along(tree: dict, path: tuple[str, ...], ds_path: str) -> None:
    """UserError unless every key above `path`'s leaf that the file has holds a JSON object
    (moebench writes the leaf: {"optimizer": "Adam"} would leave it nowhere to go)."""
    for depth, key in enumerate(path[:-1]):
        if key not in tree:
            return
        tree = tree[key]
        if not isinstance(tree, dict):
            raise UserError(f"{'.'.join(path[:depth + 1])} in {ds_path} must be a JSON object (holding "
                            f"{'.'.join(path[depth + 1:])}), got {json.dumps(tree)}; fix the file",
                            flag="--ds-config")


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_ds_config(config: DeepSpeedRunConfig, user: dict | None = None) -> dict:
    """The DeepSpeed config: moebench's defaults <- the --ds-config file <- the flags."""
    optimizer = {"type": "Adam", "params": {"lr": config.train.lr, "weight_decay": 0.0, "adam_w_mode": False}}
    if not config.engine.compiled_ops:
        optimizer["params"]["torch_adam"] = True  # torch.optim.Adam instead of JIT-built FusedAdam
    base = {
        "train_micro_batch_size_per_gpu": config.batch_per_rank,
        "gradient_accumulation_steps": 1,
        "optimizer": optimizer,
        "zero_optimization": {"stage": config.engine.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": NEVER_PRINT,
        "wall_clock_breakdown": False,
    }
    path = config.engine.ds_config or "--ds-config"
    if user is None:
        user = read_checked(config.engine.ds_config) if config.engine.ds_config else {}
    if user:
        refuse_auto(user, path)
        validate_with_deepspeed(user, path)
    user = copy.deepcopy(user)
    user_optimizer = user.get("optimizer")
    if isinstance(user_optimizer, dict) and str(user_optimizer.get("type", "Adam")).lower() not in ("adam", "adamw"):
        base.pop("optimizer")  # another optimizer: Adam's parameters do not apply to it
    merged = _deep_merge(base, user)
    _set(merged, ("train_micro_batch_size_per_gpu",), config.batch_per_rank)
    _set(merged, ("zero_optimization", "stage"), config.engine.zero_stage)
    _set(merged, ("optimizer", "params", "lr"), config.train.lr)
    merged.setdefault("optimizer", {}).setdefault("type", "Adam")
    _check_ds_config(merged, config, path if user else None)
    _check_half_precision(merged)
    merged["train_batch_size"] = config.train.batch_size
    return merged


def validate_with_deepspeed(user: dict, path: str) -> None:
    """The file's sections checked by DeepSpeed's own pydantic config models (zero_optimization,
    fp16, bf16), before any folder exists. Imports DeepSpeed, so only when a file is given."""
    import pydantic

    from moebench.models.deepspeed_moe import set_accelerator_env

    set_accelerator_env("cuda" if torch.cuda.is_available() else "cpu")  # before DeepSpeed is imported
    from moebench.variants.deepspeed.ds_schema import _section_models

    for key, model in _section_models():
        section = user.get(key)
        if not isinstance(section, dict):
            continue  # absent, or a wrong type the checks below name
        try:
            model(**section)
        except pydantic.ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in (key, *error.get("loc", ())))
            raise UserError(f"{where} in {path}: {error.get('msg', 'invalid')} (DeepSpeed's config model); "
                            "fix the file", flag="--ds-config") from None


def _check_ds_config(ds: dict, config: DeepSpeedRunConfig, path: str | None) -> None:
    """The merged config's settings moebench cannot run; `path`: the file's, whose optimizer / scheduler types are
    checked as verify-parity --ds-config checks them (None: no file, moebench's own Adam)."""
    if path is not None:
        from moebench.variants.deepspeed.ds_schema import check_types

        check_types(ds, path)
    gas = ds.get("gradient_accumulation_steps", 1)
    if gas != 1:
        raise UserError(f"gradient_accumulation_steps={gas!r} is not supported (one optimizer step per "
                        "batch); remove it and size the step with --batch-size", flag="--ds-config")
    tbs = ds.get("train_batch_size")
    if tbs is not None and tbs != config.train.batch_size:
        raise UserError(f"train_batch_size={tbs!r} conflicts with --batch-size {config.train.batch_size} (the global "
                        f"batch of this run, preset {config.preset} and flags); remove it from the file, or pass "
                        f"--batch-size {tbs!r}", flag="--ds-config")
    if not config.engine.compiled_ops:
        needs = compiled_op_settings(ds)
        if needs:
            raise UserError(f"{'; '.join(needs)} needs a JIT-compiled DeepSpeed op (minutes on first use); "
                            "add --compiled-ops to allow it, or remove it", flag="--ds-config")


def _check_half_precision(ds: dict) -> None:
    """fp16 / bf16 need DeepSpeed's CUDA accelerator: on CPU, deepspeed.initialize rejects fp16 and
    the model's LayerNorm fails on bf16 weights - after the run folder exists."""
    enabled = [key for key in HALF_PRECISION_KEYS if isinstance(ds.get(key), dict) and ds[key].get("enabled") is True]
    on_cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda"
    if enabled and not on_cuda:
        raise UserError(f"{enabled[0]}.enabled=true needs a CUDA GPU and DeepSpeed runs on the CPU here "
                        "(fp32 only); remove it or set it to false", flag="--ds-config")


def compiled_op_settings(ds: dict) -> list[str]:
    """The settings of a DeepSpeed config that would JIT-build an op."""
    needs = []
    optimizer = ds.get("optimizer") or {}
    kind = str(optimizer.get("type", "Adam"))
    params = optimizer.get("params") or {}
    if kind.lower() not in NO_COMPILE_OPTIMIZERS and not hasattr(torch.optim, kind):
        needs.append(f"optimizer.type={kind!r}")
    if kind.lower() in ("adam", "adamw") and not params.get("torch_adam", False):
        needs.append("optimizer.params.torch_adam=false (FusedAdam)")
    offload = _get(ds, ("zero_optimization", "offload_optimizer", "device"))
    if offload not in (None, "none"):
        needs.append(f"zero_optimization.offload_optimizer.device={offload!r} (DeepSpeedCPUAdam)")
    return needs

"""What a DeepSpeed config file may hold, as moebench reads it: one mechanism for `run deepspeed --ds-config` and
`verify-parity --ds-config`, checked before any folder, process or tensor exists.

- Values: every number DeepSpeed reads has a bound (moebench.bounds.Number, the flags' mechanism): the numeric
  fields of DeepSpeed's own section models (zero_optimization, fp16, bf16: its pydantic classes, read here, so a
  new field is bounded when DeepSpeed adds it) and its top-level numbers (named by deepspeed.runtime.constants).
  A section that must be an object and is not, a count past its bound, inf or nan: one line naming the key.
- Types: optimizer.type is one of DeepSpeed's optimizers (deepspeed.runtime.config.DEEPSPEED_OPTIMIZERS, any case)
  or a torch.optim class; scheduler.type one of DeepSpeed's (lr_schedules.VALID_LR_SCHEDULES).
- "auto": a Hugging Face Trainer template's value (`auto_paths` finds them; what each command does with them is
  its own rule: verify-parity fills them as the Trainer does, run refuses them).

Imports DeepSpeed (only when a file is given): set the accelerator first (models.deepspeed_moe.set_accelerator_env).
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Iterator

from moebench.bounds import Number
from moebench.errors import UserError

FLAG = "--ds-config"
COUNT_MAX = 2**63 - 1
"""The largest count DeepSpeed's own defaults use (sys.maxsize: zero_optimization.stage3_model_persistence_threshold);
a larger integer is not a count but a typo, and Python would carry it into C code unbounded."""
MAX_ACCUM = 1024
"""gradient_accumulation_steps: a verify-parity row takes every micro-step within its deadline (~5 ms each here, on
W ranks and in the reference); accumulating over more micro-steps is the same mathematics."""
MAX_BATCH = 2**31 - 1
"""train_batch_size / train_micro_batch_size_per_gpu: a C int, as --batch-size."""
MAX_CLIP = 1e6
"""gradient_clipping: a million times any gradient's norm is no clipping (0 turns it off)."""
MAX_SCALE_POWER = 64
"""fp16.initial_scale_power / loss_scale: 2^64 x a loss of 1e19 is already float32's largest number."""
MAX_FLOAT = 1e12
"""Any other real number of a section (no DeepSpeed default is above 1e9)."""
SECTION_KEYS = ("zero_optimization", "fp16", "bf16", "bfloat16", "optimizer", "scheduler")
"""Top-level keys whose value must be a JSON object."""
AUTO = "auto"


def _constants():
    from deepspeed.runtime import constants as c

    return c


@functools.lru_cache(maxsize=1)
def bounds() -> dict[tuple[str, ...], Number]:
    """Every bounded key path of a DeepSpeed config -> its bound."""
    c = _constants()
    out: dict[tuple[str, ...], Number] = {
        (c.GRADIENT_ACCUMULATION_STEPS,): Number(
            integer=True, min=1, max=MAX_ACCUM, why="the micro-steps a verify-parity row takes within its deadline"),
        (c.TRAIN_BATCH_SIZE,): Number(integer=True, min=1, max=MAX_BATCH, why="a C int"),
        (c.TRAIN_MICRO_BATCH_SIZE_PER_GPU,): Number(integer=True, min=1, max=MAX_BATCH, why="a C int"),
        (c.GRADIENT_CLIPPING,): Number(integer=False, min=0, max=MAX_CLIP, why="0 turns clipping off"),
        (c.STEPS_PER_PRINT,): Number(integer=True, min=1, max=COUNT_MAX, why="a count"),
        (c.GRADIENT_PREDIVIDE_FACTOR,): Number(integer=False, min=0, above=True, max=MAX_FLOAT, why="a factor"),
        (c.OPTIMIZER, c.OPTIMIZER_PARAMS, "lr"): Number(integer=False, min=0, max=1000.0,
                                                         why="as --lr: diverges at once beyond"),
    }
    for section, model in _section_models():
        for path, bound in _model_bounds(model):
            out[(section, *path)] = bound
    fp16 = c.FP16
    out[(fp16, c.FP16_INITIAL_SCALE_POWER)] = Number(integer=True, min=0, max=MAX_SCALE_POWER,
                                                     why="2^64 overflows float32 with any loss above 1e19")
    out[(fp16, c.FP16_LOSS_SCALE)] = Number(integer=False, min=0, max=2.0 ** MAX_SCALE_POWER,
                                            why="0 is dynamic loss scaling; 2^64 overflows float32")
    for key, why in ((c.FP16_LOSS_SCALE_WINDOW, "steps"), (c.FP16_HYSTERESIS, "1 halves at the first overflow"),
                     (c.FP16_MIN_LOSS_SCALE, "the dynamic scale's floor")):
        out[(fp16, key)] = Number(integer=True, min=1, max=COUNT_MAX, why=why)
    return out


def _section_models():
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    c = _constants()
    return (("zero_optimization", DeepSpeedZeroConfig), (c.FP16, DeepSpeedFP16Config),
            (c.BFLOAT16, DeepSpeedBF16Config), (c.BFLOAT16_OLD, DeepSpeedBF16Config))


def _model_bounds(model) -> Iterator[tuple[tuple[str, ...], Number]]:
    """A DeepSpeed pydantic model's numeric fields (by name and by alias) with a bound each: its own ge / gt where it
    declares one, else 0; at most COUNT_MAX (integers) or MAX_FLOAT."""
    import enum

    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, enum.Enum) and issubclass(kind, int):  # ZeRO stage: 0-3
            bound = Number(integer=True, min=int(min(kind)), max=int(max(kind)), why="DeepSpeed's stages")
        elif kind in (int, float):
            low = 0.0
            for rule in field.metadata:
                low = float(getattr(rule, "ge", getattr(rule, "gt", low)))
                low += 1 if kind is int and hasattr(rule, "gt") else 0
            bound = Number(integer=kind is int, min=low, max=COUNT_MAX if kind is int else MAX_FLOAT,
                           why="a count" if kind is int else "a real number of DeepSpeed's")
        else:
            continue
        for key in {name, field.alias or name}:
            yield (key,), bound


def _shown(value: Any) -> str:
    return json.dumps(value)[:40]


def walk(tree: dict, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every (key path, value) of a config, depth first."""
    for key, value in tree.items():
        yield (*prefix, key), value
        if isinstance(value, dict):
            yield from walk(value, (*prefix, key))


def auto_paths(user: dict) -> list[str]:
    """The dotted keys whose value is "auto" (a Hugging Face Trainer template's), in file order."""
    return [".".join(path) for path, value in walk(user) if value == AUTO]


def check_values(user: dict, path: str) -> None:
    """UserError (one line naming the key) unless every section is an object and every bounded number is within its
    bound. "auto" is left to the command's rule (auto_paths)."""
    for key in SECTION_KEYS:
        if key in user and not isinstance(user[key], dict):
            raise UserError(f"{key} in {path} must be a JSON object, got {_shown(user[key])}; fix the file", flag=FLAG)
    for sub in ("optimizer", "scheduler"):
        params = user.get(sub, {}).get("params") if isinstance(user.get(sub), dict) else None
        if params is not None and not isinstance(params, dict):
            raise UserError(f"{sub}.params in {path} must be a JSON object, got {_shown(params)}; fix the file",
                            flag=FLAG)
    table = bounds()
    for keys, value in walk(user):
        bound = table.get(keys)
        if bound is None or value == AUTO:
            continue
        if bound.integer and isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)  # DeepSpeed reads 2e8 as a count
        reason = bound.problem(value)
        if reason:
            raise UserError(f"{'.'.join(keys)} in {path}: {reason}; fix the file", flag=FLAG)


@functools.lru_cache(maxsize=1)
def optimizers() -> tuple[str, ...]:
    """optimizer.type values DeepSpeed builds itself (any case)."""
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    return tuple(DEEPSPEED_OPTIMIZERS)


@functools.lru_cache(maxsize=1)
def schedulers() -> tuple[str, ...]:
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

    return tuple(VALID_LR_SCHEDULES)


def torch_optimizer(name: str) -> bool:
    """`name` is a torch.optim optimizer class (DeepSpeed builds those too)."""
    import torch

    found = getattr(torch.optim, name, None) if name.isidentifier() else None
    return isinstance(found, type) and issubclass(found, torch.optim.Optimizer)


def check_types(user: dict, path: str) -> None:
    """UserError unless optimizer.type and scheduler.type (where given) name what DeepSpeed builds."""
    optimizer = user.get("optimizer")
    if isinstance(optimizer, dict) and "type" in optimizer:
        kind = optimizer["type"]
        if not isinstance(kind, str) or not (kind.lower() in optimizers() or torch_optimizer(kind)):
            raise UserError(f"optimizer.type={_shown(kind)} in {path} is neither a DeepSpeed optimizer "
                            f"({', '.join(optimizers())}) nor a torch.optim class such as SGD; fix the file",
                            flag=FLAG)
    scheduler = user.get("scheduler")
    if isinstance(scheduler, dict):
        kind = scheduler.get("type")
        if kind not in schedulers():
            raise UserError(f"scheduler.type={_shown(kind)} in {path} is not one of DeepSpeed's schedulers "
                            f"({', '.join(schedulers())}); fix it or remove the scheduler", flag=FLAG)

"""The config tree every run shares, and the one way a run config is resolved.

A run config (one per variant, in `moebench/variants/<name>/config.py`) is a `kw_only` dataclass
holding whole sub-configs, each validated in its own `__post_init__`:

    RunConfig
      preset   name of the preset it started from
      model    ModelConfig    the shared Transformer (layers, d_model, heads)
      moe      <variant's>    the MoE layer (experts, d_hidden, top_k, gate or capacity, ...)
      train    TrainConfig    data and optimiser (batch_size, seq_len, samples, epochs/steps, lr, seed)
      launch   LaunchConfig   where it runs (world_size, device, comm_backend, timeout_s)

Resolution is one rule: the preset (experiments/<variant>/<preset>.json, nested the same way)
is the one source of defaults; flags override it field by field. Every field is a command-line
flag named after it (`batch_size` -> `--batch-size`), with its docstring as the help text: the CLI
derives its flags from this tree (moebench/cli/flags.py), so nothing is written twice.

This module imports no torch and no Typer: `moebench --help` stays fast.

Over 400 lines: the config tree's machinery (presets, files, flags, bounds, validation) in one place, so what
an option accepts is read in one file.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.resources
import inspect
import json
import math
import textwrap
import types
import typing
from typing import Any

from moebench import bounds
from moebench.bounds import Number
from moebench.errors import UserError
from moebench.rankenv import is_launched_rank

SEED_LIMIT = 2**63
"""Seeds are 0 <= seed < 2**63: torch.Generator.manual_seed takes 64 bits, and every derived seed
(seed + offset, seed * prime + epoch) is reduced modulo this so it stays in range too."""
MAX_WORLD_SIZE = 64
"""Most local ranks any command starts: beyond this a 2-core laptop or a 64-core node only thrashes
(each forked rank is a whole Python process with torch loaded)."""
DEVICES = ("auto", "cpu", "cuda")
COMM_BACKENDS = ("auto", "gloo", "nccl")
PRESETS_PACKAGE = "moebench.experiments"
"""The presets' home: the top-level experiments/ folder, mapped into the package (pyproject.toml),
so a wheel carries it and importlib.resources reads it from a checkout and an install alike."""


def flag(name: str | None = None, *, short: str | None = None, choices: tuple[str, ...] = (),
         aliases: tuple[str, ...] = (), metavar: str | None = None, bound: bounds.Bound | None = None) -> dict:
    """Field metadata for the CLI: the flag's name when it is not `--<field-name>`, a short form,
    case-insensitive choices, hidden old spellings, the placeholder shown in --help, and the value's
    bound (moebench.bounds: checked in __post_init__ and while the CLI reads the flag)."""
    return {"flag": name, "short": short, "choices": choices, "aliases": aliases, "metavar": metavar,
            "bound": bound}


def bounded(bound: bounds.Bound, **meta) -> dict:
    """`dataclasses.field(metadata=...)` of a field with a bound (and other `flag` metadata)."""
    return flag(bound=bound, **meta)


MAX_LAYERS = 1024
"""Transformer blocks: deeper than any published MoE model (GLaM: 64) by far."""
MAX_WIDTH = 2**20
"""--d-model and --heads: 85x the widest published model (GPT-3: 12288)."""
MAX_HIDDEN = 2**22
"""An expert's hidden width: 4x --d-model's bound."""
MAX_EXPERTS = 2**20
"""Experts per layer: 512x the largest published layer (Switch: 2048)."""
MAX_TOP_K = 1024
"""Experts a token is sent to."""
MAX_BATCH = 2**31 - 1
"""Sequences per global batch (a C int; the memory estimate refuses far less)."""
MAX_SEQ_LEN = 2**20
"""Tokens per sequence (a million)."""
MAX_SAMPLES = 2**31 - 1
"""Sequences in the random training set (C int range: samplers and DeepSpeed index with it)."""
MAX_EPOCHS = 10**6
"""Passes over the training set."""
MAX_STEPS = 10**9
"""Optimiser steps (under a C int: DeepSpeed's step counters are C ints)."""
MAX_LR = 1e3
"""Adam's learning rate: beyond this the first step already diverges."""
MAX_AUX_LOSS_COEF = 1e6
"""Weight of the balance loss."""
TIMEOUT_BOUND = Number(integer=False, min=0, above=True, max=bounds.WEEK_S,
                       why="7 days")
"""Every --timeout: positive, at most a week (a larger one is a run that would never be stopped)."""


def positive(limit: float, why: str = "") -> Number:
    """An integer from 1 to `limit`."""
    return Number(integer=True, min=1, max=limit, why=why)


# --------------------------------------------------------------------------- validation helpers


def require_positive_ints(values_by_flag: dict[str, object]) -> None:
    """UserError naming the first flag whose value is not an int >= 1 (bools are not ints here)."""
    for name, value in values_by_flag.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"must be a positive integer, got {value!r}", flag=name)


def require_finite(values_by_flag: dict[str, object]) -> None:
    """UserError naming the first flag whose value is not a finite real number (no nan/inf, no bool)."""
    for name, value in values_by_flag.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"must be a finite number, got {value!r}", flag=name)


def require_positive(values_by_flag: dict[str, object]) -> None:
    """Finite and > 0."""
    require_finite(values_by_flag)
    for name, value in values_by_flag.items():
        if not value > 0:
            raise UserError(f"must be positive, got {value}", flag=name)


def require_choice(value: object, choices: tuple[str, ...], name: str) -> None:
    if value not in choices:
        raise UserError(f"unknown value {value!r}; use one of {', '.join(choices)}", flag=name)


SEED_BOUND = Number(integer=True, min=0, max=SEED_LIMIT - 1,
                    refusal=f"must be an integer from 0 to 2**63-1 ({SEED_LIMIT - 1}), got {{value}}")
"""Seeds: 0 is a seed like any other."""


def require_seed(seed: object, name: str = "--seed") -> None:
    """UserError unless `seed` is an int with 0 <= seed < 2**63 (one range for every command)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise UserError(f"must be an integer from 0 to 2**63-1 ({SEED_LIMIT - 1}), got {seed!r}", flag=name)


def derived_seed(value: int) -> int:
    """A seed computed from the user's seed (offsets, products), kept inside [0, 2**63)."""
    return value % SEED_LIMIT


WORLD_SIZE_BOUND = Number(integer=True, min=1, max=MAX_WORLD_SIZE, why="local ranks; for more, use torchrun")


def require_world_size(world_size: object) -> None:
    bounds.check(WORLD_SIZE_BOUND, world_size, "--world-size")  # the same message as the CLI's
    require_positive_ints({"--world-size": world_size})
    if world_size > MAX_WORLD_SIZE:
        raise UserError(f"must be at most {MAX_WORLD_SIZE} local ranks, got {world_size}; for more, start "
                        "moebench under torchrun on several machines", flag="--world-size")


def require_launch_env() -> None:
    """Launcher variables that cannot make a rank (RANK without MASTER_ADDR, ...) are refused in one line
    before any work, in every command that runs ranks (rankenv.launch_env_problem)."""
    from moebench.rankenv import launch_env_problem

    problem = launch_env_problem()
    if problem is not None:
        raise UserError(problem)


def require_launched_world(asked: int | None) -> None:
    """Under torchrun (or the deepspeed launcher) the job's WORLD_SIZE is the world size: a
    --world-size that says otherwise is refused, never silently replaced."""
    from moebench.rankenv import launched_world_size

    launched = launched_world_size()
    if asked is not None and asked != launched:
        raise UserError(f"asks for {asked} ranks, but this process is one rank of a launched job of {launched} "
                        f"(WORLD_SIZE={launched}, set by torchrun or the deepspeed launcher); drop --world-size, "
                        f"or launch {asked} ranks (torchrun --nproc-per-node {asked} ...)", flag="--world-size")


# --------------------------------------------------------------------------- the shared sub-configs


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """The shared pre-norm Transformer that holds the MoE layer."""

    layers: int = dataclasses.field(metadata=bounded(positive(MAX_LAYERS, "blocks")))
    """Transformer blocks, each with an MoE layer as its MLP."""
    d_model: int = dataclasses.field(metadata=bounded(positive(MAX_WIDTH, "85x GPT-3's width")))
    """Model width (hidden size)."""
    heads: int = dataclasses.field(metadata=bounded(positive(MAX_WIDTH, "at most --d-model")))
    """Attention heads; must divide --d-model."""

    def __post_init__(self) -> None:
        bounds.check_fields(self)  # first: the same message as the CLI's reading of the flag
        require_positive_ints({"--layers": self.layers, "--d-model": self.d_model, "--heads": self.heads})
        if self.d_model % self.heads:
            raise UserError(f"d_model {self.d_model} is not divisible by {self.heads} heads; "
                            "pick --heads that divides --d-model", flag="--heads")


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """Random data and the optimiser (Adam on MSE + aux_loss_coef x the gates' balance loss)."""

    batch_size: int = dataclasses.field(metadata=bounded(positive(MAX_BATCH, "a C int")))
    """Sequences per optimiser step over all ranks (the global batch)."""
    seq_len: int = dataclasses.field(metadata=flag(aliases=("--seq",), bound=positive(MAX_SEQ_LEN, "tokens")))
    """Tokens per sequence."""
    samples: int = dataclasses.field(metadata=bounded(positive(MAX_SAMPLES, "a C int")))
    """Sequences in the random training set, reshuffled every epoch (= batch size: one batch)."""
    epochs: int = dataclasses.field(metadata=bounded(positive(MAX_EPOCHS, "passes")))
    """Passes over the training set (an epoch is samples // batch_size steps)."""
    steps: int | None = dataclasses.field(default=None, metadata=bounded(positive(MAX_STEPS, "under a C int")))
    """Optimiser steps in all; replaces --epochs (the training set is cycled)."""
    lr: float = dataclasses.field(metadata=bounded(Number(integer=False, min=0, above=True, max=MAX_LR,
                                                          why="diverges at once beyond")))
    """Adam learning rate."""
    aux_loss_coef: float = dataclasses.field(metadata=bounded(Number(integer=False, min=0, max=MAX_AUX_LOSS_COEF,
                                                                     why="0 turns it off")))
    """Weight of the gates' balance (aux) loss in the training loss."""
    seed: int = dataclasses.field(metadata=bounded(SEED_BOUND))
    """Seeds the weights, the data and the gate noise (0 to 2**63-1)."""

    def __post_init__(self) -> None:
        bounds.check_fields(self)  # first: the same message as the CLI's reading of the flag
        require_positive_ints({"--batch-size": self.batch_size, "--seq-len": self.seq_len,
                               "--samples": self.samples, "--epochs": self.epochs})
        if self.steps is not None:
            require_positive_ints({"--steps": self.steps})
        require_positive({"--lr": self.lr})
        require_finite({"--aux-loss-coef": self.aux_loss_coef})
        if self.aux_loss_coef < 0:
            raise UserError(f"must be >= 0, got {self.aux_loss_coef}", flag="--aux-loss-coef")
        require_seed(self.seed)
        bounds.check_fields(self)
        if self.samples < self.batch_size:
            raise UserError(f"{self.samples} samples do not fill one global batch of {self.batch_size}; "
                            f"use --samples >= {self.batch_size} (or a smaller --batch-size)", flag="--samples")

    @property
    def steps_per_epoch(self) -> int:
        return self.samples // self.batch_size

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.epochs * self.steps_per_epoch

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def plan(self) -> str:
        """How long the run trains, as a headline says it ("5 epochs x 40 steps"; with --steps, the
        steps and the epoch length, never a count of whole epochs it does not run)."""
        per = self.steps_per_epoch
        if self.steps is not None:
            return f"{self.steps} step{'s' * (self.steps != 1)}, epochs of {per} step{'s' * (per != 1)}"
        return f"{self.epochs} epoch{'s' * (self.epochs != 1)} x {per} step{'s' * (per != 1)}"


@dataclasses.dataclass(kw_only=True)
class LaunchConfig:
    """Where the run goes: how many local ranks, which device and collective backend, how long."""

    world_size: int = dataclasses.field(default=1, metadata=flag(short="-n", bound=WORLD_SIZE_BOUND))
    """Ranks to start on this machine (under torchrun: its WORLD_SIZE)."""
    device: str = dataclasses.field(default="auto", metadata=flag(choices=DEVICES))
    """auto (CUDA where every local rank gets a GPU, else cpu), cpu or cuda."""
    comm_backend: str = dataclasses.field(default="auto", metadata=flag(choices=COMM_BACKENDS))
    """Collective backend: auto (NCCL on CUDA ranks, else gloo), gloo or nccl."""
    timeout_s: float | None = dataclasses.field(default=None, metadata=flag("--timeout", metavar="SECONDS",
                                                                             bound=TIMEOUT_BOUND))
    """Hang deadline, at most 604800 s (7 days): hung ranks are dumped and killed then (run: default from its
    size; verify-parity: per check)."""

    def __post_init__(self) -> None:
        if not is_launched_rank():  # under torchrun its WORLD_SIZE decides, whatever its size
            require_world_size(self.world_size)
        require_choice(self.device, DEVICES, "--device")
        require_choice(self.comm_backend, COMM_BACKENDS, "--comm-backend")
        if self.timeout_s is not None:
            require_positive({"--timeout": self.timeout_s})
            bounds.check(TIMEOUT_BOUND, self.timeout_s, "--timeout")


# --------------------------------------------------------------------------- walking the tree


@dataclasses.dataclass(frozen=True, kw_only=True)
class FieldSpec:
    """One leaf of a config tree, as the CLI and --show-config see it."""

    path: tuple[str, ...]
    """("train", "batch_size")."""
    name: str
    """The flag: "--batch-size"."""
    kind: type
    """int, float, str or bool (a tuple-valued field is given as text: "4,8")."""
    optional: bool
    """None is a valid value (the field's default is None)."""
    help: str
    meta: dict


def _annotation(cls: type, name: str):
    return typing.get_type_hints(cls)[name]


def _unwrap(tp) -> tuple[Any, bool]:
    """(the type without None, whether None was allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (the line after `name: type`), read from source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
                docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def leaves(cls: type, prefix: tuple[str, ...] = ()) -> list[FieldSpec]:
    """Every leaf field of a run config class, depth first, sub-configs expanded."""
    out: list[FieldSpec] = []
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, optional = _unwrap(_annotation(cls, f.name))
        if dataclasses.is_dataclass(tp):
            out.extend(leaves(tp, prefix + (f.name,)))
            continue
        meta = {**flag(), **dict(f.metadata)}
        kind = tp if tp in (int, float, str, bool) else str
        out.append(FieldSpec(path=prefix + (f.name,), name=meta["flag"] or "--" + f.name.replace("_", "-"),
                             kind=kind, optional=optional, help=docs.get(f.name, ""), meta=meta))
    return out


def overrides_by_name(cls: type, values: dict[str, Any], *, where: str) -> dict[tuple[str, ...], Any]:
    """{field path: value} from settings named by field (`experts=4`, `world_size=2`, `timeout_s=60`):
    the Python API's spelling of the flags. An unknown name, or a value whose type the flag would not
    parse (a bool for an int, a str for a float), is a UserError naming the flag."""
    specs = {spec.path[-1]: spec for spec in leaves(cls) if spec.path != ("preset",)}
    out: dict[tuple[str, ...], Any] = {}
    for name, value in values.items():
        spec = specs.get(name)
        if spec is None:
            raise UserError(f"{where} has no setting {name!r}; use one of: {', '.join(specs)}")
        if value is None:
            continue
        wanted = _API_TYPES.get(spec.kind, ()) if _unwrap(_annotation_at(cls, spec.path))[0] is spec.kind else ()
        if wanted and (isinstance(value, bool) != (spec.kind is bool) or not isinstance(value, wanted)):
            raise UserError(f"must be {spec.kind.__name__}, got {value!r} ({name}=)", flag=spec.name)
        out[spec.path] = value
    return out


_API_TYPES: dict[type, tuple[type, ...]] = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}
"""The Python values each flag type takes in `overrides_by_name` (a float flag takes an int too)."""


def _annotation_at(cls: type, path: tuple[str, ...]):
    for name in path[:-1]:
        cls = _unwrap(_annotation(cls, name))[0]
    return _annotation(cls, path[-1])


def build(cls: type, values: dict, *, where: str = "") -> Any:
    """A config instance from a nested dict (a preset merged with flags); unknown or missing keys
    are bad input naming `where` (the preset file)."""
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise UserError(f"{where or cls.__name__} has unknown keys {unknown}", flag="--preset")
    kwargs = {}
    for name, f in known.items():
        tp, _ = _unwrap(_annotation(cls, name))
        if name not in values:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise UserError(f"{where or cls.__name__} lacks {name!r}", flag="--preset")
            continue
        value = values[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise UserError(f"{where}: {name} must be an object, got {value!r}", flag="--preset")
            value = build(tp, value, where=f"{where}: {name}" if where else name)
        kwargs[name] = value
    return cls(**kwargs)


def as_dict(config: Any) -> dict:
    """The nested dict of a config (tuples as lists): what config.json and --show-config hold."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


# --------------------------------------------------------------------------- presets


def preset_names(variant: str) -> list[str]:
    folder = importlib.resources.files(PRESETS_PACKAGE) / variant
    if not folder.is_dir():
        return []
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def load_preset(variant: str, name: str) -> dict:
    """experiments/<variant>/<name>.json as a nested dict ("description" kept aside)."""
    resource = importlib.resources.files(PRESETS_PACKAGE) / variant / f"{name}.json"
    if not name or "/" in name or not resource.is_file():
        raise UserError(f"unknown preset {name!r}; available: {', '.join(preset_names(variant)) or 'none'}",
                        flag="--preset")
    values = json.loads(resource.read_text(encoding="utf-8"))
    values.pop("description", None)
    return values


def preset_description(variant: str, name: str) -> str:
    resource = importlib.resources.files(PRESETS_PACKAGE) / variant / f"{name}.json"
    return json.loads(resource.read_text(encoding="utf-8")).get("description", "")


def resolve(cls: type, variant: str, preset: str, overrides: dict[tuple[str, ...], Any]) -> Any:
    """Preset, then every override (keyed by field path) that is not None; validated."""
    values = load_preset(variant, preset)
    for path, value in overrides.items():
        if value is None:
            continue
        node = values
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    if overrides.get(("train", "epochs")) is not None and overrides.get(("train", "steps")) is None:
        values.setdefault("train", {})["steps"] = None  # --epochs given: a preset's step count yields
    values["preset"] = preset
    return build(cls, values, where=f"preset {variant}/{preset}")

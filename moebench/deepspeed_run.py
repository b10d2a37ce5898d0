"""`moebench run deepspeed`: the chapter's DeepSpeed-MoE Transformer, trained by DeepSpeed's engine.

Flow: preset (experiments/deepspeed/<name>.json) <- --ds-config <- flags -> `DeepSpeedRunConfig`
(validated before DeepSpeed is imported) -> `execute_run` (results/deepspeed/<run-id>/) ->
`deepspeed_rank` on 1 process or N ranks: DeepSpeed comm on the existing process group, the
shared Transformer with DeepSpeed's MoE as MLP, `deepspeed.initialize` with the MoE parameter
groups split, per-epoch training on a seeded random dataset, a (batch, seq, d_model) test batch.

No cold JIT compile on the default path (see docs/run-deepspeed.md):
- DeepSpeed's CPU comm backend builds its shared-memory op (`deepspeed_shm_comm`, ~60 s cold) in
  every `TorchBackend()` whenever `deepspeed.ops.__compatible_ops__` says it can. DeepSpeed keeps
  that dict as a mutable module attribute; marking the op incompatible is the only switch it has,
  and makes `build_shm_op()` return None (gloo does the collectives, as it would on macOS).
- The optimizer is `torch.optim.Adam` (`"torch_adam": true`), not DeepSpeed's FusedAdam (~90 s).
`--compiled-ops` restores both DeepSpeed defaults.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from moebench import config as shared_config
from moebench import results
from moebench.distributed.launch import (PG_TIMEOUT_FRACTION, RankContext, local_world_size, resolve_backend,
                                         under_torchrun)
from moebench.errors import UserError
from moebench.models.deepspeed_moe import NOISY_GATE_POLICIES
from moebench.train import LoopSpec, RunOutcome, execute_run, loss_summary, train_loop

KIND = "deepspeed"
SHM_COMM_OP = "deepspeed_shm_comm"
"""DeepSpeed's CPU shared-memory collective op (JIT-built on first use)."""
DATA_SEED_OFFSET = 101
"""The training data comes from seed + this (weights from seed), so they never share a stream."""
TEST_SEED_OFFSET = 1_000_003
"""The test batch comes from seed + this: never a training sample."""
SUPPORTED_ZERO_STAGES = (0, 1, 2)
"""DeepSpeed's native MoE does not support ZeRO stage 3."""
NO_COMPILE_OPTIMIZERS = ("adam", "adamw", "adagrad")
"""ds_config optimizer types that run without a compiled op (plus any torch.optim class name)."""
_NEVER_PRINT = 2**31 - 1
"""steps_per_print: moebench prints its own progress."""
HANG_DEADLINE_FLOOR_S = 1800.0
"""Smallest default --timeout: the chapter preset takes 1.5 min idle, 8.5 min on 2 busy cores."""
DEADLINE_S_PER_WEIGHT_STEP = 3e-7
"""Default --timeout grows by this per (weight x step): 4x the slowest rate measured (2.5 s per
step of the chapter's ~36 M weights on 2 busy cores), so only longer runs get longer deadlines."""
HALF_PRECISION_KEYS = ("fp16", "bf16", "bfloat16")
"""ds_config sections that switch DeepSpeed to half precision ("bfloat16" is bf16's old name)."""


@dataclasses.dataclass(kw_only=True)
class DeepSpeedRunConfig:
    preset: str = "chapter"
    """Preset the values started from (experiments/deepspeed/<preset>.json)."""
    layers: int = 2
    """Transformer blocks; each has a DeepSpeed MoE layer as its MLP."""
    experts: tuple[int, ...] = (8,)
    """Experts per MoE layer: one count for every layer, or one per layer (pyramid / PR-MoE)."""
    d_model: int = 512
    """Hidden size (the chapter's 512)."""
    d_hidden: int = 2048
    """Hidden width of each expert's MLP (4 x d_model)."""
    heads: int = 8
    """Attention heads (must divide d_model)."""
    top_k: int = 1
    """Experts per token (DeepSpeed's k)."""
    capacity_factor: float = 1.0
    """Training capacity factor."""
    eval_capacity_factor: float = 1.0
    """Capacity factor in eval mode (the test batch)."""
    min_capacity: int = 4
    """Minimum capacity of every expert."""
    noisy_gate_policy: str = "none"
    """none | Jitter | RSample (RSample needs top_k 1)."""
    use_residual: bool = False
    """Residual MoE: a dense MLP beside the experts."""
    drop_tokens: bool = True
    """Drop tokens beyond capacity."""
    use_rts: bool = True
    """Random Token Selection (DeepSpeed's default)."""
    ep_size: int = 1
    """Expert-parallel ranks; must divide the world size and every layer's expert count."""
    zero_stage: int = 0
    """ZeRO stage 0, 1 or 2."""
    aux_loss_coef: float = 0.01
    """Weight of the summed gate losses (l_aux) in the training loss."""
    epochs: int = 5
    """Passes over the dataset (the chapter reports 5)."""
    batch: int = 32
    """Sequences per rank per step (DeepSpeed's train_micro_batch_size_per_gpu)."""
    seq: int = 8
    """Tokens per sequence."""
    samples: int = 1280
    """Sequences in the random training set; an epoch is samples // (batch x world_size) steps."""
    lr: float = 1e-3
    """Adam learning rate."""
    seed: int = 0
    """Seeds the weights, the data and the gate noise."""
    world_size: int = 1
    """Ranks (local, or the launcher's WORLD_SIZE under torchrun / deepspeed)."""
    backend: str = "auto"
    """auto | gloo | nccl for the launched ranks."""
    timeout_s: float | None = None
    """Deadline of the whole run on N ranks (hung ranks are dumped and killed then); None: the
    default, max(HANG_DEADLINE_FLOOR_S, steps x weights x DEADLINE_S_PER_WEIGHT_STEP)."""
    compiled_ops: bool = False
    """Allow DeepSpeed's JIT-compiled ops (shm comm op, FusedAdam, CPUAdam, ...)."""
    ds_config_path: str | None = None
    """The --ds-config file (recorded; its contents are in ds_config_file)."""
    ds_config_file: dict = dataclasses.field(default_factory=dict)
    """The --ds-config file's contents, merged under the flags."""

    def __post_init__(self) -> None:
        self.experts = tuple(self.experts) if isinstance(self.experts, (list, tuple)) else (self.experts,)
        positive = {"--layers": self.layers, "--d-model": self.d_model, "--d-hidden": self.d_hidden,
                    "--heads": self.heads, "--top-k": self.top_k, "--ep-size": self.ep_size,
                    "--epochs": self.epochs, "--batch": self.batch, "--seq": self.seq,
                    "--samples": self.samples, "--world-size": self.world_size}
        shared_config.require_positive_ints(positive)
        if not self.experts or any(isinstance(e, bool) or not isinstance(e, int) or e < 1 for e in self.experts):
            raise UserError(f"expert counts must be positive integers, got {list(self.experts)}", flag="--experts")
        if len(self.experts) not in (1, self.layers):
            raise UserError(f"gives {len(self.experts)} expert counts for {self.layers} MoE layers; "
                            f"give one count, or one per layer (or set --layers {len(self.experts)})",
                            flag="--experts")
        if isinstance(self.zero_stage, bool) or not isinstance(self.zero_stage, int):
            raise UserError(f"must be an integer ZeRO stage (0, 1 or 2), got {self.zero_stage!r}",
                            flag="--zero-stage")
        if self.zero_stage == 3:
            raise UserError("stage 3 is not supported: DeepSpeed's native MoE does not "
                            "support ZeRO stage 3; use --zero-stage 0, 1 or 2", flag="--zero-stage")
        if self.zero_stage not in SUPPORTED_ZERO_STAGES:
            raise UserError(f"unknown ZeRO stage {self.zero_stage} (DeepSpeed has stages 0-3); "
                            "use --zero-stage 0, 1 or 2", flag="--zero-stage")
        if self.world_size % self.ep_size:
            raise UserError(f"ep_size {self.ep_size} does not divide the world size {self.world_size}; "
                            "pick --ep-size dividing --world-size", flag="--ep-size")
        for layer, experts in enumerate(self.experts_per_layer):
            if experts % self.ep_size:
                raise UserError(f"ep_size {self.ep_size} does not divide layer {layer}'s {experts} experts; "
                                "pick --ep-size dividing every expert count", flag="--ep-size")
            if self.top_k > experts:
                raise UserError(f"top-k {self.top_k} exceeds layer {layer}'s {experts} experts; "
                                "lower --top-k", flag="--top-k")
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise UserError(f"unknown policy {self.noisy_gate_policy!r}; use one of "
                            f"{', '.join(NOISY_GATE_POLICIES)}", flag="--noisy-gate-policy")
        if self.noisy_gate_policy == "RSample" and self.top_k > 1:
            # An error, not a warning: DeepSpeed applies RSample only in top-1 gating and would
            # silently train without the noise the user asked for.
            raise UserError(f"RSample only applies with --top-k 1 (DeepSpeed silently ignores it for "
                            f"k={self.top_k}); use --noisy-gate-policy Jitter or none, or --top-k 1",
                            flag="--noisy-gate-policy")
        if isinstance(self.min_capacity, bool) or not isinstance(self.min_capacity, int) or self.min_capacity < 0:
            raise UserError(f"must be an integer >= 0, got {self.min_capacity!r}", flag="--min-capacity")
        if self.tokens_per_rank < self.min_capacity:
            raise UserError(f"each rank routes {self.batch}x{self.seq}={self.tokens_per_rank} tokens per step, "
                            f"fewer than --min-capacity {self.min_capacity}; lower --min-capacity or raise "
                            "--batch / --seq", flag="--min-capacity")
        if self.timeout_s is None:
            self.timeout_s = self.default_timeout_s
        positive_floats = {"--capacity-factor": self.capacity_factor,
                           "--eval-capacity-factor": self.eval_capacity_factor, "--lr": self.lr,
                           "--timeout": self.timeout_s}
        shared_config.require_finite({**positive_floats, "--aux-loss-coef": self.aux_loss_coef})
        for flag, value in positive_floats.items():
            if not value > 0:
                raise UserError(f"must be positive, got {value}", flag=flag)
        if not self.aux_loss_coef >= 0:
            raise UserError(f"must be >= 0, got {self.aux_loss_coef}", flag="--aux-loss-coef")
        if self.d_model % self.heads:
            raise UserError(f"d_model {self.d_model} is not divisible by {self.heads} heads; "
                            "pick --heads dividing --d-model", flag="--heads")
        if self.samples < self.batch * self.world_size:
            raise UserError(f"{self.samples} samples do not fill one step of {self.batch} per rank on "
                            f"{self.world_size} rank(s); use --samples >= {self.batch * self.world_size}",
                            flag="--samples")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise UserError(f"unknown backend {self.backend!r}; use auto, gloo or nccl", flag="--backend")
        if self.backend == "nccl":  # checked here: otherwise every rank fails after the run folder exists
            ranks = local_world_size(self.world_size)
            shared_config.require_gpus(ranks, flag="--backend", why=f"nccl on {ranks} local rank(s)",
                                       need_nccl=True, fix="use --backend gloo or auto")
        shared_config.require_seed(self.seed)

    @property
    def experts_per_layer(self) -> tuple[int, ...]:
        return self.experts * self.layers if len(self.experts) == 1 else self.experts

    @property
    def tokens_per_rank(self) -> int:
        return self.batch * self.seq

    @property
    def steps_per_epoch(self) -> int:
        return self.samples // (self.batch * self.world_size)

    @property
    def weights(self) -> int:
        """Approximate weight count (attention + experts + gates; biases and norms left out)."""
        d, h = self.d_model, self.d_hidden
        return sum(4 * d * d + (e + self.use_residual) * 2 * d * h + d * e for e in self.experts_per_layer)

    @property
    def default_timeout_s(self) -> float:
        steps = self.epochs * max(1, self.steps_per_epoch)
        return max(HANG_DEADLINE_FLOOR_S, float(math.ceil(steps * self.weights * DEADLINE_S_PER_WEIGHT_STEP)))


def comm_backend(config: DeepSpeedRunConfig) -> str:
    """The torch.distributed backend the ranks use, as `launch` resolves --backend with the local
    world size; one in-process rank (world size 1) opens a one-rank group resolved the same way."""
    ranks = local_world_size(config.world_size)
    return resolve_backend(config.backend, ranks)


# --------------------------------------------------------------------------- presets and --ds-config


def preset_names() -> list[str]:
    return shared_config.preset_names(KIND)


def load_preset(name: str) -> dict:
    """experiments/deepspeed/<name>.json: a flat dict of DeepSpeedRunConfig fields."""
    return shared_config.load_preset(KIND, name, DeepSpeedRunConfig)


def load_ds_config(path: str) -> dict:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}; give a readable JSON file",
                        flag="--ds-config") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                        "fix the file", flag="--ds-config") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} must hold a JSON object (a DeepSpeed config), got {type(value).__name__}",
                        flag="--ds-config")
    return value


FLAG_OWNED_KEYS: dict[tuple[str, ...], tuple[str, str]] = {
    ("train_micro_batch_size_per_gpu",): ("batch", "--batch"),
    ("zero_optimization", "stage"): ("zero_stage", "--zero-stage"),
    ("optimizer", "params", "lr"): ("lr", "--lr"),
}
"""ds_config keys a flag also sets: the file's value is used unless the flag is given too, and a
flag given with a different value is a conflict."""
_FLAG_OF_FIELD = {field: flag for field, flag in FLAG_OWNED_KEYS.values()}


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


def resolve_config(preset: str, overrides: dict) -> DeepSpeedRunConfig:
    """Preset values, then --ds-config values for flag-owned keys, then every flag that is not None.

    Everything is validated here, before DeepSpeed is imported and before any folder exists."""
    values = {**load_preset(preset), "preset": preset}
    explicit = {k: v for k, v in overrides.items() if v is not None}
    if under_torchrun():
        values["world_size"] = int(os.environ["WORLD_SIZE"])
        explicit.pop("world_size", None)
    ds_path = explicit.get("ds_config_path", values.get("ds_config_path"))
    from_file: dict[str, str] = {}
    if ds_path:
        user = load_ds_config(ds_path)
        values["ds_config_file"] = user
        for path, (field, flag) in FLAG_OWNED_KEYS.items():
            _require_objects_along(user, path, ds_path)  # the value's own type is checked by the config
            value = _get(user, path)
            if value is None:
                continue
            if field in explicit and explicit[field] != value:
                raise UserError(f"{ds_path} sets {'.'.join(path)}={value!r} but {flag} {explicit[field]!r} "
                                f"was given; drop one of them", flag="--ds-config")
            values[field] = value
            from_file[field] = ".".join(path)
    values.update(explicit)
    try:
        config = DeepSpeedRunConfig(**values)
    except UserError as exc:
        # A bad value that came from the file is the file's fault: name the file's key, not the flag.
        key = next((key for field, key in from_file.items() if _FLAG_OF_FIELD[field] == exc.flag), None)
        if key is None:
            raise
        raise UserError(f"{key} in {ds_path}: {str(exc).split(': ', 1)[1]}", flag="--ds-config") from None
    build_ds_config(config)  # validates the merged DeepSpeed config too
    return config


def build_ds_config(config: DeepSpeedRunConfig) -> dict:
    """The DeepSpeed config: moebench's defaults <- the --ds-config file <- the flags."""
    optimizer = {"type": "Adam", "params": {"lr": config.lr, "weight_decay": 0.0, "adam_w_mode": False}}
    if not config.compiled_ops:
        optimizer["params"]["torch_adam"] = True  # torch.optim.Adam instead of JIT-built FusedAdam
    base = {
        "train_micro_batch_size_per_gpu": config.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": optimizer,
        "zero_optimization": {"stage": config.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": _NEVER_PRINT,
        "wall_clock_breakdown": False,
    }
    user = copy.deepcopy(config.ds_config_file)
    user_optimizer = user.get("optimizer")
    if isinstance(user_optimizer, dict) and str(user_optimizer.get("type", "Adam")).lower() not in ("adam", "adamw"):
        base.pop("optimizer")  # another optimizer: Adam's parameters do not apply to it
    merged = _deep_merge(base, user)
    _set(merged, ("train_micro_batch_size_per_gpu",), config.batch)
    _set(merged, ("zero_optimization", "stage"), config.zero_stage)
    _set(merged, ("optimizer", "params", "lr"), config.lr)
    merged.setdefault("optimizer", {}).setdefault("type", "Adam")
    _check_ds_config(merged, config)
    _check_half_precision(merged)
    merged["train_batch_size"] = config.batch * config.world_size
    return merged


def _check_ds_config(ds: dict, config: DeepSpeedRunConfig) -> None:
    gas = ds.get("gradient_accumulation_steps", 1)
    if gas != 1:
        raise UserError(f"gradient_accumulation_steps={gas!r} is not supported (one optimizer step per "
                        "batch); remove it and size the step with --batch", flag="--ds-config")
    tbs = ds.get("train_batch_size")
    if tbs is not None and tbs != config.batch * config.world_size:
        raise UserError(f"train_batch_size={tbs!r} conflicts with --batch {config.batch} x "
                        f"{config.world_size} rank(s) = {config.batch * config.world_size}; "
                        "remove it (moebench sets it)", flag="--ds-config")
    if not config.compiled_ops:
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


# --------------------------------------------------------------------------- DeepSpeed comm, no JIT


@contextlib.contextmanager
def deepspeed_comm(ctx: RankContext, *, compiled_ops: bool, timeout_s: float, backend: str | None = None):
    """DeepSpeed's comm layer on this rank's process group, without building the shm op.

    In-process (world size 1, ctx.backend == "none") there is no process group: open a one-rank
    group (`backend`, default nccl on a CUDA accelerator else gloo) on a private FileStore (no port
    at all) and destroy it afterwards. Yields the seconds `deepspeed.init_distributed` took."""
    import deepspeed
    import deepspeed.comm
    import deepspeed.ops
    import torch.distributed as dist

    compatible = deepspeed.ops.__compatible_ops__  # DeepSpeed's own probe (fast; no compile)
    shm_before = compatible.get(SHM_COMM_OP)
    if not compiled_ops:
        compatible[SHM_COMM_OP] = False
    own_group = not dist.is_initialized()
    saved_env = {k: os.environ.get(k) for k in ("LOCAL_RANK",)}
    store_dir = None
    try:
        if own_group:
            from deepspeed.accelerator import get_accelerator

            store_dir = tempfile.mkdtemp(prefix="moebench-ds-store-")
            backend = backend or ("nccl" if get_accelerator().device_name() == "cuda" else "gloo")
            timeout = datetime.timedelta(seconds=max(1.0, timeout_s * PG_TIMEOUT_FRACTION))
            dist.init_process_group(backend, store=dist.FileStore(os.path.join(store_dir, "store"), 1),
                                    rank=0, world_size=1, timeout=timeout)
        os.environ.setdefault("LOCAL_RANK", str(ctx.local_rank))  # deepspeed.initialize asserts it
        start = time.perf_counter()
        deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
        yield time.perf_counter() - start
    finally:
        if own_group and dist.is_initialized():
            deepspeed.comm.destroy_process_group()  # also drops DeepSpeed's group references
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if shm_before is not None:
            compatible[SHM_COMM_OP] = shm_before
        if store_dir:
            shutil.rmtree(store_dir, ignore_errors=True)


# --------------------------------------------------------------------------- model and data


def build_model(config: DeepSpeedRunConfig, *, ep_rank: int = 0):
    from moebench.models.deepspeed_moe import DeepSpeedMoEMLP, MoELayerSpec
    from moebench.models.transformer import build_transformer

    def make_mlp(layer: int):
        spec = MoELayerSpec(
            d_model=config.d_model, d_hidden=config.d_hidden, experts=config.experts_per_layer[layer],
            ep_size=config.ep_size, top_k=config.top_k, capacity_factor=config.capacity_factor,
            eval_capacity_factor=config.eval_capacity_factor, min_capacity=config.min_capacity,
            noisy_gate_policy=config.noisy_gate_policy, use_residual=config.use_residual,
            drop_tokens=config.drop_tokens, use_rts=config.use_rts, layer_index=layer, seed=config.seed)
        return DeepSpeedMoEMLP(spec, ep_rank=ep_rank)

    torch.manual_seed(config.seed)  # same non-expert weights on every rank and every ep_size
    return build_transformer(layers=config.layers, d_model=config.d_model, heads=config.heads,
                             make_mlp=make_mlp)


def random_dataset(config: DeepSpeedRunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """`samples` standard-normal (input, target) sequences [samples, seq, d_model], from the seed."""
    gen = torch.Generator().manual_seed(shared_config.derived_seed(config.seed + DATA_SEED_OFFSET))
    shape = (config.samples, config.seq, config.d_model)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def held_out_batch(config: DeepSpeedRunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The (batch, seq, d_model) test batch and its target - (32, 8, 512) with the chapter's sizes."""
    gen = torch.Generator().manual_seed(shared_config.derived_seed(config.seed + TEST_SEED_OFFSET))
    shape = (config.batch, config.seq, config.d_model)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def epoch_order(config: DeepSpeedRunConfig, epoch: int) -> torch.Tensor:
    """The sample order of one epoch (same on every rank; rank r takes its slice of each step)."""
    seed = shared_config.derived_seed(config.seed * 7919 + epoch)
    return torch.randperm(config.samples, generator=torch.Generator().manual_seed(seed))


class RoutingTotals:
    """Per-layer sums of the gate's decisions over many forwards (this rank's tokens)."""

    def __init__(self, experts_per_layer: tuple[int, ...]) -> None:
        self.exp_counts = [torch.zeros(e, dtype=torch.int64) for e in experts_per_layer]
        self.kept = [torch.zeros(e, dtype=torch.int64) for e in experts_per_layer]
        self.routes = torch.zeros(len(experts_per_layer), dtype=torch.int64)
        self.dropped = torch.zeros(len(experts_per_layer), dtype=torch.int64)
        self.tokens = torch.zeros(len(experts_per_layer), dtype=torch.int64)
        self.dropped_tokens = torch.zeros(len(experts_per_layer), dtype=torch.int64)
        self.capacity: list[set[int]] = [set() for _ in experts_per_layer]

    def add(self, layers) -> None:
        for i, layer in enumerate(layers):
            rec = layer.last
            self.exp_counts[i] += rec.exp_counts
            self.kept[i] += rec.kept_per_expert
            self.routes[i] += rec.routes
            self.dropped[i] += rec.dropped
            self.tokens[i] += rec.tokens
            self.dropped_tokens[i] += rec.dropped_tokens
            self.capacity[i].add(rec.capacity)

    def summary(self, world_size: int) -> dict:
        """Summed over ranks (a collective when world_size > 1: every rank must call it)."""
        counters = (*self.exp_counts, *self.kept, self.routes, self.dropped, self.tokens, self.dropped_tokens)
        flat = torch.cat(counters)
        if world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(flat)
        parts = list(torch.split(flat, [t.numel() for t in counters]))
        n = len(self.exp_counts)
        exp_counts, kept = parts[:n], parts[n:2 * n]
        routes, dropped, tokens, dropped_tokens = parts[2 * n:]
        per_layer = []
        for i in range(n):
            caps = sorted(self.capacity[i])
            per_layer.append({
                "layer": i, "experts": int(exp_counts[i].numel()),
                "capacity_per_expert": caps[0] if len(caps) == 1 else {"min": caps[0], "max": caps[-1]},
                "exp_counts": exp_counts[i].tolist(), "tokens_kept_per_expert": kept[i].tolist(),
                **_drop_fractions(routes[i], dropped[i], tokens[i], dropped_tokens[i]),
            })
        return {**_drop_fractions(routes.sum(), dropped.sum(), tokens.sum(), dropped_tokens.sum()),
                "per_layer": per_layer}


def _drop_fractions(routes, dropped, tokens, dropped_tokens) -> dict:
    """Routes evicted at capacity, and tokens that lost ALL k of their routes (the same for k=1)."""
    routes, dropped, tokens, dropped_tokens = int(routes), int(dropped), int(tokens), int(dropped_tokens)
    return {"routes": routes, "dropped": dropped, "dropped_route_frac": dropped / routes if routes else 0.0,
            "tokens": tokens, "dropped_tokens": dropped_tokens,
            "dropped_token_frac": dropped_tokens / tokens if tokens else 0.0}


# --------------------------------------------------------------------------- the rank function


@contextlib.contextmanager
def _stdout_to_stderr():
    """DeepSpeed prints and logs to stdout; keep stdout for moebench's own output (--json).
    The progress bar, drawn inside, goes to stderr as well."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def deepspeed_rank(ctx: RankContext, run_path, config_dict: dict, show_progress: bool = True) -> dict:
    """Train on this rank through DeepSpeed's engine; rank 0 writes params.json and metrics.jsonl."""
    import torch.nn.functional as F

    timings: dict[str, float] = {}
    start = time.perf_counter()
    with _stdout_to_stderr():
        import deepspeed
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from moebench import published, report
    from moebench.models.deepspeed_moe import moe_layers
    from moebench.models.transformer import count_params

    timings["import_deepspeed_s"] = time.perf_counter() - start
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO lines would bury the progress bar
    config = DeepSpeedRunConfig(**config_dict)
    ds_config = build_ds_config(config)
    writer = results.RunDir(Path(run_path)) if (ctx.is_main and run_path) else None

    with _stdout_to_stderr(), deepspeed_comm(ctx, compiled_ops=config.compiled_ops, timeout_s=config.timeout_s,
                                               backend=comm_backend(config)) as init_s:
        import torch.distributed as dist

        timings["init_distributed_s"] = init_s
        rank, world = dist.get_rank(), dist.get_world_size()
        used_backend = dist.get_backend()  # what really ran (recorded beside the predicted one)
        model = build_model(config, ep_rank=rank % config.ep_size)
        params = count_params(model, ep_size=config.ep_size)
        if writer:
            writer.write_json("params.json", params)
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "parameters"})
        t0 = time.perf_counter()
        engine, _optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config)
        timings["deepspeed_initialize_s"] = time.perf_counter() - t0
        shared_config.seed_rank_randomness(config.seed, rank)  # gate noise / RTS: distinct per rank
        device = engine.device
        layers = moe_layers(model)
        inputs, targets = random_dataset(config)
        totals = RoutingTotals(config.experts_per_layer)
        total_losses: list[float] = []
        orders: dict[int, torch.Tensor] = {}

        def step_fn(epoch: int, step: int) -> dict:
            if epoch not in orders:
                orders.clear()
                orders[epoch] = epoch_order(config, epoch)
            first = (step * world + rank) * config.batch
            idx = orders[epoch][first:first + config.batch]
            x, y = inputs[idx].to(device), targets[idx].to(device)
            engine.train()
            out, aux = engine(x)
            mse = F.mse_loss(out, y)
            engine.backward(mse + config.aux_loss_coef * aux)
            engine.step()
            totals.add(layers)
            counts = [sum(getattr(layer.last, name) for layer in layers)
                      for name in ("routes", "dropped", "tokens", "dropped_tokens")]
            # One small collective per step: the loss of the global batch, not of rank 0's share.
            stats = torch.tensor([mse.item(), aux.item(), *counts], dtype=torch.float64)
            if world > 1:
                dist.all_reduce(stats)
            mse_avg, aux_avg = stats[0].item() / world, stats[1].item() / world
            total_losses.append(mse_avg + config.aux_loss_coef * aux_avg)
            drops = _drop_fractions(*stats[2:].tolist())
            return {"backend": KIND, "loss": mse_avg, "aux_loss": aux_avg, "total_loss": total_losses[-1],
                    "dropped_route_frac": drops["dropped_route_frac"],
                    "dropped_token_frac": drops["dropped_token_frac"]}

        spec = LoopSpec(epochs=config.epochs, steps_per_epoch=config.steps_per_epoch,
                        tokens_per_step=config.batch * config.seq * world, label="deepspeed-moe")
        history = train_loop(step_fn, spec, writer=writer, show_progress=show_progress)
        routing = totals.summary(world)

        engine.eval()
        x_test, y_test = held_out_batch(config)
        eval_totals = RoutingTotals(config.experts_per_layer)
        t0 = time.perf_counter()
        with torch.no_grad():
            out, _aux = engine(x_test.to(device))
            eval_totals.add(layers)
            test_loss = torch.tensor([F.mse_loss(out, y_test.to(device)).item()], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(test_loss)
        eval_routing = eval_totals.summary(world)
        timings["test_s"] = time.perf_counter() - t0
        timings["train_s"] = history["train_time_s"]
        output_shape = list(out.shape)
        if writer:
            writer.close()
        del engine

    per_epoch = config.steps_per_epoch
    summary = {
        "world_size": world, "comm_backend": used_backend, "ep_size": config.ep_size, "device": str(device),
        "experts_per_layer": list(config.experts_per_layer), "steps_per_epoch": per_epoch,
        "params": {"total": params["total"], **params["by_category"]},
        "epoch_loss": history["epoch_avg_loss"],
        "epoch_total_loss": [sum(total_losses[e * per_epoch:(e + 1) * per_epoch]) / per_epoch
                             for e in range(config.epochs)],
        "loss": loss_summary(history), "steps": history["steps"], "tokens_per_s": history["tokens_per_s"],
        "routing": routing,
        "test": {"input_shape": list(x_test.shape), "output_shape": output_shape,
                 "loss": test_loss.item() / world, "routing": eval_routing},
        "timings": {**timings, "rank_total_s": time.perf_counter() - start},
        "ds_config": ds_config,
    }
    summary["chapter_comparison"] = report.compare(summary, published.DEEPSPEED)
    return summary


def run(config: DeepSpeedRunConfig, *, results_root=None, show_progress: bool = True) -> RunOutcome:
    """Train one configuration and record it under results/deepspeed/<run-id>/."""
    record = {**dataclasses.asdict(config), "comm_backend": comm_backend(config), "ds_config": build_ds_config(config)}
    return execute_run(kind=KIND, name=config.preset, config=record, world_size=config.world_size,
                       rank_fn=deepspeed_rank, rank_args=(dataclasses.asdict(config), show_progress),
                       backend=config.backend, timeout_s=config.timeout_s, results_root=results_root,
                       label="deepspeed (deepspeed.moe.layer.MoE)")

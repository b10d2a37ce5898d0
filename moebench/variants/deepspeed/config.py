"""The DeepSpeed variant's config: DeepSpeed's MoE layer and engine inside the shared tree."""

from __future__ import annotations

import dataclasses
import math

from moebench import bounds
from moebench.bounds import Items, Number
from moebench.config import (
    MAX_EXPERTS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_TOP_K,
    MAX_WORLD_SIZE,
    LaunchConfig,
    ModelConfig,
    TrainConfig,
    bounded,
    flag,
    positive,
    require_choice,
    require_positive,
    require_positive_ints,
)
from moebench.errors import UserError

NOISY_GATE_POLICIES = ("none", "Jitter", "RSample")
"""--noisy-gate-policy values (any case); "none" is passed to DeepSpeed as None."""
SUPPORTED_ZERO_STAGES = (0, 1, 2)
"""DeepSpeed's native MoE does not support ZeRO stage 3."""
HANG_DEADLINE_FLOOR_S = 1800.0
"""Smallest default --timeout: the chapter preset takes 1.5 min idle, 8.5 min on 2 busy cores."""
DEADLINE_S_PER_WEIGHT_STEP = 3e-7
"""Default --timeout grows by this per (weight x step): 4x the slowest rate measured (2.5 s per
step of the chapter's ~36 M weights on 2 busy cores), so only longer runs get longer deadlines."""
MAX_CAPACITY_FACTOR = 1e4
"""A capacity factor beyond this only allocates: capacity is already every token at factor = experts."""
CAPACITY_BOUND = Number(integer=False, min=0, above=True, max=MAX_CAPACITY_FACTOR, why="no drop long before")
MAX_MIN_CAPACITY = 2**31 - 1
"""DeepSpeed's capacity is a C int."""


def parse_expert_counts(value) -> tuple[int, ...]:
    """8, "8", "4,8" or [4, 8] -> a tuple of counts (UserError naming --experts otherwise)."""
    if isinstance(value, str):
        try:
            value = [int(part) for part in value.split(",")]
        except ValueError:
            raise UserError(f"expected a count or a comma list of counts (e.g. 8 or 4,8), got {value!r}",
                            flag="--experts") from None
    counts = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if not counts or any(isinstance(e, bool) or not isinstance(e, int) or e < 1 for e in counts):
        raise UserError(f"expert counts must be positive integers, got {list(counts)}", flag="--experts")
    return counts


@dataclasses.dataclass(kw_only=True)
class DeepSpeedMoEConfig:
    """deepspeed.moe.layer.MoE: TopKGate with capacity, noisy gating, residual expert, expert parallel."""

    experts: tuple[int, ...] = dataclasses.field(metadata=flag(metavar="N[,N...]", bound=Items(
        item=positive(MAX_EXPERTS, "512x Switch's 2048"), max_items=MAX_LAYERS, example="4,8", unique=False)))
    """Experts per MoE layer, over all ranks; deepspeed variant: one count per layer for a pyramid (4,8)."""
    d_hidden: int = dataclasses.field(metadata=bounded(positive(MAX_HIDDEN, "4x the --d-model bound")))
    """Hidden width of each expert's MLP."""
    top_k: int = dataclasses.field(metadata=bounded(positive(MAX_TOP_K, "and at most --experts")))
    """Experts each token is sent to."""
    capacity_factor: float = dataclasses.field(metadata=bounded(CAPACITY_BOUND))
    """deepspeed variant: training capacity factor (each expert takes ceil(tokens/experts x factor x k))."""
    eval_capacity_factor: float = dataclasses.field(metadata=bounded(CAPACITY_BOUND))
    """deepspeed variant: capacity factor in eval mode (the test batch)."""
    min_capacity: int = dataclasses.field(metadata=bounded(Number(integer=True, min=0, max=MAX_MIN_CAPACITY,
                                                                  why="a C int; 0: no floor")))
    """deepspeed variant: lower bound on every expert's capacity."""
    noisy_gate_policy: str = dataclasses.field(metadata=flag(choices=NOISY_GATE_POLICIES))
    """deepspeed variant: none, Jitter (input noise) or RSample (Gumbel noise; top-k 1 only)."""
    use_residual: bool
    """deepspeed variant: residual MoE, a dense MLP beside the experts."""
    drop_tokens: bool
    """deepspeed variant: drop tokens beyond capacity."""
    use_rts: bool
    """deepspeed variant: Random Token Selection when dropping."""
    ep_size: int = dataclasses.field(metadata=bounded(positive(MAX_WORLD_SIZE, "at most --world-size")))
    """deepspeed variant: expert-parallel ranks; divides --world-size and every expert count."""

    def __post_init__(self) -> None:
        self.experts = parse_expert_counts(self.experts)
        require_positive_ints({"--d-hidden": self.d_hidden, "--top-k": self.top_k, "--ep-size": self.ep_size})
        require_positive({"--capacity-factor": self.capacity_factor,
                          "--eval-capacity-factor": self.eval_capacity_factor})
        if isinstance(self.min_capacity, bool) or not isinstance(self.min_capacity, int) or self.min_capacity < 0:
            raise UserError(f"must be an integer >= 0, got {self.min_capacity!r}", flag="--min-capacity")
        canonical = {p.lower(): p for p in NOISY_GATE_POLICIES}
        self.noisy_gate_policy = canonical.get(str(self.noisy_gate_policy).lower(), self.noisy_gate_policy)
        require_choice(self.noisy_gate_policy, NOISY_GATE_POLICIES, "--noisy-gate-policy")
        if self.noisy_gate_policy == "RSample" and self.top_k > 1:
            # An error, not a warning: DeepSpeed applies RSample only in top-1 gating and would
            # silently train without the noise the user asked for.
            raise UserError(f"RSample only applies with --top-k 1 (DeepSpeed silently ignores it for "
                            f"k={self.top_k}); use --noisy-gate-policy Jitter or none, or --top-k 1",
                            flag="--noisy-gate-policy")
        for name, value in {"--use-residual": self.use_residual, "--drop-tokens": self.drop_tokens,
                            "--use-rts": self.use_rts}.items():
            if not isinstance(value, bool):
                raise UserError(f"must be true or false, got {value!r}", flag=name)
        bounds.check_fields(self)


@dataclasses.dataclass(kw_only=True)
class EngineConfig:
    """deepspeed.initialize: ZeRO, a user's DeepSpeed JSON, and whether JIT-built ops may run."""

    zero_stage: int = dataclasses.field(metadata=bounded(Number(
        integer=True, min=0, max=3, refusal="unknown ZeRO stage {value} (DeepSpeed has stages 0-3); "
        "use --zero-stage 0, 1 or 2")))
    """deepspeed variant: ZeRO stage 0, 1 or 2 (DeepSpeed's MoE has no stage 3)."""
    ds_config: str | None = dataclasses.field(default=None, metadata=flag(
        metavar="FILE", bound=bounds.Path(folder=False, must_exist=True)))
    """deepspeed variant: a DeepSpeed JSON config merged under the flags."""
    compiled_ops: bool = False
    """deepspeed variant: allow DeepSpeed's JIT-built ops (shm comm, FusedAdam): minutes on first use."""

    def __post_init__(self) -> None:
        if isinstance(self.zero_stage, bool) or not isinstance(self.zero_stage, int):
            raise UserError(f"must be an integer ZeRO stage (0, 1 or 2), got {self.zero_stage!r}",
                            flag="--zero-stage")
        if self.zero_stage == 3:
            raise UserError("stage 3 is not supported: DeepSpeed's native MoE does not "
                            "support ZeRO stage 3; use --zero-stage 0, 1 or 2", flag="--zero-stage")
        if self.zero_stage not in SUPPORTED_ZERO_STAGES:
            raise UserError(f"unknown ZeRO stage {self.zero_stage} (DeepSpeed has stages 0-3); "
                            "use --zero-stage 0, 1 or 2", flag="--zero-stage")
        if self.ds_config is not None and not str(self.ds_config).strip():
            raise UserError("is empty; give a DeepSpeed JSON file or leave the flag out", flag="--ds-config")
        bounds.check_fields(self)


@dataclasses.dataclass(kw_only=True)
class DeepSpeedRunConfig:
    """`moebench run deepspeed`: the chapter's DeepSpeed-MoE Transformer trained by DeepSpeed's engine."""

    preset: str
    """Preset the values started from (experiments/deepspeed/<preset>.json)."""
    model: ModelConfig
    moe: DeepSpeedMoEConfig
    engine: EngineConfig
    train: TrainConfig
    launch: LaunchConfig

    def __post_init__(self) -> None:
        moe, n = self.moe, self.launch.world_size
        if len(moe.experts) not in (1, self.model.layers):
            raise UserError(f"gives {len(moe.experts)} expert counts for {self.model.layers} MoE layers; "
                            f"give one count, or one per layer (or set --layers {len(moe.experts)})",
                            flag="--experts")
        if n % moe.ep_size:
            raise UserError(f"ep_size {moe.ep_size} does not divide the world size {n}; "
                            "pick --ep-size dividing --world-size", flag="--ep-size")
        for layer, experts in enumerate(self.experts_per_layer):
            if experts % moe.ep_size:
                raise UserError(f"ep_size {moe.ep_size} does not divide layer {layer}'s {experts} experts; "
                                "pick --ep-size dividing every expert count", flag="--ep-size")
            if moe.top_k > experts:
                raise UserError(f"top-k {moe.top_k} exceeds layer {layer}'s {experts} experts; "
                                "lower --top-k", flag="--top-k")
        if self.train.batch_size % n:
            raise UserError(f"the global batch of {self.train.batch_size} cannot be split evenly over {n} "
                            "ranks; use --batch-size divisible by --world-size", flag="--batch-size")
        if self.tokens_per_rank < moe.min_capacity:
            raise UserError(f"each rank routes {self.batch_per_rank}x{self.train.seq_len}={self.tokens_per_rank} "
                            f"tokens per step, fewer than --min-capacity {moe.min_capacity}; lower "
                            "--min-capacity or raise --batch-size / --seq-len", flag="--min-capacity")

    @property
    def experts_per_layer(self) -> tuple[int, ...]:
        experts = self.moe.experts
        return experts * self.model.layers if len(experts) == 1 else experts

    @property
    def batch_per_rank(self) -> int:
        """DeepSpeed's train_micro_batch_size_per_gpu."""
        return self.train.batch_size // self.launch.world_size

    @property
    def tokens_per_rank(self) -> int:
        return self.batch_per_rank * self.train.seq_len

    @property
    def weights(self) -> int:
        """Approximate weight count (attention + experts + gates; biases and norms left out)."""
        d, h = self.model.d_model, self.moe.d_hidden
        return sum(4 * d * d + (e + self.moe.use_residual) * 2 * d * h + d * e for e in self.experts_per_layer)

    @property
    def expert_weights(self) -> int:
        """The experts' share of `weights` (split over ep_size ranks; the rest is on every rank)."""
        return sum(e * 2 * self.model.d_model * self.moe.d_hidden for e in self.experts_per_layer)

    @property
    def default_timeout_s(self) -> float:
        work = self.train.total_steps * self.weights * DEADLINE_S_PER_WEIGHT_STEP
        return max(HANG_DEADLINE_FLOOR_S, float(math.ceil(work)))

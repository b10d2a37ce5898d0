"""The fastmoe variant's config: its MoE layer (fastmoe's FMoETransformerMLP) inside the shared tree."""

from __future__ import annotations

import dataclasses
import math

from moebench import bounds
from moebench.config import (
    MAX_EXPERTS,
    MAX_HIDDEN,
    MAX_TOP_K,
    LaunchConfig,
    ModelConfig,
    TrainConfig,
    bounded,
    flag,
    positive,
    require_choice,
    require_positive_ints,
)
from moebench.errors import UserError

MOE_IMPLS = ("auto", "fmoe", "reference")
"""auto: the real fmoe where it can run (CUDA), else moebench's reference port."""
GATE_NAMES = ("naive", "gshard", "switch", "noisy")
"""fastmoe's gates (moebench.models.moe.gates.GATES holds the classes; a test keeps them equal)."""
FIXED_TOP_K = {"gshard": 2, "switch": 1}
"""Gates whose k is fixed by their algorithm."""
HANG_DEADLINE_FLOOR_S = 1800.0
"""Smallest default --timeout: the chapter preset (10 steps of 273 M weights) takes 1-2 min idle."""
DEADLINE_S_PER_WEIGHT_STEP = 6e-7
"""Default --timeout grows by this per (weight x step): ~20x the 3.3e-8 measured on 2 idle cores
(9 s per step of the chapter's 273 M weights, mostly Adam), room for a busy machine."""


@dataclasses.dataclass(kw_only=True)
class FastMoEConfig:
    """fastmoe's FMoETransformerMLP: experts split over the ranks, a gate picking top-k of them."""

    experts: int = dataclasses.field(metadata=bounded(positive(MAX_EXPERTS, "512x Switch's 2048")))
    """Experts per MoE layer, over all ranks."""
    d_hidden: int = dataclasses.field(metadata=bounded(positive(MAX_HIDDEN, "4x the --d-model bound")))
    """Hidden width of each expert's MLP."""
    top_k: int = dataclasses.field(metadata=bounded(positive(MAX_TOP_K, "and at most --experts")))
    """Experts each token is sent to."""
    gate: str = dataclasses.field(metadata=flag(choices=GATE_NAMES))
    """fastmoe variant: naive, gshard (top-k 2), switch (top-k 1) or noisy."""
    moe_impl: str = dataclasses.field(metadata=flag(choices=MOE_IMPLS))
    """fastmoe variant: auto (real fmoe where it runs, else the reference port), fmoe or reference."""

    def __post_init__(self) -> None:
        bounds.check_fields(self)  # first: the same message as the CLI's reading of the flag
        require_positive_ints({"--experts": self.experts, "--d-hidden": self.d_hidden, "--top-k": self.top_k})
        require_choice(self.gate, GATE_NAMES, "--gate")
        require_choice(self.moe_impl, MOE_IMPLS, "--moe-impl")
        if self.top_k > self.experts:
            raise UserError(f"top-k {self.top_k} is larger than the {self.experts} experts; "
                            "use --top-k <= --experts", flag="--top-k")
        fixed = FIXED_TOP_K.get(self.gate)
        if fixed is not None and self.top_k != fixed:
            raise UserError(f"the {self.gate} gate needs --top-k {fixed}, got {self.top_k}", flag="--top-k")


@dataclasses.dataclass(kw_only=True)
class FastMoERunConfig:
    """`moebench run fastmoe`: the chapter's fastmoe Transformer-MoE on random data."""

    preset: str
    """Name of the preset the values started from (experiments/fastmoe/<preset>.json)."""
    model: ModelConfig
    moe: FastMoEConfig
    train: TrainConfig
    launch: LaunchConfig

    def __post_init__(self) -> None:
        n = self.launch.world_size
        if self.moe.experts % n:
            raise UserError(f"{self.moe.experts} experts cannot be split evenly over {n} ranks; "
                            "use --experts divisible by --world-size", flag="--world-size")
        if self.train.batch_size % n:
            raise UserError(f"the global batch of {self.train.batch_size} cannot be split evenly over {n} "
                            "ranks; use --batch-size divisible by --world-size", flag="--batch-size")

    @property
    def num_local_experts(self) -> int:
        return self.moe.experts // self.launch.world_size

    @property
    def weights(self) -> int:
        """Approximate weight count (attention + experts + gate; biases and norms left out)."""
        d, h, e = self.model.d_model, self.moe.d_hidden, self.moe.experts
        return self.model.layers * (4 * d * d + e * 2 * d * h + d * e)

    @property
    def expert_weights(self) -> int:
        """The experts' share of `weights` (split over the ranks; the rest is on every rank)."""
        return self.model.layers * self.moe.experts * 2 * self.model.d_model * self.moe.d_hidden

    @property
    def default_timeout_s(self) -> float:
        """The hang deadline of a multi-rank run unless --timeout gives one."""
        work = self.train.total_steps * self.weights * DEADLINE_S_PER_WEIGHT_STEP
        return max(HANG_DEADLINE_FLOOR_S, float(math.ceil(work)))

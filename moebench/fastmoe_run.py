"""`moebench run fastmoe`: the chapter's fastmoe Transformer-MoE trained on random data.

Config (presets from experiments/fastmoe/<name>.json, flags on top) -> backend resolved ->
`execute_run` (results/fastmoe/<run-id>/) -> `fastmoe_rank` on 1 process or N expert-parallel
ranks: build the model, train on seeded random data with Adam and MSE, evaluate on a held-out
random batch, return the summary (params, loss, eval loss, throughput).

Expert parallelism: every rank builds the same one-process weights from the seed and keeps its
experts (global expert g on rank g // num_local_experts); the global batch is generated
identically everywhere and rank r trains on rows [r*B/N, (r+1)*B/N). With the naive gate, N ranks
then follow the one-process loss curve (see moebench/distributed/expert_parallel.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import torch

from moebench import config as shared_config
from moebench import results
from moebench.distributed.launch import (RankContext, local_world_size, resolve_backend as resolve_comm_backend,
                                         under_torchrun)
from moebench.errors import UserError
from moebench.models.moe import BACKENDS, GATES, build_moe_mlp, resolve_backend
from moebench.models.moe.gates import FIXED_TOP_K
from moebench.models.transformer import build_transformer, count_params
from moebench.train import LoopSpec, execute_run, loss_summary, train_loop

KIND = "fastmoe"
EVAL_SEED_OFFSET = 1_000_003
"""The held-out batch is drawn from seed + this, so it never overlaps the training batches."""
HANG_DEADLINE_FLOOR_S = 1800.0
"""Smallest default --timeout: the chapter preset (10 steps of 273 M weights) takes 1-2 min idle."""
DEADLINE_S_PER_WEIGHT_STEP = 6e-7
"""Default --timeout grows by this per (weight x step): ~20x the 3.3e-8 measured on 2 idle cores
(9 s per step of the chapter's 273 M weights, mostly Adam), room for a busy machine."""


@dataclasses.dataclass(kw_only=True)
class FastMoERunConfig:
    preset: str = "quick"
    """Name of the preset the values started from (experiments/fastmoe/<preset>.json)."""
    layers: int = 1
    """Transformer blocks, each with an MoE MLP."""
    heads: int = 16
    """Attention heads (d_model must be divisible by it)."""
    d_model: int = 1024
    """Model width."""
    d_hidden: int = 4096
    """Hidden width of each expert's MLP."""
    experts: int = 32
    """Experts per MoE layer, over all ranks."""
    top_k: int = 2
    """Experts each token is sent to."""
    gate: str = "naive"
    """naive | gshard (k=2) | switch (k=1) | noisy."""
    aux_loss_coef: float = 0.0
    """Weight of the gates' auxiliary (balance) loss in the training loss."""
    backend: str = "auto"
    """auto | fmoe | reference (auto: the real fmoe where usable, else the reference port)."""
    steps: int = 100
    """Optimiser steps."""
    batch_size: int = 32
    """Sequences per step over all ranks (the global batch)."""
    seq_len: int = 8
    """Tokens per sequence."""
    train_batches: int = 1
    """Distinct random training batches, cycled (= steps: a fresh batch every step; 1: one batch
    memorised, the loss then falls below the 1.0 a predictor of independent targets can reach)."""
    lr: float = 1e-3
    """Adam learning rate."""
    seed: int = 0
    """Seeds the weights and the data."""
    device: str = "cpu"
    """cpu | cuda | auto."""
    world_size: int = 1
    """Expert-parallel ranks (experts are split across them)."""

    def __post_init__(self) -> None:
        positive = {"--layers": self.layers, "--heads": self.heads, "--d-model": self.d_model,
                    "--d-hidden": self.d_hidden, "--experts": self.experts, "--top-k": self.top_k,
                    "--steps": self.steps, "--batch-size": self.batch_size, "--seq-len": self.seq_len,
                    "--train-batches": self.train_batches, "--world-size": self.world_size}
        shared_config.require_positive_ints(positive)
        shared_config.require_finite({"--lr": self.lr, "--aux-loss-coef": self.aux_loss_coef})
        shared_config.require_seed(self.seed)
        if not self.lr > 0:
            raise UserError(f"must be positive, got {self.lr}", flag="--lr")
        if self.aux_loss_coef < 0:
            raise UserError(f"must be >= 0, got {self.aux_loss_coef}", flag="--aux-loss-coef")
        if self.d_model % self.heads:
            raise UserError(f"d_model {self.d_model} is not divisible by {self.heads} heads; "
                            "pick --heads that divides --d-model", flag="--heads")
        if self.gate not in GATES:
            raise UserError(f"unknown gate {self.gate!r}; use one of {', '.join(GATES)}", flag="--gate")
        if self.top_k > self.experts:
            raise UserError(f"top-k {self.top_k} is larger than the {self.experts} experts; "
                            "use --top-k <= --experts", flag="--top-k")
        fixed = FIXED_TOP_K.get(self.gate)
        if fixed is not None and self.top_k != fixed:
            raise UserError(f"the {self.gate} gate needs --top-k {fixed}, got {self.top_k}", flag="--top-k")
        if self.experts % self.world_size:
            raise UserError(f"{self.experts} experts cannot be split evenly over {self.world_size} ranks; "
                            "use --experts divisible by --world-size", flag="--world-size")
        if self.batch_size % self.world_size:
            raise UserError(f"the global batch of {self.batch_size} cannot be split evenly over "
                            f"{self.world_size} ranks; use --batch-size divisible by --world-size",
                            flag="--batch-size")
        if self.backend not in BACKENDS:
            raise UserError(f"unknown backend {self.backend!r}; use one of {', '.join(BACKENDS)}", flag="--backend")
        if self.device not in ("cpu", "cuda", "auto"):
            raise UserError(f"unknown device {self.device!r}; use cpu, cuda or auto", flag="--device")
        if self.device == "cuda":
            # An error, not a fallback: with fewer GPUs than ranks (or no NCCL) the launcher would
            # quietly train every rank on CPU over gloo.
            ranks = local_world_size(self.world_size)
            shared_config.require_gpus(ranks, flag="--device", why=f"--device cuda on {ranks} local rank(s)",
                                       need_nccl=self.world_size > 1,
                                       fix="use --device cpu, or auto (CUDA only where it fits)")

    @property
    def num_local_experts(self) -> int:
        return self.experts // self.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def weights(self) -> int:
        """Approximate weight count (attention + experts + gate; biases and norms left out)."""
        d, h, e = self.d_model, self.d_hidden, self.experts
        return self.layers * (4 * d * d + e * 2 * d * h + d * e)

    @property
    def default_timeout_s(self) -> float:
        """The hang deadline of a multi-rank run unless --timeout gives one."""
        return max(HANG_DEADLINE_FLOOR_S, float(math.ceil(self.steps * self.weights * DEADLINE_S_PER_WEIGHT_STEP)))


def comm_backend(config: FastMoERunConfig) -> str:
    """The torch.distributed backend of the ranks: "none" for one in-process rank, else gloo for
    --device cpu and, for cuda, what `launch` resolves "auto" to with the local world size."""
    if config.world_size == 1 and not under_torchrun():
        return "none"
    return resolve_comm_backend("gloo" if config.device == "cpu" else "auto",
                                local_world_size(config.world_size))


def preset_names() -> list[str]:
    return shared_config.preset_names(KIND)


def load_preset(name: str) -> dict:
    return shared_config.load_preset(KIND, name, FastMoERunConfig)


def resolve_config(preset: str, overrides: dict) -> FastMoERunConfig:
    """Preset values, then every override that is not None; backend and device resolved."""
    values = {**load_preset(preset), "preset": preset}
    values.update({k: v for k, v in overrides.items() if v is not None})
    if under_torchrun():
        values["world_size"] = int(os.environ["WORLD_SIZE"])
    config = FastMoERunConfig(**values)
    if config.device == "auto":
        fits = shared_config.gpu_shortfall(local_world_size(config.world_size),
                                           need_nccl=config.world_size > 1) is None
        config = dataclasses.replace(config, device="cuda" if fits else "cpu")
    backend = resolve_backend(config.backend, device=config.device, world_size=config.world_size)
    return dataclasses.replace(config, backend=backend)


# --------------------------------------------------------------------------- model and data


def build_model(config: FastMoERunConfig, *, world_size: int = 1, group=None, device: str = "cpu"):
    """The Transformer-MoE holding `experts // world_size` experts per layer."""
    def make_mlp(_layer: int):
        return build_moe_mlp(backend=config.backend, experts=config.experts, d_model=config.d_model,
                             d_hidden=config.d_hidden, top_k=config.top_k, gate=config.gate,
                             world_size=world_size, group=group, device=device)

    return build_transformer(layers=config.layers, d_model=config.d_model, heads=config.heads,
                             make_mlp=make_mlp).to(device)


def build_rank_model(config: FastMoERunConfig, ctx: RankContext, device: str):
    """Seeded one-process weights; on N ranks each keeps its experts (same weights as one process)."""
    from moebench.distributed import expert_parallel

    torch.manual_seed(config.seed)
    full = build_model(config, device=device)
    if ctx.world_size == 1:
        return full
    with torch.device("meta"):
        local = build_model(config, world_size=ctx.world_size, device="meta")
    local = local.to_empty(device=device)
    for block in local.layers:  # to_empty made new Parameters: restore the expert-parallel marks
        mark = getattr(block.mlp, "mark_parallel_comm", None)
        if mark is not None:
            mark()
    shard = expert_parallel.shard_state_dict(full.state_dict(), ctx.rank, config.num_local_experts)
    local.load_state_dict(shard)
    return local


def random_batches(config: FastMoERunConfig, *, count: int, seed: int, device: str) -> list[tuple]:
    """`count` global (input, target) pairs, standard normal [batch, seq, d_model], from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    shape = (config.batch_size, config.seq_len, config.d_model)
    return [(torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(device))
            for _ in range(count)]


# --------------------------------------------------------------------------- the rank function


def fastmoe_rank(ctx: RankContext, run_path, config_dict: dict, show_progress: bool = True) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    from moebench.distributed import expert_parallel

    config = FastMoERunConfig(**config_dict)
    device = ctx.device if ctx.world_size > 1 else config.device
    model = build_rank_model(config, ctx, device)
    # Every rank built the same weights from the seed; what it draws while training (gate noise,
    # GShard's random routing) must differ per rank, as it does in fastmoe.
    shared_config.seed_rank_randomness(config.seed, ctx.rank)
    writer = results.RunDir(Path(run_path)) if (ctx.is_main and run_path) else None
    params = params_table(model, ep_size=ctx.world_size)
    if writer:
        writer.write_json("params.json", {"backend": config.backend, **params})

    rows = slice(ctx.rank * config.batch_size // ctx.world_size,
                 (ctx.rank + 1) * config.batch_size // ctx.world_size)
    train = random_batches(config, count=config.train_batches, seed=config.seed, device=device)
    held_out = random_batches(config, count=1, seed=shared_config.derived_seed(config.seed + EVAL_SEED_OFFSET),
                              device=device)[0]
    inputs, targets = [x for x, _ in train], [y for _, y in train]
    data_range = {"input_min": min(t.min().item() for t in inputs), "input_max": max(t.max().item() for t in inputs),
                  "target_min": min(t.min().item() for t in targets), "target_max": max(t.max().item() for t in targets)}
    moe_layers = [block.mlp for block in model.layers]
    # The fused kernel is several times faster on the chapter model's 273 M parameters (CPU and CUDA).
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, fused=True)

    def global_mean(value: torch.Tensor) -> float:
        """The mean over the global batch of a per-rank mean (equal slices)."""
        if ctx.world_size > 1:
            value = value.detach().clone()
            dist.all_reduce(value)
            value /= ctx.world_size
        return value.item()

    def step_fn(epoch: int, step: int) -> dict:
        x, y = train[step % config.train_batches]
        model.train()
        optimizer.zero_grad(set_to_none=True)
        out, aux = model(x[rows])
        mse = F.mse_loss(out, y[rows])
        (mse + config.aux_loss_coef * aux).backward()
        if ctx.world_size > 1:
            expert_parallel.sync_gradients(model)
        optimizer.step()
        return {"backend": config.backend, "loss": global_mean(mse), "aux_loss": global_mean(aux.detach()),
                "tokens_per_expert": [routed_tokens(m, ctx.world_size) for m in moe_layers]}

    spec = LoopSpec(epochs=1, steps_per_epoch=config.steps, tokens_per_step=config.tokens_per_step,
                    label=f"fastmoe ({config.backend})")
    history = train_loop(step_fn, spec, writer=writer, show_progress=show_progress)
    model.eval()
    with torch.no_grad():
        out, _ = model(held_out[0][rows])
        eval_loss = global_mean(F.mse_loss(out, held_out[1][rows]))
    if writer:
        writer.close()
    return {
        "backend": config.backend, "world_size": ctx.world_size, "comm_backend": ctx.backend, "device": device,
        "params": params["totals"], "loss": loss_summary(history), "eval_loss": eval_loss,
        "steps": history["steps"], "train_time_s": history["train_time_s"],
        "tokens_per_s": history["tokens_per_s"], "tokens_per_step": config.tokens_per_step,
        "data": data_range, "losses": history["losses"],
    }


def routed_tokens(moe_layer, world_size: int) -> list[int] | None:
    """Slots routed to each global expert in the last forward, summed over ranks."""
    counts = getattr(moe_layer, "tokens_per_expert", None)
    if counts is None:
        return None
    if world_size > 1:
        import torch.distributed as dist

        counts = counts.clone()
        dist.all_reduce(counts)
    return counts.tolist()


def params_table(model, *, ep_size: int) -> dict:
    """count_params flattened: totals by category (total, moe, experts, gate, attention, norm, other)."""
    counted = count_params(model, ep_size=ep_size)
    cats = counted["by_category"]
    totals = {"total": counted["total"], "moe": cats.get("moe", 0), "experts": cats.get("experts", 0),
              "gate": cats.get("gate", 0), "attention": cats.get("attention", 0),
              "norm": cats.get("norm", 0), "other": cats.get("other", 0)}
    return {"totals": totals, "per_layer": counted["per_layer"], "ep_size": ep_size}


def run(config: FastMoERunConfig, *, results_root=None, timeout_s: float | None = None,
        show_progress: bool = True):
    """Train one configuration and record it; returns train.RunOutcome.

    `timeout_s` is the hang deadline of a multi-rank run (None: config.default_timeout_s)."""
    timeout_s = config.default_timeout_s if timeout_s is None else timeout_s
    comm = comm_backend(config)
    record = {**dataclasses.asdict(config), "comm_backend": comm, "timeout_s": timeout_s}
    return execute_run(kind=KIND, name=config.preset, config=record,
                       world_size=config.world_size, rank_fn=fastmoe_rank,
                       rank_args=(dataclasses.asdict(config), show_progress),
                       backend="auto" if comm == "none" else comm, timeout_s=timeout_s,
                       results_root=results_root, label=f"fastmoe ({config.backend} backend)")

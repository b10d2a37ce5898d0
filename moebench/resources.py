"""Will a run fit, and can it end? Estimates of its memory and its work, checked before anything is created.

The memory estimate is deliberately simple and a little generous: fp32 weights with their gradient
and Adam's two moments (16 bytes a weight), activations kept for the backward pass, the random
training set (every rank holds all of it), and the interpreter with torch loaded, for every rank
on this machine. A configuration over the available memory is bad input (exit 2) naming the flag
that dominates (the one the user gave, when one of the contributing flags was given); `--force`
runs it anyway.

The work estimate is a lower bound on the time a run takes: its FLOPs (6 per active weight and
token, Adam's update per weight) at a rate no machine of its kind beats, plus a fixed cost per
step. A run whose lower bound is over MAX_WORK_S (a week: the longest --timeout) cannot finish
inside any deadline moebench sets, and is refused the same way (`--force` runs it anyway).
"""

from __future__ import annotations

from moebench.bounds import WEEK_S
from moebench.errors import UserError
from moebench.rankenv import local_world_size

BYTES_PER_WEIGHT = 16
"""fp32 weight + gradient + Adam's exp_avg and exp_avg_sq."""
ACTIVATION_FLOATS_PER_TOKEN_PER_D_MODEL = 12
"""Per token and layer, ~12 d_model-wide tensors live until backward (norms, attention q/k/v/out,
residuals, MoE gather/scatter); measured peaks on the quick presets stay below this."""
ACTIVATION_FLOATS_PER_TOKEN_PER_D_HIDDEN = 3
"""Per routed slot, the expert's hidden activation, its activation output and its gradient."""
PROCESS_BYTES = 400 * 1024**2
"""A Python process with torch (and DeepSpeed) imported: ~300-400 MB resident, measured here."""


def estimate(config) -> dict:
    """Bytes a run of `config` (either variant) needs on this machine, by part."""
    world = config.launch.world_size
    local = local_world_size(world)
    model, train = config.model, config.train
    replicated = config.weights - config.expert_weights
    per_rank_weights = replicated + config.expert_weights / world
    tokens_per_rank = train.tokens_per_step / world
    top_k = config.moe.top_k
    activations = 4 * tokens_per_rank * model.layers * (
        ACTIVATION_FLOATS_PER_TOKEN_PER_D_MODEL * model.d_model
        + ACTIVATION_FLOATS_PER_TOKEN_PER_D_HIDDEN * top_k * config.moe.d_hidden)
    parts = {
        "parameters": local * per_rank_weights * BYTES_PER_WEIGHT,
        "activations": local * activations,
        "data": local * 2 * 4 * train.samples * train.seq_len * model.d_model,
        "processes": local * PROCESS_BYTES,
    }
    return {**{k: int(v) for k, v in parts.items()}, "total": int(sum(parts.values())), "local_ranks": local}


def available_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


CONTRIBUTING_FLAGS = {
    "parameters": ("--experts", "--d-model", "--d-hidden", "--layers"),
    "activations": ("--batch-size", "--seq-len", "--d-model", "--d-hidden", "--layers", "--top-k"),
    "data": ("--samples", "--seq-len", "--d-model"),
    "work": ("--steps", "--epochs", "--samples", "--batch-size", "--seq-len", "--experts", "--d-model",
             "--d-hidden", "--layers", "--top-k", "--tokens", "--repeats", "--warmup"),
}
"""The flags that make up each part of an estimate, most direct first: a refusal names the first
one the user gave (the flag that caused it), else the estimate's own choice."""


def blamed(part: str, given: frozenset[str] | set[str], default: str) -> str:
    """The flag a refusal names: the first contributor to `part` that the user gave, else `default`."""
    return next((f for f in CONTRIBUTING_FLAGS[part] if f in given), default)


def require_fits(config, *, force: bool = False, available: int | None = None, given: set[str] = frozenset()) -> dict:
    """UserError (naming the dominant flag) when the estimate exceeds the available memory."""
    need = estimate(config)
    have = available_bytes() if available is None else available
    if need["total"] <= have or force:
        return need
    dominant = max(("parameters", "activations", "data"), key=need.get)
    flag = {"parameters": "--experts" if 2 * config.expert_weights > config.weights else "--d-model",
            "activations": "--batch-size", "data": "--samples"}[dominant]
    flag = blamed(dominant, given, flag)
    others = " / ".join(f for f in ("--d-model", "--d-hidden", "--world-size") if f != flag)
    gib = 1024**3
    raise UserError(
        f"this run needs ~{need['total'] / gib:.1f} GiB ({dominant} {need[dominant] / gib:.1f} GiB, over "
        f"{need['local_ranks']} local rank(s)) and {have / gib:.1f} GiB is available; lower {flag} "
        f"(or {others}), or add --force to run anyway", flag=flag)


# --------------------------------------------------------------------------- work

MAX_WORK_S = WEEK_S
"""Longest run moebench starts without --force: the longest --timeout, so a run that cannot end
before any deadline it could be given is refused instead of started."""
FLOPS_PER_WEIGHT_TOKEN = 6
"""Forward (2) and backward (4) FLOPs per active weight and token."""
ADAM_FLOPS_PER_WEIGHT = 16
"""Adam's update per weight and step (moments, bias correction, the step)."""
PEAK_FLOPS_PER_S = {"cpu": 1e11, "cuda": 1e15}
"""Per rank, more than any CPU core set / GPU of today sustains in fp32 (2 cores here: ~5e10), so
the estimate is a lower bound on the time: it refuses only what surely cannot end in time."""
STEP_OVERHEAD_S = 5e-3
"""Least wall time of one optimiser step (Python, the data loader, the optimiser's loop): measured
12-70 ms on the quick presets here; 5 ms keeps the estimate a lower bound."""


def work_seconds(config) -> float:
    """A lower bound on the seconds `config` takes to train (both variants)."""
    model, train = config.model, config.train
    active = model.layers * (4 * model.d_model**2 + config.moe.top_k * 2 * model.d_model * config.moe.d_hidden)
    flops_per_step = FLOPS_PER_WEIGHT_TOKEN * active * train.tokens_per_step + ADAM_FLOPS_PER_WEIGHT * config.weights
    rate = PEAK_FLOPS_PER_S["cuda" if config.launch.device == "cuda" else "cpu"] * config.launch.world_size
    return train.total_steps * (flops_per_step / rate + STEP_OVERHEAD_S)


def duration(seconds: float) -> str:
    """3.2 h, 9.3 days, 1.2e+09 years."""
    for unit, size in (("years", 365 * 86400.0), ("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.0f} s"


def require_work(seconds: float, *, force: bool = False, given: set[str] = frozenset(), default: str = "--steps",
                 what: str = "this run") -> float:
    """UserError when a lower bound of `seconds` is over MAX_WORK_S (unless `force`)."""
    if seconds <= MAX_WORK_S or force:
        return seconds
    flag = blamed("work", given, default)
    raise UserError(f"{what} takes >= {duration(seconds)} (bound: {duration(MAX_WORK_S)}); lower {flag} "
                    "or add --force", flag=flag)


def require_runnable(config, *, force: bool = False, given: set[str] = frozenset()) -> None:
    """Memory and work, both before anything is created (run, and --show-config alike)."""
    from moebench.config import MAX_STEPS

    train = config.train
    default = "--steps" if train.steps is not None else "--epochs"
    if train.total_steps > MAX_STEPS:  # --steps has this bound alone; epochs x steps per epoch has it too
        flag = blamed("work", given, default)
        raise UserError(f"{train.epochs} epochs x {train.steps_per_epoch} steps is over {MAX_STEPS:,} steps; "
                        f"lower {flag} (or give --steps)", flag=flag)
    require_fits(config, force=force, given=given)
    require_work(work_seconds(config), force=force, given=given, default=default)


# --------------------------------------------------------------------------- bench

PER_EXPERT_CALL_S = 1e-6
"""Least cost of one expert in one layer call (the per-expert loops in Python): a lower bound."""
BENCH_BYTES_PER_EXPERT_WEIGHT = 8
"""fp32 weight and its gradient (bench times forward + backward, no optimiser)."""


def bench_needs(points, *, layers: int, ep_layers: int, world_sizes: list[int], calls: int) -> dict:
    """Bytes at the peak and a lower bound on the seconds of a bench sweep (`calls` per layer and point)."""
    peak, seconds = 0.0, 0.0
    for p in points:
        weights = p.experts * 2 * p.d_model * p.d_hidden
        acts = 4 * p.tokens * p.top_k * (3 * p.d_hidden + 4 * p.d_model)
        flops = FLOPS_PER_WEIGHT_TOKEN * p.tokens * p.top_k * 2 * p.d_model * p.d_hidden
        call_s = flops / PEAK_FLOPS_PER_S["cpu"] + p.experts * PER_EXPERT_CALL_S
        peak = max(peak, PROCESS_BYTES + layers * (weights * BENCH_BYTES_PER_EXPERT_WEIGHT + acts))
        seconds += calls * layers * call_s
        for world in world_sizes if ep_layers else ():
            per_rank = weights / world * BENCH_BYTES_PER_EXPERT_WEIGHT + acts
            peak = max(peak, local_world_size(world) * (PROCESS_BYTES + per_rank))
            seconds += calls * ep_layers * call_s
    return {"bytes": int(peak), "seconds": seconds}


def require_bench_fits(points, *, layers: int, ep_layers: int, world_sizes: list[int], calls: int,
                       force: bool = False, given: set[str] = frozenset(), available: int | None = None) -> dict:
    """UserError naming the flag behind it when a bench sweep cannot fit in memory or end within MAX_WORK_S."""
    need = bench_needs(points, layers=layers, ep_layers=ep_layers, world_sizes=world_sizes, calls=calls)
    have = available_bytes() if available is None else available
    if need["bytes"] > have and not force:
        flag = next((f for f in ("--experts", "--d-model", "--d-hidden", "--tokens", "--top-k", "--world-size")
                     if f in given), "--experts")
        gib = 1024**3
        raise UserError(f"this sweep needs ~{need['bytes'] / gib:.1f} GiB, {have / gib:.1f} GiB is available; "
                        f"lower {flag} or add --force", flag=flag)
    require_work(need["seconds"], force=force, given=given, default="--experts", what="this sweep")
    return need


def require_ranks_fit(world_size: int, *, available: int | None = None) -> int:
    """UserError naming --world-size when `world_size` local ranks (a process with torch each) cannot
    fit in the available memory: checked before any rank starts (verify-parity's checks are small)."""
    local = local_world_size(world_size)
    need = local * PROCESS_BYTES
    have = available_bytes() if available is None else available
    if need > have:
        gib = 1024**3
        raise UserError(f"{local} local ranks need ~{need / gib:.1f} GiB ({PROCESS_BYTES // 1024**2} MB each with "
                        f"torch) and {have / gib:.1f} GiB is available; lower it", flag="--world-size")
    return need

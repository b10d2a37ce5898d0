"""Will a run fit? An estimate of its memory, checked before anything is created.

The estimate is deliberately simple and a little generous: fp32 weights with their gradient and
Adam's two moments (16 bytes a weight), activations kept for the backward pass, the random
training set (every rank holds all of it), and the interpreter with torch loaded, for every rank
on this machine. A configuration over the available memory is bad input (exit 2) naming the flag
that dominates; `--force` runs it anyway.
"""

from __future__ import annotations

from moebench.distributed.env import local_world_size
from moebench.errors import UserError

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


def require_fits(config, *, force: bool = False, available: int | None = None) -> dict:
    """UserError (naming the dominant flag) when the estimate exceeds the available memory."""
    need = estimate(config)
    have = available_bytes() if available is None else available
    if need["total"] <= have or force:
        return need
    dominant = max(("parameters", "activations", "data"), key=need.get)
    flag = {"parameters": "--experts" if 2 * config.expert_weights > config.weights else "--d-model",
            "activations": "--batch-size", "data": "--samples"}[dominant]
    others = " / ".join(f for f in ("--d-model", "--d-hidden", "--world-size") if f != flag)
    gib = 1024**3
    raise UserError(
        f"this run needs ~{need['total'] / gib:.1f} GiB ({dominant} {need[dominant] / gib:.1f} GiB, over "
        f"{need['local_ranks']} local rank(s)) and {have / gib:.1f} GiB is available; lower {flag} "
        f"(or {others}), or add --force to run anyway", flag=flag)

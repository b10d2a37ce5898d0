"""One rank of `moebench run fastmoe`: build the model, train on the shared random data, evaluate.

Expert parallelism: every rank builds the same one-process weights from the seed and keeps its
experts (global expert g on rank g // num_local_experts); rank r trains on its rows of every
global batch. With the naive gate, N ranks then follow the one-process loss curve (see
moebench/distributed/expert_parallel.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from moebench import config as config_tree
from moebench.data import Batches, held_out_batch, seed_rank_randomness
from moebench.distributed.launch import RankContext
from moebench.loop import LoopSpec, global_mean, rank_writer, train_loop
from moebench.models.transformer import count_params
from moebench.variants.fastmoe.config import FastMoERunConfig
from moebench.variants.fastmoe.model import build_rank_model


def train_rank(ctx: RankContext, run_path, config_dict: dict, show_progress: bool = True) -> dict:
    """Train on this rank; rank 0 writes params.json and metrics.jsonl into `run_path`."""
    from moebench.distributed import expert_parallel

    writer = rank_writer(ctx, run_path)

    config = config_tree.build(FastMoERunConfig, config_dict)
    train, impl = config.train, config.moe.moe_impl
    device = ctx.device if ctx.world_size > 1 else ("cuda" if config.launch.device == "cuda" else "cpu")
    model = build_rank_model(config, ctx.rank, ctx.world_size, device)
    # Every rank built the same weights from the seed; what it draws while training (gate noise,
    # GShard's random routing) must differ per rank, as it does in fastmoe.
    seed_rank_randomness(train.seed, ctx.rank)
    params = count_params(model, ep_size=ctx.world_size)
    if writer:
        writer.write_json("params.json", {"moe_impl": impl, **params})
    batches = Batches(train, config.model.d_model, rank=ctx.rank, world_size=ctx.world_size)
    moe_layers = [block.mlp for block in model.layers]
    kept = [torch.zeros(config.moe.experts, dtype=torch.int64) for _ in moe_layers]
    recorded = [True]  # emptied when a layer reports no routing counts
    optimizer = make_optimizer(model, config)

    def step_fn(step: int) -> dict:
        x, y = (t.to(device) for t in batches.rank_batch(step))
        model.train()
        optimizer.zero_grad(set_to_none=True)
        out, aux = model(x)
        mse = F.mse_loss(out, y)
        (mse + train.aux_loss_coef * aux).backward()
        if ctx.world_size > 1:
            expert_parallel.sync_gradients(model)
        optimizer.step()
        per_layer = [routed_tokens(m, ctx.world_size) for m in moe_layers]
        for total, counts in zip(kept, per_layer):
            if counts is None:
                recorded.clear()
            else:
                total += torch.tensor(counts)
        record = {"moe_impl": impl, "loss": global_mean(mse, ctx.world_size),
                  "aux_loss": global_mean(aux.detach(), ctx.world_size), "tokens_per_expert": per_layer}
        if recorded:  # routes dropped at capacity this step (GShard / Switch; 0 for the naive gate)
            routes = train.tokens_per_step * config.moe.top_k * len(per_layer)
            record["dropped_route_frac"] = (routes - sum(sum(c) for c in per_layer)) / routes
        return record

    spec = LoopSpec(total_steps=train.total_steps, steps_per_epoch=train.steps_per_epoch,
                    tokens_per_step=train.tokens_per_step, label=f"fastmoe ({impl})")
    history = train_loop(step_fn, spec, writer=writer, show_progress=show_progress)
    model.eval()
    x_test, y_test = held_out_batch(train, config.model.d_model)
    with torch.no_grad():
        out, _ = model(x_test[batches.rows].to(device))
        test_loss = global_mean(F.mse_loss(out, y_test[batches.rows].to(device)), ctx.world_size)
    if writer:
        writer.close()
    return {
        "moe_impl": impl, "world_size": ctx.world_size, "ep_size": ctx.world_size, "comm_backend": ctx.backend,
        "device": device, "params": params, **history,
        "test": {"input_shape": list(x_test.shape), "output_shape": [train.batch_size, *out.shape[1:]],
                 "loss": test_loss},
        "data": batches.data_range(),
        # The real fmoe layer keeps no routing counts: no routing section then, rather than zeros.
        "routing": (routing_summary(kept, tokens=train.tokens_per_step * history["steps"], top_k=config.moe.top_k)
                    if recorded else None),
    }


def make_optimizer(model, config: FastMoERunConfig) -> torch.optim.Optimizer:
    # The fused kernel is several times faster on the chapter model's 273 M parameters (CPU and CUDA).
    return torch.optim.Adam(model.parameters(), lr=config.train.lr, fused=True)


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


def routing_summary(kept: list[torch.Tensor], *, tokens: int, top_k: int) -> dict:
    """Routes kept per expert over training, and the share dropped at capacity (GShard / Switch)."""
    per_layer = []
    for layer, counts in enumerate(kept):
        routes, kept_routes = tokens * top_k, int(counts.sum())
        per_layer.append({"layer": layer, "experts": counts.numel(), "tokens_kept_per_expert": counts.tolist(),
                          "routes": routes, "dropped": routes - kept_routes,
                          "dropped_route_frac": (routes - kept_routes) / routes if routes else 0.0})
    routes = sum(r["routes"] for r in per_layer)
    dropped = sum(r["dropped"] for r in per_layer)
    return {"tokens_per_layer": tokens, "routes": routes, "dropped": dropped,
            "dropped_route_frac": dropped / routes if routes else 0.0, "per_layer": per_layer}


@contextlib.contextmanager
def step_parts(config: FastMoERunConfig):
    """The run's step on one in-process rank, phase by phase (see moebench.loop.StepParts)."""
    from moebench.loop import StepParts

    device = "cuda" if config.launch.device == "cuda" else "cpu"
    model = build_rank_model(config, 0, 1, device)
    optimizer = make_optimizer(model, config)
    batches = Batches(config.train, config.model.d_model, rank=0, world_size=1)
    model.train()

    def forward(batch):
        out, aux = model(batch[0])
        return F.mse_loss(out, batch[1]) + config.train.aux_loss_coef * aux

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    yield StepParts(data=lambda s: tuple(t.to(device) for t in batches.rank_batch(s)), forward=forward,
                    backward=lambda loss: loss.backward(), optimizer=step,
                    trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
                    optimizer_name=f"torch.optim.{type(optimizer).__name__}(fused={optimizer.defaults.get('fused')})")

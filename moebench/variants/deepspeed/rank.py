"""One rank of `moebench run deepspeed`: DeepSpeed comm on the rank's group, the shared Transformer
with DeepSpeed's MoE, `deepspeed.initialize` with the MoE parameter groups split, training on the
shared random data, and a (batch_size, seq_len, d_model) test batch."""

from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.nn.functional as F

from moebench import config as config_tree
from moebench.console import stdout_to_stderr
from moebench.data import Batches, held_out_batch, seed_rank_randomness
from moebench.distributed.launch import RankContext
from moebench.loop import LoopSpec, rank_writer, train_loop
from moebench.variants.deepspeed.comm import deepspeed_comm
from moebench.variants.deepspeed.config import DeepSpeedRunConfig
from moebench.variants.deepspeed.ds_config import build_ds_config
from moebench.variants.deepspeed.model import build_model
from moebench.variants.deepspeed.routing import RoutingTotals, drop_fractions


@contextlib.contextmanager
def engine_on(ctx: RankContext, config: DeepSpeedRunConfig):
    """DeepSpeed on this rank, as `run deepspeed` trains: its comm layer on the rank's group (no shm
    op build; in-process, a one-rank group of its own), DeepSpeed's expert groups, the seeded model
    holding this rank's experts, and `deepspeed.initialize` with the MoE parameter groups split.
    Yields a namespace (engine, model, ds_config, timings)."""
    import types

    from moebench.models.deepspeed_moe import create_expert_groups, set_accelerator_env

    set_accelerator_env(config.launch.device)
    start = time.perf_counter()
    with stdout_to_stderr():  # DeepSpeed prints on stdout; keep it for moebench's result (--json)
        import deepspeed
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    timings = {"import_deepspeed_s": time.perf_counter() - start}
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO lines would bury the progress bar
    ds_config = build_ds_config(config)
    with stdout_to_stderr(), deepspeed_comm(ctx, compiled_ops=config.engine.compiled_ops,
                                            timeout_s=config.launch.timeout_s or config.default_timeout_s,
                                            backend=config.launch.comm_backend) as init_s:
        import torch.distributed as dist

        timings["init_distributed_s"] = init_s
        create_expert_groups(config.moe.ep_size)
        model = build_model(config, ep_rank=dist.get_rank() % config.moe.ep_size)
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "parameters"})
        t0 = time.perf_counter()
        engine, _optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config)
        timings["deepspeed_initialize_s"] = time.perf_counter() - t0
        ds = types.SimpleNamespace(engine=engine, model=model, ds_config=ds_config, timings=timings)
        del engine, _optimizer
        try:
            yield ds
        finally:
            ds.engine = None  # drop the engine (and its group references) before the comm layer is torn down


def train_rank(ctx: RankContext, run_path, config_dict: dict, show_progress: bool = True) -> dict:
    """Train on this rank through DeepSpeed's engine; rank 0 writes params.json and metrics.jsonl."""
    from moebench.models.deepspeed_moe import moe_layers
    from moebench.models.transformer import count_params

    config = config_tree.build(DeepSpeedRunConfig, config_dict)
    train = config.train
    start = time.perf_counter()
    writer = rank_writer(ctx, run_path)

    with engine_on(ctx, config) as ds:
        import torch.distributed as dist

        engine, model, ds_config, timings = ds.engine, ds.model, ds.ds_config, ds.timings
        rank, world = dist.get_rank(), dist.get_world_size()
        used_backend = dist.get_backend()  # what really ran (recorded beside the predicted one)
        params = count_params(model, ep_size=config.moe.ep_size)
        if writer:
            writer.write_json("params.json", {"moe_impl": "deepspeed", **params})
        seed_rank_randomness(train.seed, rank)  # gate noise / RTS: distinct per rank
        device = engine.device
        layers = moe_layers(model)
        batches = Batches(train, config.model.d_model, rank=rank, world_size=world)
        totals = RoutingTotals(config.experts_per_layer)

        def step_fn(step: int) -> dict:
            x, y = (t.to(device) for t in batches.rank_batch(step))
            engine.train()
            out, aux = engine(x)
            mse = F.mse_loss(out, y)
            engine.backward(mse + train.aux_loss_coef * aux)
            engine.step()
            totals.add(layers)
            counts = [sum(getattr(layer.last, name) for layer in layers)
                      for name in ("routes", "dropped", "tokens", "dropped_tokens")]
            kept = [layer.last.kept_per_expert.tolist() for layer in layers]
            # One small collective per step: the loss of the global batch, not of rank 0's share.
            stats = torch.tensor([mse.item(), aux.item(), *counts, *(c for layer in kept for c in layer)],
                                 dtype=torch.float64)
            if world > 1:
                dist.all_reduce(stats)
            mse_avg, aux_avg = stats[0].item() / world, stats[1].item() / world
            drops = drop_fractions(*stats[2:6].tolist())
            flat_kept = [int(c) for c in stats[6:].tolist()]
            tokens_per_expert, at = [], 0
            for n in config.experts_per_layer:  # kept routes per global expert, every rank's tokens
                tokens_per_expert.append(flat_kept[at:at + n])
                at += n
            return {"moe_impl": "deepspeed", "loss": mse_avg, "aux_loss": aux_avg,
                    "total_loss": mse_avg + train.aux_loss_coef * aux_avg,
                    "dropped_route_frac": drops["dropped_route_frac"],
                    "dropped_token_frac": drops["dropped_token_frac"], "tokens_per_expert": tokens_per_expert}

        spec = LoopSpec(total_steps=train.total_steps, steps_per_epoch=train.steps_per_epoch,
                        tokens_per_step=train.tokens_per_step, label="deepspeed-moe")
        history = train_loop(step_fn, spec, writer=writer, show_progress=show_progress)
        routing = totals.summary(world)

        engine.eval()
        x_test, y_test = held_out_batch(train, config.model.d_model)
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
        engine = None  # this function's reference too, before engine_on tears the comm layer down

    return {
        "moe_impl": "deepspeed", "world_size": world, "comm_backend": used_backend, "ep_size": config.moe.ep_size,
        "device": str(device), "experts_per_layer": list(config.experts_per_layer), "params": params, **history,
        "epoch_total_loss": _epoch_means([h + train.aux_loss_coef * a for h, a in
                                          zip(history["losses"], history["aux_losses"])], train.steps_per_epoch),
        "routing": routing, "data": batches.data_range(),
        "test": {"input_shape": list(x_test.shape), "output_shape": output_shape,
                 "loss": test_loss.item() / world, "routing": eval_routing},
        "timings": {**timings, "rank_total_s": time.perf_counter() - start},
        "ds_config": ds_config,
    }


def _epoch_means(values: list[float], per_epoch: int) -> list[float]:
    chunks = [values[i:i + per_epoch] for i in range(0, len(values), per_epoch)]
    return [sum(c) / len(c) for c in chunks]


@contextlib.contextmanager
def step_parts(config: DeepSpeedRunConfig):
    """The run's step through DeepSpeed's engine on one in-process rank, phase by phase (see
    moebench.loop.StepParts)."""
    from moebench.loop import StepParts

    ctx = RankContext(rank=0, world_size=1, local_rank=0, backend="none", device="cpu")
    with engine_on(ctx, config) as ds:
        engine = ds.engine
        batches = Batches(config.train, config.model.d_model, rank=0, world_size=1)
        engine.train()

        def forward(batch):
            out, aux = engine(batch[0])
            return F.mse_loss(out, batch[1]) + config.train.aux_loss_coef * aux

        yield StepParts(data=lambda s: tuple(t.to(engine.device) for t in batches.rank_batch(s)),
                        forward=forward, backward=engine.backward, optimizer=engine.step,
                        trainable_params=sum(p.numel() for p in ds.model.parameters() if p.requires_grad),
                        optimizer_name=f"DeepSpeed engine (ZeRO {config.engine.zero_stage}) stepping "
                                       f"{type(engine.optimizer).__name__}")

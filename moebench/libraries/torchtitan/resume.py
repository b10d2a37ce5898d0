"""A torchtitan resume row, on every rank: its MoE (DeepSeek-V3's router: sigmoid, grouped top-k, a shared expert,
and aux-loss-free load balancing, its expert bias updated by the optimizers' step pre-hook torchtitan registers)
trained through torchtitan's own optimizers container, saved and loaded by torchtitan's own `CheckpointManager` over
DCP, as its trainer calls them (`checkpointer.save(step)`, `checkpointer.load(step)`).

1. Module A, parallelized over the save layout (EP over every rank), trains SAVE_STEPS steps (torchtitan's
   `OptimizersContainer`, Adam; `register_moe_load_balancing_hook`); every rank must hold the same expert bias
   after every step. A's state (weights, Adam's exp_avg / exp_avg_sq, the expert bias) is kept, read as whole tensors
   through the parallelization (a spmd_types state through torchtitan's `plain_tensor_to_dtensor_state_dict`).
2. `CheckpointManager.save(SAVE_STEPS)` into a folder under moebench's temporary root; A trains on: the run that
   never stopped.
3. Module B, built from another seed and parallelized over the load layout (the same, or TP without EP: DCP's
   resharding), `CheckpointManager.load(SAVE_STEPS)`. Right after the load every expert slot of every rank is
   matched against every global expert's weights and moments, and every rank's expert bias against A's
   (moebench.parity.restore): a slot holding another expert's state is named slot by slot.
4. Same layout: B trains on CONTINUE_STEPS steps on the same batches, bit for bit with A at every step.
Gradient convention as the bf16 rows (bf16.py): a rank's loss is the sum over its tokens / the global token count;
the dense parameters' gradients summed over the data-parallel ranks (torchtitan's FSDP, emulated).
"""

from __future__ import annotations

from typing import Any

from moebench.libraries.spec import Row
from moebench.libraries.torchtitan import api

SAVE_STEPS = 2
CONTINUE_STEPS = 2
LR = 1e-2
LOAD_BALANCE_COEFF = 1e-2
"""Large enough that the bias moves visibly in two steps (the sign update adds +-coeff per step)."""
FRESH_SEED_OFFSET = 7919
BIAS = "expert_bias_E"
"""The expert bias of 0.3's MoE (0.2's: `expert_bias`)."""


def bias_name(gen: str) -> str:
    return BIAS if gen == "common" else "expert_bias"


def is_expert(gen: str, name: str) -> bool:
    """Whether `name` is a routed expert's parameter (stacked over the experts along dim 0)."""
    return name in {v for role, v in api.names(gen).items() if role in ("w1", "w2", "w3")}


def _model(moe):
    """torchtitan's model shape around the MoE: what its load balancing hook walks (api.one_block_model)."""
    return api.one_block_model(moe)


def _make(gen: str, row: Row, layout: str, seed: int, world: int):
    """(model, moe, optimizers, forward context, input entry, ParallelDims) of one side. 0.3: its Module protocol,
    `OptimizersContainer` and `register_moe_load_balancing_hook`; 0.2: its EP step (api.parallelize), or no
    parallelism at all (layout "none": the whole module on every rank), `build_optimizers_with_moe_load_balancing`."""
    import contextlib

    import torch

    torch.manual_seed(seed)
    moe = api.build(gen, row.model, enable_ep=layout not in ("tp", "none"), enable_sp=layout == "ep+tp",
                    load_balance_coeff=LOAD_BALANCE_COEFF)
    if layout == "none":
        context, enter, dims = contextlib.nullcontext, (lambda x: x), None
    else:
        context, _, enter, dims = api.parallelize(gen, moe, row.backend, layout, world)
    model = _model(moe)
    if gen == "moe":
        from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
        from torchtitan.config.job_config import Optimizer
        from torchtitan.distributed import ParallelDims

        hook_dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world)
        hook_dims.build_mesh()  # the hook sums the token counts over its "loss" mesh (the data-parallel ranks)
        optimizers = build_optimizers_with_moe_load_balancing(
            [model], Optimizer(name="Adam", lr=LR, implementation="for-loop"), hook_dims)
        return model, moe, optimizers, context, enter, dims
    from torchtitan.components.optimizer.optimizer import (
        OptimizersContainer,
        ParamGroupConfig,
        register_moe_load_balancing_hook,
    )

    config = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=".*", optimizer_name="Adam", optimizer_kwargs={"lr": LR})], implementation="for-loop")
    optimizers = OptimizersContainer(config, model_parts=[model])
    register_moe_load_balancing_hook(optimizers, [model], dims)
    return model, moe, optimizers, context, enter, dims


def _checkpointer(gen: str, folder: str, model, optimizers):
    """torchtitan's own CheckpointManager as its trainer builds it (0.3: its Config; 0.2: job_config's Checkpoint)."""
    from torchtitan.components.checkpoint import CheckpointManager

    if gen == "moe":
        from torchtitan.config.job_config import Checkpoint

        config = Checkpoint(enable=True, folder="checkpoint", interval=1,
                            exclude_from_loading=["dataloader", "lr_scheduler"])
        return CheckpointManager(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None,
                                 states={}, checkpoint_config=config, sd_adapter=None, base_folder=folder,
                                 ft_manager=None)
    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, initial_load_model_only=False,
                                      exclude_from_loading=["dataloader", "lr_scheduler"])
    return CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None,
                             states={}, sd_adapter=None, base_folder=folder)


def _batch(seed: int, step: int, world: int):
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + step)
    shape = (world * api.SEQS_PER_DP_RANK, api.SEQ_LEN, api.HIDDEN)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _train(side, step: int, seed: int, rank: int, world: int) -> None:
    """One step of one side on this rank's sequences (EP: each rank its own)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from moebench.libraries.torchtitan.bf16 import covers_dp

    model, moe, optimizers, context, enter, _ = side
    gen = api.generation()
    x_all, t_all = _batch(seed, step, world)
    mine = slice(rank * api.SEQS_PER_DP_RANK, (rank + 1) * api.SEQS_PER_DP_RANK)
    tokens = x_all.shape[0] * x_all.shape[1]
    with context():
        y = moe(enter(x_all[mine].clone()))
        y = y.to_local() if isinstance(y, DTensor) else y
        ((y.float() * t_all[mine]).sum() / tokens).backward()
    for name, p in moe.named_parameters():  # what torchtitan's FSDP sums over the data-parallel ranks
        if not is_expert(gen, name) and p.grad is not None and not covers_dp(p.grad):
            dist.all_reduce(p.grad)
    optimizers.step()
    optimizers.zero_grad()


def _whole(moe, name: str, t, dims):
    from torch.distributed.tensor import DTensor

    t = api.as_dtensor(moe, name, t, dims)
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _state(side) -> dict[str, dict[str, Any]]:
    """{"weights": {name: whole tensor}, "exp_avg": ..., "exp_avg_sq": ..., "bias": {BIAS: whole tensor}}."""
    _, moe, optimizers, _, _, dims = side
    out: dict[str, dict[str, Any]] = {"weights": {}, "exp_avg": {}, "exp_avg_sq": {}, "bias": {}}
    for name, p in moe.named_parameters():
        out["weights"][name] = _whole(moe, name, p, dims)
        state = next((o.state[p] for o in optimizers.optimizers if p in o.state), {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out[key][name] = _whole(moe, name, state[key], dims)
    name = bias_name(api.generation())
    out["bias"][BIAS] = _whole(moe, name, getattr(moe, name), dims)
    return out


def _findings(side, saved: dict, fresh: dict, rank: int, world: int, layout: str) -> list:
    """(comparison name, Finding) for every slot this rank holds: its weights and moments matched against every
    global expert's at the save, the dense parameters' and the expert bias against their own."""
    from moebench.parity import restore
    from moebench.parity.layout import ExpertLayout

    quantities = {"weights": restore.WEIGHTS, "exp_avg": restore.EXP_AVG, "exp_avg_sq": restore.EXP_AVG_SQ}
    now = _state(side)
    out = []
    whole = layout in ("tp", "none")  # every rank holds every expert (in pieces under TP)
    held = ExpertLayout(api.NUM_EXPERTS, world).experts_of(rank) if not whole else (
        range(api.NUM_EXPERTS) if rank == 0 else [])
    gen = api.generation()
    for key, quantity in quantities.items():
        for name, got in now[key].items():
            if is_expert(gen, name):
                want = {e: saved[key][name][e] for e in range(api.NUM_EXPERTS)}
                for slot, e in enumerate(held):
                    where = restore.Slot(rank=rank, local=e if whole else slot, unit=e)
                    f = restore.identify(where, quantity, got[e], want,
                                         fresh=fresh[key][name][e] if key == "weights" else None)
                    out.append((f"after the load: {name} [expert {e}] {key}", f))
            elif name in saved[key]:
                where = restore.Slot(rank=rank, local=None, unit=name)
                out.append((f"after the load: {name} {key}", restore.identify(
                    where, quantity, got, {name: saved[key][name]},
                    fresh=fresh[key].get(name) if key == "weights" else None)))
    where = restore.Slot(rank=rank, local=None, unit=BIAS)
    out.append(("after the load: the expert bias", restore.identify(where, restore.WEIGHTS, now["bias"][BIAS],
                                                                   {BIAS: saved["bias"][BIAS]})))
    return out


def _biases_agree(side, rank: int, tag: str):
    """Every rank holds the same expert bias (its update must be the same on every rank before any save)."""
    import torch
    import torch.distributed as dist

    from moebench.parity.compare import assertion
    from moebench.parity.diagnosis import ROUTER

    _, moe, _, _, _, dims = side
    name = bias_name(api.generation())
    mine = _whole(moe, name, getattr(moe, name), dims)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differ = [r for r, b in enumerate(every) if not torch.equal(b, every[0])]
    return assertion(f"{tag}: every rank holds the same expert bias", not differ, rank=rank, group=ROUTER,
                     note=f"ranks {differ} hold another bias than rank 0's" if differ else "")


def run(ctx, row: Row, opts) -> list:
    """The row on this rank (warnings as the bf16 rows keep them off the console)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="In CPU autocast")
        warnings.filterwarnings("ignore", message=".*torch.distributed.*deprecated")
        warnings.filterwarnings("ignore", message="To construct DTensor from torch.Tensor")
        return _run(ctx, row, opts)


def _run(ctx, row: Row, opts) -> list:
    import logging

    import torch

    from moebench.libraries.resume import refusal, restore_comparisons, shared_dir
    from moebench.parity.compare import EXACT, assertion, compare
    from moebench.parity.diagnosis import EXPERTS, REPLICATED, ROUTER

    for name in ("torchtitan", "torch.distributed.checkpoint"):  # the checkpointer's info lines
        logging.getLogger(name).setLevel(logging.WARNING)
    gen = api.load()
    api.point_at_cpu()
    if gen == "moe":  # 0.2's CPU gaps, recorded in the row (api.V02_PATCH)
        api.bridge_v02_cpu_gaps()
    if row.settings.patch.startswith("spmd_types"):
        from moebench.libraries.torchtitan.exchange import bridge

        bridge()
    r, w = ctx.rank, ctx.world_size
    s = row.settings
    out: list = []
    a = _make(gen, row, "ep", opts.seed, w)
    for step in range(SAVE_STEPS):
        _train(a, step, opts.seed, r, w)
        out.append(_biases_agree(a, r, f"step {step + 1}"))
    saved = _state(a)
    moved = bool(saved["bias"][BIAS].abs().sum() > 0)
    out.append(assertion(f"the expert bias moved in {SAVE_STEPS} steps (the row checks a state that changes)", moved,
                         rank=r, group=ROUTER, note="" if moved else "it is still all zeros: nothing to restore"))
    with shared_dir("torchtitan-resume") as folder:
        _checkpointer(gen, str(folder), a[0], a[2]).save(curr_step=SAVE_STEPS)
        torch.distributed.barrier()
        b = _make(gen, row, s.load_ep_mode, opts.seed + FRESH_SEED_OFFSET, w)
        fresh = _state(b)
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: every rank's errors

        try:
            _checkpointer(gen, str(folder), b[0], b[2]).load(step=SAVE_STEPS)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the load refused is the row's verdict
            from moebench.parity.registry import Refused

            raise Refused(f"CheckpointManager.load refused it: {refusal(exc)}") from None
    out += restore_comparisons(_findings(b, saved, fresh, r, w, s.load_ep_mode), r)
    if s.load_ep_mode != "ep":
        return out  # another layout: its reductions differ; what it restored is what is asked of it
    for step in range(SAVE_STEPS, SAVE_STEPS + CONTINUE_STEPS):
        _train(a, step, opts.seed, r, w)
        _train(b, step, opts.seed, r, w)
        kept, resumed = _state(a), _state(b)
        for name, t in resumed["weights"].items():
            group = EXPERTS if is_expert(gen, name) else ROUTER if "router" in name else REPLICATED
            out.append(compare(f"step {step + 1} (resumed): {name} vs the run that never stopped", t,
                               kept["weights"][name], EXACT, rank=r, group=group))
        out.append(compare(f"step {step + 1} (resumed): the expert bias vs the run that never stopped",
                           resumed["bias"][BIAS], kept["bias"][BIAS], EXACT, rank=r, group=ROUTER))
    return out

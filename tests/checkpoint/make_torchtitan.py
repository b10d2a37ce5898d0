"""Real torchtitan 0.3 checkpoints of its DeepSeek-V3 MoE (8 routed experts, a shared expert, the expert bias),
saved by W gloo ranks through torchtitan's own `CheckpointManager` (DCP) as its trainer calls it (a script:
`python make_torchtitan.py OUT [W]`, W = 2 or 4). The model and optimizers are those of moebench's torchtitan resume
rows (moebench/libraries/torchtitan/resume.py: `_make`, `_checkpointer`, `_train`):

- sound/   the trainer path: `parallelize_deepseekv3` (Module.parallelize with EP over every rank, then fully_shard),
           backend partial_dtensor (spmd_types, the default, cannot be fully_shard'ed before torch 2.14), two Adam
           steps, then `CheckpointManager.save(2)`: OUT/sound/checkpoint/step-2;
- plain/   `api.parallelize` alone (the Module protocol, no fully_shard) under spmd_types: every state is a plain
           local tensor, so each rank's experts reach DCP as an ordinary tensor and DCP keeps one rank's
           (pytorch/pytorch#120356's class); saved without a step: OUT/plain/checkpoint/step-0.
"""

from __future__ import annotations

import os

SEED, STEPS = 0, 2
KINDS = ("sound", "plain")


def _row(world: int, backend: str):
    from moebench.libraries.torchtitan import ADAPTER

    return next(r for r in ADAPTER.rows(world, resume=True)
                if r.kind == "resume" and r.backend == backend and r.variant == "resume")


def _quiet() -> None:
    import logging
    import warnings

    for name in ("torchtitan", "torch.distributed.checkpoint", "torch.distributed.tensor._redistribute"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _rank(rank: int, out: str, store: str) -> None:
    import torch.distributed as dist
    import two_ranks

    world = two_ranks.world()
    _quiet()
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    from moebench.libraries.torchtitan import api, resume
    from moebench.libraries.torchtitan.bf16 import setup_rank

    if "sound" in KINDS:
        row = _row(world, "partial_dtensor")
        gen = setup_rank(row)
        side = resume._make(gen, row, "ep", SEED, world, world)
        for step in range(STEPS):
            resume._train(side, step, SEED, rank, world)
        resume._checkpointer(gen, os.path.join(out, "sound"), side[0], side[2]).save(curr_step=STEPS)
        dist.barrier()
    if "plain" in KINDS:
        row = _row(world, "spmd_types")
        gen = setup_rank(row)
        moe = api.build(gen, row.model, enable_ep=True, enable_sp=False, load_balance_coeff=resume.LOAD_BALANCE_COEFF)
        api.parallelize(gen, moe, "spmd_types", "ep", world)
        model = api.one_block_model(moe)
        from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

        config = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=".*", optimizer_name="Adam", optimizer_kwargs={"lr": resume.LR})], implementation="for-loop")
        optimizers = OptimizersContainer(config, model_parts=[model])
        resume._checkpointer(gen, os.path.join(out, "plain"), model, optimizers).save(curr_step=0)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import two_ranks

    two_ranks.main(_rank)

"""A real Megatron-core dist_checkpointing save (torch_dist) of its MoE block, from two gloo ranks at EP 2 (a script:
`python make_megatron.py OUT`): the block, DDP and optimizer moebench's Megatron rows build on CPU
(moebench/libraries/megatron/step.py, with its CUDA stand-ins), one training step, then the block's own
`sharded_state_dict()` through `megatron.core.dist_checkpointing.save` into OUT/sound.
"""

from __future__ import annotations

import os


def _rank(rank: int, out: str, store: str) -> None:
    import torch.distributed as dist

    from moebench.libraries.megatron import make_row, step
    from moebench.libraries.megatron.parity import in_row

    os.environ.setdefault("LOCAL_RANK", str(rank))
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    settings = make_row("softmax-top2", "alltoall+sequential", "ep=2", 2).settings.fields()
    with in_row():
        from megatron.core import dist_checkpointing

        run = step.build(settings, 0, 2)
        step.train_step(run, 0, 0, 2)
        folder = os.path.join(out, "sound")
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(run.model.module.sharded_state_dict(), folder)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import two_ranks

    two_ranks.main(_rank)

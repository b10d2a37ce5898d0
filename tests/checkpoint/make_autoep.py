"""Real DeepSpeed AutoEP checkpoints of a tiny Hugging Face Mixtral (8 experts), saved by W gloo ranks (a script:
`python make_autoep.py OUT [W]`, W = 2 or 4): the model, config and training steps moebench's AutoEP resume rows
use (moebench/libraries/autoep: rowmath.build, resumemath.resume_config with AdamW as torch's own optimizer, two
steps), AutoEP at autoep_size W, then the engine's own `save_checkpoint` (a regular checkpoint, tag "resume"):

- zero1/      ZeRO 1;
- zero2/      ZeRO 2.
"""

from __future__ import annotations

import os

FAMILY, SEED = "mixtral", 0
STAGES = (1, 2)


def _rank(rank: int, out: str, store: str) -> None:
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist
    import two_ranks

    from moebench.libraries.autoep import resumemath as rx
    from moebench.libraries.autoep import rowmath as rm

    world = two_ranks.world()
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    if rm.registry_needs_shim():  # transformers 5.23+: the registry AutoEP writes to (moebench's resume rows' shim)
        rm.install_registry_shim()
    for stage in STAGES:
        engine = rx.initialize(rm.build(FAMILY, 2, SEED), rx.resume_config(stage, world, world))
        rx.train(engine, SEED, range(2), rank)
        engine.save_checkpoint(os.path.join(out, f"zero{stage}"), tag=rx.TAG)
        dist.barrier()
        engine.destroy()
        rx.forget_expert_groups()
    dist.destroy_process_group()


if __name__ == "__main__":
    import two_ranks

    two_ranks.main(_rank)

"""Real NeMo Automodel checkpoints of its DeepSeek-V3 model (8 routed experts, a shared expert, the routing bias),
saved by W gloo ranks through Automodel's own `Checkpointer` (`save_model` / `save_optimizer` over DCP) (a script:
`python make_automodel.py OUT [W]`, W = 2 or 4). The model, its parallelization and training step are those of
moebench's Automodel resume rows (moebench/libraries/automodel/resume.py: `_make` builds it and applies
Automodel's own parallelizer, apply_ep over every rank then apply_fsdp; `_train` steps as recipes/llm/train_ft.py;
`_checkpointer` is the Checkpointer as those rows build it):

- sound/step_2/   two Adam steps, then save_model and save_optimizer (model/ and optim/, each a DCP folder).
"""

from __future__ import annotations

import os

SEED, STEPS = 0, 2


def _rank(rank: int, out: str, store: str) -> None:
    import logging
    import warnings

    import torch
    import torch.distributed as dist
    import two_ranks

    world = two_ranks.world()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    from transformers.utils import logging as hf_logging

    from moebench.libraries.automodel import ADAPTER, resume

    torch.compiler.set_stance("force_eager")
    hf_logging.set_verbosity_error()
    for name in ("nemo_automodel", "torch.distributed.checkpoint"):
        logging.getLogger(name).setLevel(logging.ERROR)
    row = next(r for r in ADAPTER.rows(world, resume=True) if r.kind == "resume" and r.variant == "resume")
    side = resume._make(row, SEED, world, world)
    for step in range(STEPS):
        resume._train(side, step, SEED, rank, world)
    folder = os.path.join(out, "sound")
    path = os.path.join(folder, f"step_{STEPS}")
    resume._checkpointer(folder, rank, side[2]).save_model(side[0], path)
    resume._checkpointer(folder, rank, side[2]).save_optimizer(side[1], side[0], path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import two_ranks

    two_ranks.main(_rank)

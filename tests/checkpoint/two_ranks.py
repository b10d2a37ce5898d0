"""What every checkpoint maker's `__main__` does: run `rank(rank, target, store)` on spawned ranks (2, or the
world size given after the target: `python make_x.py OUT [W]`) that meet through a file store in the target
folder, then remove the store, so the folder holds the checkpoints alone. A maker that takes the world size reads
it in its ranks with `world()`."""

from __future__ import annotations

import os
import sys

WORLD = "MOEBENCH_CHECKPOINT_WORLD"
"""The world size, for the spawned ranks (set by main before the spawn)."""


def world() -> int:
    """The world size of this maker's run (2 unless its command line gave another)."""
    return int(os.environ.get(WORLD, "2"))


def main(rank) -> None:
    import torch.multiprocessing as mp

    target = sys.argv[1]
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    os.environ[WORLD] = str(size)
    os.makedirs(target, exist_ok=True)
    store = os.path.join(target, ".store")
    mp.spawn(rank, args=(target, store), nprocs=size)
    if os.path.exists(store):
        os.remove(store)

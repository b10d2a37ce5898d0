"""What every checkpoint maker's `__main__` does: run `rank(rank, target, store)` on 2 spawned ranks that meet
through a file store in the target folder, then remove the store, so the folder holds the checkpoints alone."""

from __future__ import annotations

import os
import sys


def main(rank) -> None:
    import torch.multiprocessing as mp

    target = sys.argv[1]
    os.makedirs(target, exist_ok=True)
    store = os.path.join(target, ".store")
    mp.spawn(rank, args=(target, store), nprocs=2)
    if os.path.exists(store):
        os.remove(store)

"""The parent of the resume rows' reproduction scripts (moebench pastes it into templates/torchtitan_resume.py and
automodel_resume.py): the ranks spawned on a FileStore, waited for under the deadline, killed on every way out, and
the restore's finding printed; each rank's gloo group (`rank_group`). Uses restore.py's diagnose_restore (pasted
above it)."""

import datetime
import multiprocessing as mp
import os
import tempfile
import time


def rank_group(rank: int, world: int, store_path: str, deadline: float) -> None:
    """A rank's gloo group on the parent's FileStore (loopback only), its timeout within the deadline; one thread."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=max(10.0, 0.5 * (deadline - time.time())))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timeout)
    torch.set_num_threads(1)


def restore_main(rank_main, world: int, deadline_s: float, restored: str) -> int:
    """Spawn the ranks (rank_main(rank, store path, checkpoint folder, deadline, queue): each puts (rank, "findings",
    [restore.Finding]) or (rank, "refused" / "error", text)), wait under deadline_s, kill every child on the way
    out, and print the finding: exit 1 a slot restored wrong, 0 every slot right (`restored` printed), 2 a setup
    error, a refused load or the deadline (`deadline_s` from now)."""
    deadline = time.time() + deadline_s
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, os.path.join(tmp, "store"), os.path.join(tmp, "ckpt"),
                                                     deadline, queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        try:
            while len(results) < world and time.time() < deadline:
                try:
                    rank, kind, value = queue.get(timeout=1.0)
                    results[rank] = (kind, value)
                except Exception:  # noqa: BLE001 - queue.Empty: keep waiting
                    if any(p.exitcode not in (None, 0) for p in procs) and len(results) < world:
                        time.sleep(2.0)
                        if not queue.empty():
                            continue
                        break
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
    if len(results) < world:
        print("setup error: a rank ended without a result, or the deadline passed")
        return 2
    errors = [v for k, v in results.values() if k == "error"]
    if errors:
        print("setup error:\n" + errors[0])
        return 2
    refused = [v for k, v in results.values() if k == "refused"]
    if refused:
        print(f"the load was refused: {refused[0]}")
        return 2
    every = [f for k, v in results.values() for f in v]
    found = diagnose_restore(every)  # noqa: F821 - pasted above (RESTORE)
    if found is None:
        print(restored)
        return 0
    print(f"{found['name']}: {found['sentence']}")
    return 1

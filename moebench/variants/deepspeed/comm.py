"""DeepSpeed's comm layer on moebench's process group, with no cold JIT compile.

DeepSpeed's CPU comm backend builds its shared-memory op (`deepspeed_shm_comm`, ~60 s cold) in
every `TorchBackend()` whenever `deepspeed.ops.__compatible_ops__` says it can. DeepSpeed keeps
that dict as a mutable module attribute; marking the op incompatible is the only switch it has,
and makes `build_shm_op()` return None (gloo does the collectives, as it would on macOS).
`--compiled-ops` keeps DeepSpeed's default.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import time

from moebench import tempdirs
from moebench.distributed.launch import PG_TIMEOUT_FRACTION, RankContext, loopback_interface

SHM_COMM_OP = "deepspeed_shm_comm"
"""DeepSpeed's CPU shared-memory collective op (JIT-built on first use)."""


@contextlib.contextmanager
def deepspeed_comm(ctx: RankContext, *, compiled_ops: bool, timeout_s: float, backend: str | None = None):
    """DeepSpeed's comm layer on this rank's process group, without building the shm op.

    In-process (world size 1, ctx.backend == "none") there is no process group: open a one-rank
    group (`backend`, default nccl on a CUDA accelerator else gloo) on a private FileStore (no port
    at all) and destroy it afterwards. Yields the seconds `deepspeed.init_distributed` took."""
    import deepspeed
    import deepspeed.comm
    import deepspeed.ops
    import torch.distributed as dist

    compatible = deepspeed.ops.__compatible_ops__  # DeepSpeed's own probe (fast; no compile)
    shm_before = compatible.get(SHM_COMM_OP)
    if not compiled_ops:
        compatible[SHM_COMM_OP] = False
    own_group = not dist.is_initialized()
    saved_env = {k: os.environ.get(k) for k in ("LOCAL_RANK", "GLOO_SOCKET_IFNAME")}
    store_dir = None
    try:
        if own_group:
            from deepspeed.accelerator import get_accelerator

            store_dir = str(tempdirs.make("ds-store"))
            backend = backend or ("nccl" if get_accelerator().device_name() == "cuda" else "gloo")
            timeout = datetime.timedelta(seconds=max(1.0, timeout_s * PG_TIMEOUT_FRACTION))
            loopback = loopback_interface()
            if loopback is not None:  # even a one-rank gloo group listens: on loopback, not the LAN
                os.environ["GLOO_SOCKET_IFNAME"] = loopback
            dist.init_process_group(backend, store=dist.FileStore(os.path.join(store_dir, "store"), 1),
                                    rank=0, world_size=1, timeout=timeout)
        os.environ.setdefault("LOCAL_RANK", str(ctx.local_rank))  # deepspeed.initialize asserts it
        start = time.perf_counter()
        deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
        yield time.perf_counter() - start
    finally:
        if own_group and dist.is_initialized():
            deepspeed.comm.destroy_process_group()  # also drops DeepSpeed's group references
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if shm_before is not None:
            compatible[SHM_COMM_OP] = shm_before
        if store_dir:
            shutil.rmtree(store_dir, ignore_errors=True)

"""What every library's resume row shares: a checkpoint folder all ranks see, and the restored-state
findings of every rank turned into the row's comparisons (moebench.parity.restore names the mechanism)."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Iterator

from moebench.parity import restore
from moebench.parity.compare import Comparison, assertion

EVERY_RANK = "restored state of every expert and parameter (all ranks)"
"""The row-level assertion every rank makes: fails on EVERY rank when any rank's slot is wrong, so the
row is named by the restore diagnosis (not "partial") even when only one rank loaded the wrong experts."""


@contextlib.contextmanager
def shared_dir(label: str) -> Iterator[Path]:
    """A checkpoint folder rank 0 creates under moebench's temporary root and every rank is told (a
    collective); removed by rank 0 after every rank is done with it (or by `tempdirs.sweep` when rank 0 died)."""
    import torch.distributed as dist

    from moebench import tempdirs

    rank = dist.get_rank()
    path = [str(tempdirs.make(label)) if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    folder = Path(path[0])
    try:
        yield folder
        dist.barrier()  # nobody reads it any more
    finally:
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


def refusal(exc: BaseException) -> str:
    """The one line a refused checkpoint load says: a framework's or DCP's own error (DCP's CheckpointException carries
    every rank's traceback: its first error line is the cause), else the exception's first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = next((line for line in lines if line.split(":", 1)[0].endswith(("Error", "Exception"))
                 and not line.startswith("CheckpointException")), None)
    return (said or f"{type(exc).__name__}: {lines[0] if lines else ''}")[:300]


def restore_comparisons(findings: list[tuple[str, restore.Finding]], rank: int) -> list[Comparison]:
    """This rank's (comparison name, Finding) pairs -> comparisons. A collective: every rank's findings are
    gathered so the diagnosis names every wrong slot with its global expert, on every rank."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [f for _, f in findings])
    diagnosis = restore.diagnose_restore([f for fs in everyone for f in fs])
    head = assertion(EVERY_RANK, diagnosis is None, rank=rank,
                     note="" if diagnosis is None else f"{diagnosis['name']}: {diagnosis['sentence']}")
    head.diagnosis = diagnosis
    return [head] + [restore.as_comparison(f, name, diagnosis=diagnosis) for name, f in findings]

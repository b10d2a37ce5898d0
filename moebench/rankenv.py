"""Who this process is, from the environment alone (no torch import: the CLI reads it first).

Under an external launcher (torchrun, the `deepspeed` launcher) RANK and WORLD_SIZE are set and
this process is one rank; otherwise moebench starts its own local ranks.
"""

from __future__ import annotations

import os

DEBUG_ENV = "MOEBENCH_DEBUG"
"""Set (by `moebench --debug`) to let every rank print; otherwise only rank 0 talks."""


def is_launched_rank() -> bool:
    """True when RANK and WORLD_SIZE say an external launcher made this process one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


LAUNCHERS = ("moebench", "torchrun", "external")
"""Who started a run's ranks: moebench itself, torchrun, or another launcher (the `deepspeed` one)."""


def launcher() -> str:
    """One of LAUNCHERS for this process (torchrun sets TORCHELASTIC_RUN_ID; other launchers only
    RANK / WORLD_SIZE)."""
    if not is_launched_rank():
        return "moebench"
    return "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "external"


def launched_world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def local_world_size(world_size: int) -> int:
    """Ranks on this machine: LOCAL_WORLD_SIZE under torchrun / deepspeed, else all `world_size`
    (moebench starts every rank locally). "auto" backends and GPU counts are judged on this."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if is_launched_rank() else world_size


def is_printer() -> bool:
    """Only rank 0 talks (under any launcher); a process that is no rank is rank 0."""
    return int(os.environ.get("RANK", "0")) == 0


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask; every core where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def rank_threads(local_ranks: int) -> int:
    """Intra-op threads per rank, the same under every launcher: the usable cores shared out, at
    least 1 (16 oversubscribed ranks on 2 cores crawl when each spawns a full pool)."""
    return max(1, usable_cores() // max(1, local_ranks))

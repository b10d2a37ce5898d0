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


def launch_env_problem() -> str | None:
    """What is wrong with the launcher variables, before any work (None: nothing, or no launcher): a process
    that RANK and WORLD_SIZE make one rank needs MASTER_ADDR and MASTER_PORT to meet its peers, and numbers
    that agree (0 <= RANK < WORLD_SIZE)."""
    has_rank, has_world = "RANK" in os.environ, "WORLD_SIZE" in os.environ
    if has_rank != has_world:
        given, missing = ("RANK", "WORLD_SIZE") if has_rank else ("WORLD_SIZE", "RANK")
        return (f"{given} is set but {missing} is not: start moebench under torchrun, or unset {given} to let it "
                "start its own ranks")
    if not has_rank:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        return (f"RANK={os.environ['RANK']!r} and WORLD_SIZE={os.environ['WORLD_SIZE']!r} must be whole numbers; "
                "start moebench under torchrun, or unset them to let it start its own ranks")
    if world < 1 or not 0 <= rank < world:
        return (f"RANK={rank} is not a rank of WORLD_SIZE={world} (0 <= RANK < WORLD_SIZE); start moebench under "
                "torchrun, or unset them to let it start its own ranks")
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(var):
            return (f"RANK and WORLD_SIZE are set but {var} is not: start moebench under torchrun, or unset RANK "
                    "and WORLD_SIZE to let it start its own ranks")
    return None


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
    """Only rank 0 talks (under any launcher); a process that is no rank is rank 0, and so is one whose
    launcher variables make no rank (launch_env_problem: it says why itself)."""
    if launch_env_problem() is not None:
        return True
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

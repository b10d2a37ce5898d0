"""Is the CPU shared right now? Samples of what *other* processes use, a thread policy from them,
and the warning a timed run carries when the machine was busy.

Measured on 2 cores (quick fastmoe, steady tokens/s, median of 3; the machine also carried other
users' load): torch's default of 2 intra-op threads ran at 26,600 tok/s idle and 5,500 with one
busy process beside it (4.9x slower: OpenMP's threads wait for each other while one of them is
descheduled); 1 thread ran at 24,800 and 26,600; OMP_WAIT_POLICY=PASSIVE at 6,900 and 15,800. So a
one-process run takes as many threads as there are cores nobody else is using (`threads_for`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

BUSY_SAMPLE_S = 0.25
"""How long the start-of-run sample watches the CPU: long enough to see a process that is busy
(a scheduler tick is 4 ms), short next to any run."""
BUSY_CORE_FRACTION = 0.5
"""Other processes using at least half a core on average take that core away from our threads: at
one busy process the default 2 threads ran 4.9x slower (module doc); half a core is where a core
is more often taken than free."""
STEAL_WARN_PCT = 10.0
"""Steal time (a hypervisor running other guests on our cores) above this share of the CPU time
makes the timings unreliable too."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CpuSample:
    """Cumulative CPU counters at one moment."""

    wall_s: float
    """time.monotonic()."""
    busy_s: float
    """CPU seconds every process on the machine has used (all cores; idle and iowait excluded)."""
    steal_s: float
    """CPU seconds stolen by the hypervisor (0 where the kernel has no such counter)."""
    total_s: float
    """All CPU seconds (busy + idle + steal ...)."""
    own_s: float
    """CPU seconds of this process and of its reaped children (ranks are reaped before the end sample)."""
    load1: float
    """The 1-minute load average (0 where the platform has none)."""


def sample() -> CpuSample:
    import psutil

    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    steal = getattr(t, "steal", 0.0)
    total = sum(t)
    own = os.times()
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = 0.0
    return CpuSample(wall_s=time.monotonic(), busy_s=total - idle - steal, steal_s=steal, total_s=total,
                     own_s=own.user + own.system + own.children_user + own.children_system, load1=load1)


def others_between(a: CpuSample, b: CpuSample) -> dict:
    """What other processes did between two samples: `others_cores` (cores they kept busy, on
    average), `steal_pct` (share of the CPU time stolen), the load averages at both ends."""
    wall = max(b.wall_s - a.wall_s, 1e-9)
    others = max(0.0, (b.busy_s - a.busy_s) - (b.own_s - a.own_s)) / wall
    total = b.total_s - a.total_s
    steal = 100.0 * (b.steal_s - a.steal_s) / total if total > 0 else 0.0
    return {"others_cores": round(others, 2), "steal_pct": round(steal, 1),
            "load1_start": round(a.load1, 2), "load1_end": round(b.load1, 2), "seconds": round(wall, 2)}


def busy_now(seconds: float = BUSY_SAMPLE_S) -> float:
    """Cores other processes keep busy, watched for `seconds` (this process sleeps meanwhile)."""
    first = sample()
    time.sleep(seconds)
    return others_between(first, sample())["others_cores"]


def threads_for(usable_cores: int, others_cores: float) -> int:
    """Intra-op threads for a one-process run: the cores nobody else is using, at least 1.
    A core counts as taken once others use BUSY_CORE_FRACTION of one."""
    taken = math.floor(others_cores + (1.0 - BUSY_CORE_FRACTION))
    return max(1, min(usable_cores, usable_cores - taken))


def busy_warning(machine: dict, cores: int) -> str | None:
    """One line when the machine was busy during a timed run (others used >= BUSY_CORE_FRACTION
    of a core, or steal time was high), else None."""
    reasons = []
    if machine["others_cores"] >= BUSY_CORE_FRACTION:
        reasons.append(f"other processes kept {machine['others_cores']:.1f} of {cores} cores busy")
    if machine["steal_pct"] >= STEAL_WARN_PCT:
        reasons.append(f"{machine['steal_pct']:.0f} % of CPU time was stolen by the hypervisor")
    if not reasons:
        return None
    return ("machine busy during the timed run: " + "; ".join(reasons)
            + f" (load average {machine['load1_start']:.1f} at start, {machine['load1_end']:.1f} at end): "
            "timings are not comparable with an idle machine's")

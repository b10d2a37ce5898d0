"""Is the CPU shared right now? Samples of what *other* processes use, and the warning a timed run carries
when the machine was busy.

A one-process run takes every usable core as its intra-op threads, whatever the load: the thread count
changes float32 results (a reduction split over 1 or 2 threads sums in another order: the quick DeepSpeed
preset's loss at step 10 read 1.8749785 with 1 thread, 1.8749788 with 2), so a count chosen from the load at
the start made the same seed give other numbers on a busy machine. What the load costs instead is time, and
the run says so: measured on 2 cores (quick fastmoe, steady tokens/s, median of 3), 2 threads ran at 26,600
tok/s idle and 5,500 with one busy process beside it (OpenMP's threads wait for each other while one of them
is descheduled); 1 thread at 24,800 and 26,600. `OMP_NUM_THREADS` (or taskset) sets the count, when a user
prefers speed on a loaded machine to numbers comparable with an idle run's.
"""

from __future__ import annotations

import dataclasses
import os
import time

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


def threads_for(usable_cores: int) -> int:
    """Intra-op threads for a one-process run: every usable core (the same count at every run on this machine,
    so the same seed gives the same numbers; see the module docstring)."""
    return max(1, usable_cores)


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

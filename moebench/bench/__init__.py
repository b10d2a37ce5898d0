"""`moebench bench`: MoE layer speed against its compute bound and against DeepSpeed.

- layers.py: one layer's forward + backward in this process (ideal, dense, reference, DeepSpeed,
  fmoe, grouped-mm) over a sweep, with the profiler's breakdown;
- parallel.py: the expert-parallel layers on 1, 2, 4 ... local ranks, and all-to-all alone;
- train_step.py: one full training step of each variant's preset, phase by phase, with bounds;
- output.py: the 80-column tables and the plots.
"""

from moebench.bench.core import BenchSpec, format_summary, run_bench
from moebench.bench.layers import (
    LAYERS,
    Point,
    balanced_counts,
    expert_weights,
    grouped_mm_experts,
    per_expert_loop,
    run_sweep,
)
from moebench.bench.output import format_table, plot

__all__ = ["LAYERS", "BenchSpec", "Point", "balanced_counts", "expert_weights", "format_table", "grouped_mm_experts",
           "format_summary", "per_expert_loop", "plot", "run_bench", "run_sweep"]

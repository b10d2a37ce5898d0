"""Low precision judged by a noise model, not element by element.

In bf16 every element differs from the float32 result by rounding, so a per-element tolerance either
passes everything or nothing. The judge instead: a run's relative L2 distance from the float32 reference,
over the whole model, must be at most BF16_NOISE_RATIO x the distance of the same mathematics in the same
precision on one process (the baseline). A parallel run may add the rounding of its own reductions; a
wrong share of a gradient (a group divided by the wrong size, a missing contribution) is a distance of
its own size, tens of times the baseline's.

Distances are built from sums, so each rank can sum what it holds (weighted so that every parameter
counts once over the ranks) and one all-reduce gives the whole model's: `sums` per tensor pair, added,
then `distance`. `fit` reads off the same sums whether a group is the reference scaled by one factor.
Used by the DeepSpeed engine rows and the transformers rows (moebench/libraries/).
"""

from __future__ import annotations

import math

import torch

from moebench.parity.compare import Comparison, assertion
from moebench.parity.noisemath import (  # noqa: F401 - the noise model's names, here where its users look
    BF16_NOISE_RATIO,
    GROUP_FIT_RTOL,
    common_factor,
    distance,
    fit,
    scaled_groups,
    sums,
)


def judge(tag: str, what: str, run: torch.Tensor, baseline: torch.Tensor, *, rank: int | None = None,
          group: str = "", precision: str = "bf16") -> Comparison:
    """The noise-model assertion: the run's distance (from its sums) within BF16_NOISE_RATIO x the baseline's
    in the same `precision` ("bf16", "fp16"); `group` is the parameter group judged (diagnosis.GROUPS)."""
    d_run, d_base = distance(run), distance(baseline)
    ok = d_run <= BF16_NOISE_RATIO * d_base
    allowed = BF16_NOISE_RATIO * d_base
    used = d_run / allowed if allowed > 0 else (0.0 if d_run == 0 else math.inf)
    judged = assertion(f"{tag}: {precision} noise model: {what}'s distance from fp32 {d_run:.3g} <= "
                       f"{BF16_NOISE_RATIO:g} x {precision} on one process ({d_base:.3g})", ok, rank=rank, group=group,
                       note=f"ratio {d_run / d_base:.3g}" if d_base > 0 else "no baseline distance", used=used)
    if not (math.isfinite(d_run) and math.isfinite(d_base)):  # NaN or Inf somewhere: never noise
        judged.finite = False
        judged.passed = False
        judged.note = (f"the {'run' if not math.isfinite(d_run) else 'one-process baseline'} holds NaN or Inf "
                       f"({what}'s distance from fp32 {d_run:.3g}, baseline {d_base:.3g})")
    return judged

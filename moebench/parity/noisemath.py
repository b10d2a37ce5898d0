"""The noise model's mathematics, stdlib and torch only: a half-precision run's distance from float32 against the
same mathematics in the same precision on one process, and whether a group is the reference scaled by one factor.

moebench.parity.noise builds its assertion on it; `--repro` pastes this file into a DeepSpeed half-precision row's
standalone script (libraries/repro), so the script and the tool read the same distances and factors.
"""

import math
from typing import Iterable

import torch

BF16_NOISE_RATIO = 4.0
"""A half-precision run (bf16, fp16) passes when its distance from float32 is at most this many times the
one-process baseline's in the same precision. Measured here: unbroken DeepSpeed engine rows (0.19.8, W = 4) at
1.36-1.54 in bf16, FP16_MEASURED in fp16; unbroken transformers rows (5.23.0, 15 rows x W = 2 and 4 x seeds 0-5:
output, gradient and input gradient) at 0.99-1.07; broken: DeepSpeed's expert gradients divided by the wrong
group's size (2x) at 51-354, transformers' experts summed over the ranks instead of averaged at 6.5-445 (6.5:
DeepSeek-V3 at W = 2, whose grouped top-k flips routes in bf16 on one process too), its router gradient never
all-reduced at 36, no backward all-to-all at 133."""
GROUP_FIT_RTOL = 0.05
"""A group is `c x the reference` when what is left after the fit is within 5 % of it (relative L2):
bf16 noise is ~0.5 % here (the noise model's distances), a wrong share of a gradient leaves >= 20 %."""


def sums(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], weight: float = 1.0) -> torch.Tensor:
    """[sum a*a, sum a*e, sum e*e] over (actual, expected) pairs, in float64, times `weight` (a parameter that
    several ranks hold is weighted by 1 / how many, so the sums over the ranks count it once)."""
    out = torch.zeros(3, dtype=torch.float64)
    for a, e in pairs:
        a, e = a.detach().double(), e.detach().double()
        out += torch.stack([(a * a).sum(), (a * e).sum(), (e * e).sum()])
    return out * weight


def distance(s: torch.Tensor) -> float:
    """|a - e| / |e| from sums (inf when the reference is all zeros)."""
    aa, ae, ee = (float(v) for v in s)
    return math.sqrt(max(aa - 2 * ae + ee, 0.0) / ee) if ee > 0 else math.inf


def fit(s: torch.Tensor) -> tuple[float, float] | None:
    """(c, relative L2 residual) of the least-squares fit actual = c x expected; None without a reference."""
    aa, ae, ee = (float(v) for v in s)
    if ee == 0:
        return None
    c = ae / ee
    return c, math.sqrt(max(aa - 2 * c * ae + c * c * ee, 0.0) / aa) if aa > 0 else 0.0


def scaled_groups(groups: dict[str, torch.Tensor], baseline: dict[str, torch.Tensor] | None = None
                  ) -> tuple[dict[str, float], set[str]]:
    """({group: c} for each group that is the reference scaled by c != 1, the groups that are right), from
    each group's sums; a group that fits no single factor is in neither. A fit is read to GROUP_FIT_RTOL, or to
    BF16_NOISE_RATIO x the group's `baseline` distance where bf16 itself moves the group more (a router whose
    top-k flips for a few tokens in bf16)."""
    scaled, right = {}, set()
    for name, s in groups.items():
        found = fit(s)
        floor = BF16_NOISE_RATIO * distance(baseline[name]) if baseline and name in baseline else 0.0
        slack = max(GROUP_FIT_RTOL, floor)
        if found is None or found[1] > slack:
            continue
        if abs(found[0] - 1) > slack:
            scaled[name] = found[0]
        else:
            right.add(name)
    return scaled, right


def common_factor(scaled: dict[str, float]) -> float | None:
    """The one factor every scaled group shares (their mean), when they agree within GROUP_FIT_RTOL of it relatively;
    None when there is no scaled group or they disagree."""
    if not scaled or max(scaled.values()) - min(scaled.values()) > GROUP_FIT_RTOL * max(scaled.values()):
        return None
    return sum(scaled.values()) / len(scaled)

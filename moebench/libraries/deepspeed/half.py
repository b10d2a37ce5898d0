"""Half precision (fp16, bf16) on DeepSpeed's engine, in small reusable parts (the engine rows use them; so can
any adapter that trains through `deepspeed.initialize`, e.g. AutoEP):

- `cpu_fp16_allowed()`: a context manager: DeepSpeed's CPU fp16 refusal (the accelerator's is_fp16_supported())
  overridden in this (rank) process only, for the block (halfmath.py, so the --repro script overrides it the same
  way), and `CPU_FP16_NOTE`, the one line every fp16 row says;
- `supported_or_skip(precision)`: a bf16 row skips where DeepSpeed's accelerator declares no bf16;
- `fp32_masters(names, engine)`: the float32 master weights the optimizer steps (the update it applied is read
  there; halfmath.py too);
- `GroupSums` / `group_sums`: what the noise model and the factor fits read, per parameter group, every parameter
  counted once over the ranks (one all-reduce);
- `step_judgement(...)`: the noise-model assertions of one step (reported gradient, applied update), or, on a step the
  reference skips on overflow, the assertion that the engine skipped it too; and the per-group view that
  mechanisms.py hands to halfmath.half_reading when one fails (the loss scale never applied or applied twice, a
  clip norm without a parameter group, a loss scale left in the reported gradient, a common factor; else
  `bf16-noise` / `fp16-noise`).

The mathematics (the loss scale over the steps, the one-process reference, reading a common factor) lives in
rowmath.py and halfmath.py, which the standalone --repro script pastes: the tool and the script print the same
figures.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from moebench.libraries.deepspeed import rowmath
from moebench.libraries.deepspeed.halfmath import cpu_fp16_allowed, fp32_masters  # noqa: F401 - this module's API
from moebench.parity import noise
from moebench.parity.compare import Comparison, assertion

GROUPS = rowmath.GROUPS
GRADIENT = "reduced gradient"
UPDATE = "applied update (fp32 masters)"
"""What a half-precision row's noise model judges: the reduced gradient DeepSpeed reports (`safe_get_full_grad`,
divided by the step's loss scale) and the update its optimizer applied to the float32 master weights."""
CPU_FP16_NOTE = "fp16 on CPU (DeepSpeed's fp16 check overridden in each rank): not a GPU run"
"""Said by every fp16 row on CPU (its Row.note: one line at 80 columns), so nobody mistakes it for a GPU run. What is
overridden is the CPU accelerator's `is_fp16_supported()`, which `engine._do_sanity_check` asks ("Type fp16 is not
supported on your device") and ZeRO 0's all-reduce too (cpu_fp16_allowed)."""


# ------------------------------------------------------------------ DeepSpeed on CPU


def supported_or_skip(precision: str) -> None:
    """bf16 needs DeepSpeed's accelerator to declare bf16 (fp16 on CPU: cpu_fp16_allowed)."""
    from deepspeed.accelerator import get_accelerator

    from moebench.parity.registry import SkipCheck

    if precision == "bf16" and not get_accelerator().is_bf16_supported():
        raise SkipCheck(f"DeepSpeed's {get_accelerator().device_name()} accelerator does not support bf16 here")


# ------------------------------------------------------------------ the noise model, per group


@dataclasses.dataclass(frozen=True)
class GroupSums:
    """[sum a*a, sum a*e, sum e*e] per parameter group (rowmath.GROUPS), every parameter once over the ranks."""

    by_group: dict[str, torch.Tensor]

    def total(self) -> torch.Tensor:
        return sum(self.by_group.values(), torch.zeros(3, dtype=torch.float64))

    def as_lists(self) -> dict[str, list[float]]:
        return {g: [float(v) for v in t] for g, t in self.by_group.items()}


def group_sums(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], group_of: dict[str, str],
               weight_of: dict[str, float] | None = None, *, reduce: bool = False) -> GroupSums:
    """Per group, the sums of (actual, expected) pairs by name, each weighted (a parameter that k ranks hold: 1/k);
    `reduce`: summed over the ranks (one all-reduce), so every rank holds the whole model's."""
    stacked = torch.zeros(len(GROUPS), 3, dtype=torch.float64)
    for n, (a, e) in pairs.items():
        stacked[GROUPS.index(group_of[n])] += noise.sums([(a, e)], (weight_of or {}).get(n, 1.0))
    if reduce:
        dist.all_reduce(stacked)
    return GroupSums({g: stacked[i] for i, g in enumerate(GROUPS)})


def judge(tag: str, what: str, run: GroupSums, base: GroupSums, precision: str) -> Comparison:
    """The noise-model assertion of one quantity over the whole model (moebench.parity.noise.judge)."""
    return noise.judge(tag, what, run.total(), base.total(), precision=precision)


def skip_judgement(tag: str, engine_skipped: bool, scale: float, next_scale: float,
                   updates: dict[str, torch.Tensor]) -> list[Comparison]:
    """A step the one-process fp16 run overflows and skips (dynamic loss scaling does so by design): the engine
    must skip it too, applying no update. Passing, the note says so and how the scale moved."""
    moved = f"loss scale {scale:g} -> {next_scale:g}" if next_scale != scale else f"loss scale stays {scale:g}"
    zero = all(not bool(u.any()) for u in updates.values())
    return [assertion(f"{tag}: skipped on overflow (the one-process fp16 run's scaled gradients overflow at loss "
                      f"scale {scale:g}), as dynamic loss scaling does by design", engine_skipped and zero,
                      note=(f"skipped by design: {moved}" if engine_skipped and zero else
                            "the engine applied an update where the scaled gradients overflow"))]


def unexpected_skip(tag: str, scale: float, finite: bool) -> Comparison:
    """The engine skipped a step whose scaled gradients do not overflow on one process (`finite`: whether the
    gradients it reports are finite)."""
    held = ("the scaled gradients it holds are finite" if finite else
            "the scaled gradients it holds are not: a loss scale applied twice overflows this way")
    return assertion(f"{tag}: step applied (the one-process fp16 run's scaled gradients are finite at loss "
                     f"scale {scale:g})", False,
                     note=f"the engine skipped the step: an overflow at loss scale {scale:g} that one process does "
                          f"not see ({held})")


def step_judgement(tag: str, s, *, engine, names: dict, gname: dict, reduced: dict, before: dict,
                   masters: dict | None, ref_step, base_step, scale: float,
                   next_scale: float) -> tuple[list[Comparison], dict | None]:
    """One half-precision step of an engine row on this rank (a collective: every rank calls it): its assertions,
    and what the analysis reads when one fails (None on a skipped step). `reduced`: DeepSpeed's reported gradients
    divided by the step's loss `scale`; `before` / `masters`: the module's parameters and the fp32 masters before the
    step; `ref_step` / `base_step`: the float32 reference's and the one-process same-precision run's step."""
    from moebench.libraries.deepspeed.names import group

    world = dist.get_world_size()
    flags = torch.tensor([1 if getattr(engine, "was_step_applied", lambda: True)() else 0,
                          1 if all(bool(torch.isfinite(g).all()) for g in reduced.values()) else 0])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank takes the same branch (and collectives) below
    applied, finite = int(flags[0]), bool(flags[1])
    after = fp32_masters(names, engine) if masters is not None else None
    moved = ({n: after[n] - masters[n] for n in after} if after is not None else
             {n: p.detach().double() - before[n] for n, p in names.items()})
    group_of = {n: group(gname[n]) for n in names}
    weight = {n: (s.ep_size if group_of[n] == "experts" else 1) / world for n in names}
    ref_group = {n: group(n) for n in ref_step.grad}
    norms = {g: 0.0 for g in GROUPS}
    for n, e in ref_step.grad.items():
        norms[ref_group[n]] += float((e * e).sum())
    view = {"precision": s.precision, "scale": scale, "clip": s.clip, "update": {}, "update_base": {},
            "group_norms": {g: v ** 0.5 for g, v in norms.items()}}
    if base_step.skipped or not applied:
        out = (skip_judgement(tag, not applied, scale, next_scale, moved) if base_step.skipped else
               [unexpected_skip(tag, scale, finite)])
        if not (base_step.skipped and applied):
            return out, None
        # The engine applied a step that overflows on one process: its reported gradient may say why (a loss scale
        # never applied overflows nothing). No finite baseline here: the fit is read to noisemath.GROUP_FIT_RTOL.
        grad = group_sums({n: (g, ref_step.grad[gname[n]]) for n, g in reduced.items()}, group_of, weight,
                          reduce=True)
        exact = group_sums({n: (e, e) for n, e in ref_step.grad.items()}, ref_group)
        return out, {**view, "grad": grad.as_lists(), "grad_base": exact.as_lists()}
    grad = group_sums({n: (g, ref_step.grad[gname[n]]) for n, g in reduced.items()}, group_of, weight, reduce=True)
    grad_base = group_sums({n: (base_step.grad[n], e) for n, e in ref_step.grad.items()}, ref_group)
    out = [judge(tag, GRADIENT, grad, grad_base, s.precision)]
    view.update(grad=grad.as_lists(), grad_base=grad_base.as_lists())
    if after is not None:
        update = group_sums({n: (u, ref_step.update[gname[n]]) for n, u in moved.items()}, group_of, weight,
                            reduce=True)
        update_base = group_sums({n: (base_step.update[n], e) for n, e in ref_step.update.items()}, ref_group)
        out.append(judge(tag, UPDATE, update, update_base, s.precision))
        view.update(update=update.as_lists(), update_base=update_base.as_lists())
    return out, view

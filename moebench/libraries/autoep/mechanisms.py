"""Name the mechanism behind an AutoEP row's FIRST divergence (ZeRO stage, step, group), as the DeepSpeed engine rows
do (libraries/deepspeed/mechanisms.py, whose group sizes and update-factor reading this reuses).

At the first step where anything differs every rank calls `analyse` on what it holds; `combine` picks the earliest
phase over the ranks (premise, loss, reduced gradient, global norm, update) and one sentence:
- vacuous-row: the row's premise fails (its clip does not bind, an expert no token reached);
- forward-differs: the loss differs before any gradient;
- router-detached: the router's reduced gradient is exactly zero while the loss is right: the routing weights
  reach the output without a gradient path back to the router;
- accum-boundary, expert-grad-scale, loss-scale, reduced-grad-wrong: the reduced gradients differ (how);
- global-norm: reduced gradients right, every update scaled by one factor per rank: the clip's global norm
  (and which wrong norm it is, when the numbers tell);
- not-stepped: reduced gradients right, the step leaves some parameters exactly unchanged (not in the optimizer);
- partition-copy-back: reduced gradients right, the applied step or the parameters after it wrong;
- bf16-noise: a bf16 row farther from float32 than the noise model allows, no group scale explaining it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moebench.libraries.autoep.rowmath import group_of, label
from moebench.libraries.deepspeed.mechanisms import GroupSizes
from moebench.libraries.deepspeed.rowmath import common_factors, implied_norm, which_norm
from moebench.parity import noise
from moebench.parity.compare import Comparison
from moebench.parity.diagnose import FIRST_DIVERGENCE, SCALE_FIT_RTOL
from moebench.parity.diagnosis import (
    ACCUM_BOUNDARY,
    BF16_NOISE,
    EXPERT_GRAD_SCALE,
    FORWARD_DIFFERS,
    GLOBAL_NORM,
    LOSS_SCALE,
    NOT_STEPPED,
    PARTITION_COPY_BACK,
    PERMUTATION,
    REDUCED_GRAD_WRONG,
    ROUTER_DETACHED,
    UNEXPLAINED,
    VACUOUS_ROW,
    make,
)

__all__ = ["GroupSizes", "StepView", "analyse", "combine", "first_divergence_comparison"]

SCALE_MATCH_RTOL = 0.02
"""Gradients scaled by one common factor when every fitted factor is within 2 % of the first."""
ALT_RTOL = 1e-4
"""An accumulation alternative matches when within this fraction of the tensor's magnitude."""
PHASES = ("premise", "loss", "reduced gradient", "global norm", "update")
PREMISES = ("clip binds", "every expert gets tokens")
"""What a row asserts of itself (run.py): failing, the row would be vacuous."""


@dataclasses.dataclass(kw_only=True)
class StepView:
    """What one rank holds at the first step that differs (units: parameters, every expert by global index)."""

    settings: dict
    sizes: GroupSizes
    step: int
    rank: int
    comparisons: list
    grads: dict
    """unit -> (reduced gradient read from the engine, reference)."""
    updates: dict
    """unit -> (applied update, reference update)."""
    afters: dict
    """unit -> (parameter after the step, reference's)."""
    wrong: set
    """(phase, unit) pairs whose own comparison failed on this rank: "grad", "update", "after"; ("norm", "")."""
    norm: tuple | None
    """(engine's global gradient norm, reference's) where the engine keeps one."""
    per_slice: list
    """The reference's [slice][micro] gradients (accumulation alternatives)."""
    ref_grad: dict
    ref_norm: float = 0.0

    def own_norm(self) -> float:
        """The reference gradient's norm over this rank's own units (its experts, and every dense parameter)."""
        return sum(float((self.ref_grad[u] ** 2).sum()) for u in self.updates) ** 0.5

    def clip_coef(self) -> float:
        clip = self.settings.get("clip", 0.0)
        return min(1.0, clip / (self.ref_norm + 1e-6)) if clip > 0 else 1.0


def _scale(a: torch.Tensor, e: torch.Tensor) -> float | None:
    """c when a = c x e everywhere (within diagnose.SCALE_FIT_RTOL), else None."""
    ee = float((e * e).sum())
    if ee == 0:
        return None
    c = float((a * e).sum()) / ee
    ok = float((a - c * e).abs().max()) <= SCALE_FIT_RTOL * max(float(a.abs().max()), 1e-30) + 1e-12
    return c if ok else None


def _close(a: torch.Tensor, e: torch.Tensor) -> bool:
    return float((a - e).abs().max()) <= ALT_RTOL * max(float(e.abs().max()), 1e-30)


def _finding(phase: str, name: str, sentence: str, where: str, **details) -> dict[str, Any]:
    return {"phase": PHASES.index(phase), "name": name, "sentence": sentence, "where": where, "details": details}


def analyse(v: StepView) -> dict[str, Any] | None:
    """This rank's finding at the first step that differs (None when nothing differs here)."""
    failed = [c for c in v.comparisons if c.asserted and not c.passed]
    if not failed:
        return None
    tag = f"step {v.step}"
    misplaced = [c for c in failed if " as AutoEP placed it" in c.name]
    if misplaced:
        return _finding("premise", PERMUTATION, f"{len(misplaced)} expert slot(s) on rank {v.rank} do not hold the "
                        f"weights of the global expert AutoEP's placement names (first: {misplaced[0].name}): the "
                        "experts were sliced or placed wrongly", f"{tag}, experts (before training)")
    premise = [c for c in failed if c.name.split(": ", 1)[-1].startswith(PREMISES) and c.max_abs_diff is None]
    if premise:
        return _finding("premise", VACUOUS_ROW, f"{premise[0].name.split(': ', 1)[-1]}: {premise[0].note}",
                        f"{tag}, the row's premise")
    losses = [c for c in failed if ": loss" in c.name]
    vanish = [c for c in failed if " vanishes on both sides" in c.name]
    if vanish and not losses:
        return _finding("reduced gradient", REDUCED_GRAD_WRONG, f"{vanish[0].name.split(': ', 1)[1]}: "
                        f"{vanish[0].note}", f"{tag}, router")
    if losses:
        return _finding("loss", FORWARD_DIFFERS, f"the loss differs before any gradient "
                        f"({losses[0].name.split(': ', 1)[1]}): the model, its weights or its routing differ",
                        f"{tag}, output")
    noisy = [c for c in failed if "bf16 noise model" in c.name]
    if noisy:
        return _bf16_finding(v, noisy[0], tag)
    wrong = {u: ae for u, ae in v.grads.items() if ("grad", u) in v.wrong}
    if wrong:
        return _grad_finding(v, wrong, tag)
    if v.norm is not None and ("norm", "") in v.wrong:
        ratio = v.norm[0] / v.norm[1] if v.norm[1] else float("inf")
        return _finding("global norm", GLOBAL_NORM,
                        f"reduced gradients right; the engine's global gradient norm is {v.norm[0]:.4g} on rank "
                        f"{v.rank}, the reference's {v.norm[1]:.4g} (x {ratio:.4g}): the clip coefficient differs, "
                        "so every update is scaled by it", f"{tag}, all groups", ratio=ratio, engine_norm=v.norm[0],
                        ref_norm=v.norm[1], own_norm=v.own_norm())
    updates = {u: ae for u, ae in v.updates.items() if ("update", u) in v.wrong}
    if not updates:
        return _finding("update", PARTITION_COPY_BACK, f"reduced gradients and updates right, but {failed[0].name} "
                        "differs: the copy back into the module's parameters", f"{tag}, {failed[0].group}")
    return _update_finding(v, updates, tag)


def _accum_alternatives(v: StepView, unit: str) -> dict[str, torch.Tensor]:
    """What the reduced gradient of `unit` is when the accumulation boundary is broken, by mechanism."""
    w, k = v.sizes.world, v.sizes.grad_accum
    if k < 2:
        return {}
    ps, out = v.per_slice, {}
    for m in range(k):
        only = sum(ps[r][m][unit] for r in range(w)) / (w * k)
        out[f"micro-step {m + 1}'s gradient alone (the other micro-steps' never reached the reduction)"] = only
        out[f"micro-step {m + 1}'s gradient reduced twice"] = v.ref_grad[unit] + only
    if group_of(unit) != "experts":
        out["this rank's own micro-steps, never reduced at the boundary"] = sum(ps[v.rank][m][unit]
                                                                               for m in range(k)) / k
    out[f"not divided by grad_accum = {k}"] = v.ref_grad[unit] * k
    out[f"divided by grad_accum = {k} twice"] = v.ref_grad[unit] / k
    return out


def _grad_finding(v: StepView, wrong: dict, tag: str) -> dict[str, Any]:
    groups = sorted({group_of(u) for u in wrong})
    first = next(iter(wrong))
    where = f"{tag}, {'/'.join(groups)} ({label(first)})"
    router = [u for u in wrong if group_of(u) == "router"]
    if router and all(float(wrong[u][0].abs().max()) == 0 and float(wrong[u][1].abs().max()) > 0 for u in router):
        return _finding("reduced gradient", ROUTER_DETACHED,
                        f"the router's reduced gradient ({label(router[0])}) is exactly zero while the loss is right: "
                        "the routing weights reach the output without a gradient path back to the router (detached, "
                        "or gathered by an operation with no backward)", f"{tag}, router ({label(router[0])})")
    for unit, (a, _) in wrong.items():
        for alt, t in _accum_alternatives(v, unit).items():
            if _close(a, t):
                return _finding("reduced gradient", ACCUM_BOUNDARY, f"the reduced gradient of {label(unit)} is "
                                f"{alt}: the gradient accumulation boundary (grad_accum = {v.sizes.grad_accum})",
                                where, alternative=alt)
    scales = [_scale(a, e) for a, e in wrong.values()]
    common = scales[0] if scales and None not in scales and all(
        abs(c - scales[0]) <= SCALE_MATCH_RTOL * abs(scales[0]) for c in scales) else None
    if common is not None and groups == ["experts"]:
        why = v.sizes.explain(common)
        return _finding("reduced gradient", EXPERT_GRAD_SCALE,
                        f"expert gradients scaled by {common:.4g} (dense and router right): "
                        + ("; ".join(why) or f"no group size of this row gives it (world {v.sizes.world}, dp "
                           f"{v.sizes.dp}, ep {v.sizes.ep}, edp {v.sizes.edp})"), where, scale=common,
                        explanations=why)
    if common is not None and len(wrong) == len(v.grads):
        return _finding("reduced gradient", LOSS_SCALE, f"every reduced gradient scaled by {common:.4g}: the loss "
                        "scale (or 1/grad_accum) is not undone, or undone twice", where, scale=common)
    c = next((c for c in v.comparisons if not c.passed and first in c.name), None)
    d = (c.diagnosis if c is not None else None) or {"name": UNEXPLAINED, "sentence": "differs"}
    return _finding("reduced gradient", REDUCED_GRAD_WRONG, f"reduced gradient of {label(first)} wrong "
                    f"({d['name']}: {d['sentence']})", where, diagnosis=d["name"])


def _bf16_finding(v: StepView, failed: Comparison, tag: str) -> dict[str, Any]:
    """A bf16 row outside the noise: a group scaled by one factor is named as in fp32, else the distance."""
    sums = {g: noise.sums(ae for u, ae in v.grads.items() if group_of(u) == g) for g in ("experts", "dense", "router")}
    present = {g for g, s in sums.items() if s[2] > 0}
    scaled, right = noise.scaled_groups({g: sums[g] for g in present})
    if set(scaled) == {"experts"} and right == present - {"experts"}:
        k = scaled["experts"]
        why = v.sizes.explain(k)
        return _finding("reduced gradient", EXPERT_GRAD_SCALE, f"expert gradients scaled by {k:.3g} (bf16; dense and "
                        "router right within the noise): " + ("; ".join(why) or "no group size of this row gives it"),
                        f"{tag}, experts", scale=k, explanations=why)
    k = noise.common_factor(scaled)
    if k is not None and set(scaled) == present:
        return _finding("reduced gradient", LOSS_SCALE, f"every reduced gradient scaled by {k:.3g} (bf16): the loss "
                        "scale (or 1/grad_accum) is not undone, or undone twice", f"{tag}, all groups", scale=k)
    return _finding("reduced gradient", BF16_NOISE, f"{failed.name.split(': ', 1)[1]}: {failed.note}",
                    f"{tag}, all groups")


def _update_finding(v: StepView, wrong: dict, tag: str) -> dict[str, Any]:
    groups = sorted({group_of(u) for u in wrong})
    first = next(iter(wrong))
    where = f"{tag}, {'/'.join(groups)} ({label(first)})"
    still = [u for u, (a, e) in wrong.items() if not a.any() and e.any()]
    if still:  # the step left them exactly as they were
        kinds = sorted({group_of(u) for u in still})
        return _finding("update", NOT_STEPPED, f"reduced gradients right, but the step left {len(still)} parameter(s) "
                        f"of the {'/'.join(kinds)} group(s) unchanged (first: {label(still[0])}): they are not in "
                        "the optimizer's parameter groups, so they never train", where, units=len(still))
    factors = common_factors(v.updates, v.afters, v.sizes.world)
    clip = v.settings.get("clip", 0.0)
    if clip > 0 and factors is not None:
        implied = implied_norm(clip, factors[0], v.clip_coef()) if len(factors) == 1 else None
        return _finding("update", GLOBAL_NORM, f"reduced gradients right; every update on rank {v.rank} is the "
                        f"reference's scaled by one common factor per rank or ZeRO partition "
                        f"({', '.join(f'{f:.4g}' for f in factors)}): the global gradient norm or the clip "
                        "coefficient differs", f"{tag}, all groups", factors=factors, engine_norm=implied,
                        ref_norm=v.ref_norm, own_norm=v.own_norm())
    return _finding("update", PARTITION_COPY_BACK, f"reduced gradients right, applied step wrong in {label(first)}: "
                    "the partitioning or the copy back into the parameters", where)


def combine(findings: list, *, sizes: GroupSizes, zero_stage: int, step: int) -> dict[str, Any]:
    """The row's first divergence from every rank's finding: the earliest phase, then the lowest rank."""
    ranked = [(f["phase"], r, f) for r, f in enumerate(findings) if f is not None]
    if not ranked:
        return make(UNEXPLAINED, f"ZeRO {zero_stage}, step {step}: differs")
    phase, rank, f = min(ranked, key=lambda t: (t[0], t[1]))
    ranks = [r for p, r, g in ranked if p == phase and g["name"] == f["name"]]
    on = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    sentence = f"first divergence at ZeRO {zero_stage}, {f['where']}, on {on}: {f['sentence']}"
    if f["name"] == GLOBAL_NORM:
        same = [g for g in findings if g is not None and g["name"] == GLOBAL_NORM]
        if len(same) == len(findings) and all(g["details"].get("engine_norm") is not None for g in same):
            sentence += which_norm([g["details"]["engine_norm"] for g in same],
                                   [g["details"]["own_norm"] for g in same], same[0]["details"]["ref_norm"])
    return make(f["name"], sentence, **{FIRST_DIVERGENCE: True, "zero_stage": zero_stage, "step": step,
                                        "where": f["where"], "phase": PHASES[phase], "ranks": ranks, **f["details"]})


def first_divergence_comparison(finding: dict, *, rank: int) -> Comparison:
    """The row's first comparison: failed, carrying the finding as its diagnosis."""
    return Comparison(name=f"first divergence: {finding['details'].get('where', '')}", passed=False, rank=rank,
                      kind="equal", note=finding["sentence"], diagnosis=finding)

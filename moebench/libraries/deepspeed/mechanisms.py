"""Name the mechanism behind a DeepSpeed engine row's FIRST divergence (ZeRO stage, step, group).

An engine row (engine.py) compares, per step, the loss, the reduced gradients, the global norm,
the applied updates and the parameters after the step. At the first step where anything differs,
every rank calls `analyse` on what it holds; `combine` picks the earliest phase over the ranks
(loss before gradients before norm before updates) and one sentence per mechanism:

- vacuous-row: the row's premise fails (its clip does not bind, its capacity drops nothing);
- forward-differs: the loss differs before any gradient (the model or its routing differ);
- accum-boundary: the reduced gradient is what a broken accumulation boundary gives (one micro-step's
  gradient missing or reduced twice, or the micro-steps never reduced);
- expert-grad-scale: the expert gradients alone are scaled by k; which group sizes give k;
- loss-scale: every reduced gradient is scaled by one factor (a loss scale left in or applied twice);
- reduced-grad-wrong: reduced gradients differ otherwise (the first one's own diagnosis);
- global-norm: reduced gradients right, every update scaled by one common factor (per ZeRO partition
  or rank): the global gradient norm or the clip coefficient differs;
- partition-copy-back: reduced gradients right, applied step wrong: partitioning or the copy back;
- half precision (bf16, fp16 rows; halfmath.half_reading, one common factor fitted per group before anything is
  called noise): loss-scale-never-applied, loss-scale-twice, loss-scale (left in the reported gradient),
  expert-grad-scale, clip-norm-without-group, global-norm; else bf16-noise / fp16-noise;
- overflow-skip: an fp16 step skipped (or applied) where the one-process fp16 run does not (does) overflow.

The finding becomes the row's first comparison, marked diagnose.FIRST_DIVERGENCE, so the row's
diagnosis headlines it and counts every later difference as its consequence.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moebench.libraries.deepspeed.halfmath import half_reading
from moebench.libraries.deepspeed.names import group as _group
from moebench.libraries.deepspeed.names import label as _label
from moebench.libraries.deepspeed.rowmath import (
    common_factors,
    group_norms,
    implied_norm,
    which_norm,
    without_group,
)
from moebench.parity.compare import Comparison
from moebench.parity.diagnose import FIRST_DIVERGENCE, SCALE_FIT_RTOL
from moebench.parity.diagnosis import (
    ACCUM_BOUNDARY,
    BF16_NOISE,
    CLIP_NORM_WITHOUT_GROUP,
    EXPERT_GRAD_SCALE,
    FORWARD_DIFFERS,
    FP16_NOISE,
    GLOBAL_NORM,
    LOSS_SCALE,
    LOSS_SCALE_NEVER_APPLIED,
    LOSS_SCALE_TWICE,
    OVERFLOW_SKIP,
    PARTITION_COPY_BACK,
    REDUCED_GRAD_WRONG,
    UNEXPLAINED,
    VACUOUS_ROW,
    make,
)

SCALE_MATCH_RTOL = 0.02
"""A fitted factor k names a ratio of group sizes when within 2 % of it (as diagnose.SCALE_INTEGER_RTOL)."""
ALT_RTOL = 1e-4
"""An accumulation alternative matches when within this fraction of the tensor's magnitude."""

PHASES = ("loss", "reduced gradient", "global norm", "update")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupSizes:
    """The process-group sizes of a row: the candidates a scale factor is explained by."""

    world: int
    dp: int
    """Data-parallel size (the engine divides every gradient by it)."""
    ep: int
    """Expert-parallel size."""
    edp: int
    """Expert-data-parallel size (ranks holding the same expert) = W / ep."""
    grad_accum: int

    def explain(self, k: float) -> list[str]:
        """Which group sizes give a gradient k x the right one (divided by one size instead of dp)."""
        named = {"world": self.world, "dp": self.dp, "ep": self.ep, "edp": self.edp}
        out = []
        for name, size in named.items():
            if name not in ("world", "dp") and abs(self.dp / size - k) <= SCALE_MATCH_RTOL * k:
                out.append(f"divided by {name} = {size} instead of dp = {self.dp}")
        for name, size in named.items():
            if name not in ("world", "dp") and size > 1 and abs(1 / size - k) <= SCALE_MATCH_RTOL * k:
                out.append(f"divided by {name} = {size} once too often")
        if abs(k - self.dp) <= SCALE_MATCH_RTOL * k and self.dp > 1:
            out.append(f"summed over dp = world = {self.dp} instead of averaged")
        return out


@dataclasses.dataclass(kw_only=True)
class StepView:
    """What one rank holds at the first step that differs (global parameter names)."""

    settings: dict
    sizes: GroupSizes
    step: int
    rank: int
    comparisons: list
    """This step's comparisons on this rank."""
    grads: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """name -> (reduced gradient read from the engine, reference), where the engine gives one."""
    updates: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """name -> (applied update, reference update)."""
    afters: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """name -> (parameter after the step, reference's)."""
    wrong: set
    """Names whose comparison (with its own tolerance) failed on this rank, as (phase, name) pairs:
    phase "grad", "update" or "after" (and ("norm", "") for the global norm)."""
    norm: tuple[float, float] | None
    """(engine's global gradient norm, reference's), where the engine keeps one."""
    per_slice: list
    """The reference's [slice][micro] gradients (accumulation alternatives)."""
    ref_grad: dict[str, torch.Tensor]
    ref_norm: float = 0.0
    """The reference's global gradient norm (every parameter, each expert once)."""
    half: dict | None = None
    """A half-precision step's per-group sums (half.step_judgement's view), what halfmath.half_reading reads."""

    def own_norm(self) -> float:
        """The reference gradient's norm over this rank's own parameters only (its experts alone)."""
        return sum(float((self.ref_grad[n] ** 2).sum()) for n in self.updates) ** 0.5

    def clip_coef(self) -> float:
        clip = self.settings.get("clip", 0.0)
        return min(1.0, clip / (self.ref_norm + 1e-6)) if clip > 0 else 1.0


def _scale(a: torch.Tensor, e: torch.Tensor) -> float | None:
    """c when a = c x e everywhere (within diagnose.SCALE_FIT_RTOL), else None."""
    ee = float((e * e).sum())
    if ee == 0:
        return None
    c = float((a * e).sum()) / ee
    if float((a - c * e).abs().max()) <= SCALE_FIT_RTOL * max(float(a.abs().max()), 1e-30) + 1e-12:
        return c
    return None


def _close(a: torch.Tensor, e: torch.Tensor) -> bool:
    return float((a - e).abs().max()) <= ALT_RTOL * max(float(e.abs().max()), 1e-30)


def _finding(phase: str, name: str, sentence: str, where: str, **details) -> dict[str, Any]:
    return {"phase": PHASES.index(phase), "name": name, "sentence": sentence, "where": where, "details": details}


def _accum_alternatives(v: StepView, name: str) -> dict[str, torch.Tensor]:
    """What the reduced gradient of `name` is when the accumulation boundary is broken, by mechanism."""
    w, k = v.sizes.world, v.sizes.grad_accum
    if k < 2:
        return {}
    ps = v.per_slice
    out = {}
    for m in range(k):
        only = sum(ps[s][m][name] for s in range(w)) / (w * k)
        out[f"micro-step {m + 1}'s gradient alone (the other micro-steps' never reached the reduction)"] = only
        out[f"micro-step {m + 1}'s gradient reduced twice"] = v.ref_grad[name] + only
    if _group(name) != "experts":  # a replicated parameter's never-reduced gradient is this rank's own
        mine = sum(ps[v.rank][m][name] for m in range(k)) / k
        out["this rank's own micro-steps, never reduced at the boundary"] = mine
        last = sum(ps[s][k - 1][name] for s in range(w)) / (w * k)
        out["the last micro-step reduced, the earlier ones left this rank's own"] = last + sum(
            ps[v.rank][m][name] for m in range(k - 1)) / k
    out[f"not divided by grad_accum = {k}"] = v.ref_grad[name] * k
    out[f"divided by grad_accum = {k} twice"] = v.ref_grad[name] / k
    return out


def analyse(v: StepView) -> dict[str, Any] | None:
    """This rank's finding at the first step that differs (None when nothing differs here)."""
    failed = [c for c in v.comparisons if c.asserted and not c.passed]
    if not failed:
        return None
    tag = f"step {v.step}"
    skips = [c for c in failed if "on overflow" in c.name or "step applied" in c.name]
    if skips:
        why = _half_reading(v)
        if why is not None and why["name"] in (LOSS_SCALE_NEVER_APPLIED, LOSS_SCALE_TWICE):
            return _finding(why["phase"], why["name"], why["sentence"], f"{tag}, all groups", factor=why["factor"])
        return _finding("update", OVERFLOW_SKIP, f"{skips[0].name.split(': ', 1)[-1]}: {skips[0].note}",
                        f"{tag}, all groups")
    setup = [c for c in failed if c.kind == "equal" and "noise model" not in c.name]
    if setup:  # the row's own premise (the clip binds, capacity drops routes) does not hold
        return _finding("loss", VACUOUS_ROW, f"{setup[0].name.split(': ', 1)[-1]}: {setup[0].note}",
                        f"{tag}, the row's premise")
    losses = [c for c in failed if ": loss" in c.name]
    if losses:
        what = losses[0].name.split(": ", 1)[1]
        return _finding("loss", FORWARD_DIFFERS, f"the loss differs before any gradient ({what}): the model, "
                        "its weights or its routing differ", f"{tag}, output")
    noise_failed = [c for c in failed if "noise model" in c.name]
    if noise_failed:
        return _half_finding(v, noise_failed[0], tag)
    wrong = {n: ae for n, ae in v.grads.items() if ("grad", n) in v.wrong}
    if wrong:
        return _grad_finding(v, wrong, tag)
    if v.norm is not None and ("norm", "") in v.wrong:
        ratio = v.norm[0] / v.norm[1] if v.norm[1] else float("inf")
        left_out = without_group(v.norm[0], group_norms(v.ref_grad))
        return _finding("global norm", CLIP_NORM_WITHOUT_GROUP if left_out else GLOBAL_NORM,
                        f"reduced gradients right; the engine's global gradient norm is {v.norm[0]:.4g} on rank "
                        f"{v.rank}, the reference's {v.norm[1]:.4g} (x {ratio:.4g}): the clip coefficient "
                        "differs, so every update is scaled by it" + left_out, f"{tag}, all groups", ratio=ratio,
                        engine_norm=v.norm[0], ref_norm=v.norm[1], own_norm=v.own_norm())
    wrong_updates = {n: ae for n, ae in v.updates.items() if ("update", n) in v.wrong}
    if not wrong_updates:
        other = failed[0]
        return _finding("update", PARTITION_COPY_BACK, f"reduced gradients and updates right, but {other.name} "
                        "differs: the copy back into the module's parameters", f"{tag}, {other.group}")
    return _update_finding(v, wrong_updates, tag, grads_read=bool(v.grads))


def _grad_finding(v: StepView, wrong: dict, tag: str) -> dict[str, Any]:
    groups = sorted({_group(n) for n in wrong})
    first = next(iter(wrong))
    where = f"{tag}, {'/'.join(groups)} ({_label(first)})"
    for name, (a, _) in wrong.items():
        for alt, t in _accum_alternatives(v, name).items():
            if _close(a, t):
                return _finding("reduced gradient", ACCUM_BOUNDARY,
                                f"the reduced gradient of {_label(name)} is {alt}: the gradient accumulation "
                                f"boundary (grad_accum = {v.sizes.grad_accum})", where, alternative=alt)
    scales = {n: _scale(a, e) for n, (a, e) in wrong.items()}
    fitted = [c for c in scales.values() if c is not None]
    common = fitted[0] if fitted and len(fitted) == len(scales) and all(
        abs(c - fitted[0]) <= SCALE_MATCH_RTOL * abs(fitted[0]) for c in fitted) else None
    if common is not None and groups == ["experts"]:
        why = v.sizes.explain(common)
        return _finding("reduced gradient", EXPERT_GRAD_SCALE,
                        f"expert gradients scaled by {common:.4g} (dense and gate right): "
                        + ("; ".join(why) if why else f"no group size of this row gives it (world {v.sizes.world}, "
                           f"dp {v.sizes.dp}, ep {v.sizes.ep}, edp {v.sizes.edp})"),
                        where, scale=common, explanations=why)
    if common is not None and len(wrong) == len(v.grads):
        return _finding("reduced gradient", LOSS_SCALE,
                        f"every reduced gradient scaled by {common:.4g}: the loss scale (or 1/grad_accum) is not "
                        "undone, or undone twice", where, scale=common)
    c = next(c for c in v.comparisons if not c.passed and _label(first) in c.name and "reduced grad" in c.name)
    d = c.diagnosis or {"name": UNEXPLAINED, "sentence": "differs"}
    return _finding("reduced gradient", REDUCED_GRAD_WRONG,
                    f"reduced gradient of {_label(first)} wrong ({d['name']}: {d['sentence']})", where,
                    diagnosis=d["name"])


def _half_reading(v: StepView) -> dict[str, Any] | None:
    """halfmath.half_reading of a half-precision step's view (None without one, or when nothing explains it)."""
    h = v.half
    if not h:
        return None
    as_sums = {k: {g: torch.tensor(t, dtype=torch.float64) for g, t in h.get(k, {}).items()}
               for k in ("grad", "grad_base", "update", "update_base")}
    return half_reading(precision=h["precision"], scale=h["scale"], clip=h["clip"], group_norms=h["group_norms"],
                        **as_sums)


def _half_finding(v: StepView, noise_failed, tag: str) -> dict[str, Any]:
    """A half-precision step the noise model fails: the mechanism one common factor names (halfmath.half_reading),
    with the group sizes that give an expert-only scale; else the distance itself (bf16-noise / fp16-noise)."""
    h = v.half or {}
    reading = _half_reading(v)
    if reading is None:
        name = FP16_NOISE if h.get("precision") == "fp16" else BF16_NOISE
        return _finding("reduced gradient", name, f"{noise_failed.name.split(': ', 1)[1]}: {noise_failed.note}",
                        f"{tag}, all groups")
    details = {k: val for k, val in reading.items() if k not in ("phase", "name", "sentence")}
    if reading["name"] == EXPERT_GRAD_SCALE:
        why = v.sizes.explain(reading["factor"])
        return _finding(reading["phase"], EXPERT_GRAD_SCALE, f"{reading['sentence']}: "
                        + ("; ".join(why) or "no group size of this row gives it"), f"{tag}, experts",
                        scale=reading["factor"], explanations=why)
    return _finding(reading["phase"], reading["name"], reading["sentence"], f"{tag}, all groups", **details)


def _update_finding(v: StepView, wrong: dict, tag: str, *, grads_read: bool) -> dict[str, Any]:
    groups = sorted({_group(n) for n in wrong})
    first = next(iter(wrong))
    where = f"{tag}, {'/'.join(groups)} ({_label(first)})"
    factors = common_factors(v.updates, v.afters, v.sizes.world)
    clip = v.settings.get("clip", 0.0)
    if clip > 0 and factors is not None:
        shown = ", ".join(f"{f:.4g}" for f in factors)
        implied = implied_norm(clip, factors[0], v.clip_coef()) if len(factors) == 1 else None
        return _finding("update", GLOBAL_NORM,
                        ("reduced gradients right; " if grads_read else "")
                        + f"every update on rank {v.rank} is the reference's scaled by one common factor per "
                        f"rank or ZeRO partition ({shown}): the global gradient norm or the clip coefficient differs",
                        f"{tag}, all groups", factors=factors, engine_norm=implied, ref_norm=v.ref_norm,
                        own_norm=v.own_norm())
    if not grads_read:
        scales = {n: _scale(a, e) for n, (a, e) in wrong.items()}
        fitted = [c for c in scales.values() if c is not None]
        if groups == ["experts"] and fitted and len(fitted) == len(scales) and all(
                abs(c - fitted[0]) <= SCALE_MATCH_RTOL * abs(fitted[0]) for c in fitted):
            why = v.sizes.explain(fitted[0])
            return _finding("update", EXPERT_GRAD_SCALE,
                            f"expert updates scaled by {fitted[0]:.4g} (dense and gate right; the reduced gradients "
                            "cannot be read here): " + ("; ".join(why) or "no group size of this row gives it"),
                            where, scale=fitted[0], explanations=why)
    landed = _landed_elsewhere(v.afters, wrong)
    return _finding("update", PARTITION_COPY_BACK,
                    ("reduced gradients right, applied step wrong" if grads_read
                     else "applied step wrong (reduced gradients not readable here)")
                    + f" in {_label(first)}" + (f" ({landed})" if landed else "")
                    + ": the partitioning or the copy back into the parameters", where, landed=landed)


def _landed_elsewhere(afters: dict, wrong: dict) -> str:
    """"A holds B's updated values" when a wrongly updated parameter equals another one's reference."""
    for name in wrong:
        a = afters[name][0]
        for other, (_, e) in afters.items():
            if other != name and e.shape == a.shape and _close(a, e):
                return f"{_label(name)} holds the updated values of {_label(other)}"
    return ""


def combine(findings: list, *, sizes: GroupSizes, zero_stage: int, step: int) -> dict[str, Any]:
    """The row's first divergence from every rank's finding: the earliest phase, then the lowest rank."""
    ranked = [(f["phase"], r, f) for r, f in enumerate(findings) if f is not None]
    if not ranked:  # a rank saw a failure the analysis does not cover (e.g. a non-numeric assertion)
        return make(UNEXPLAINED, f"ZeRO {zero_stage}, step {step}: differs")
    phase, rank, f = min(ranked, key=lambda t: (t[0], t[1]))
    ranks = [r for p, r, g in ranked if p == phase and g["name"] == f["name"]]
    on = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    sentence = f"first divergence at ZeRO {zero_stage}, {f['where']}, on {on}: {f['sentence']}"
    if f["name"] == GLOBAL_NORM:
        sentence += _which_norm([g for g in findings if g is not None and g["name"] == GLOBAL_NORM], len(findings))
    return make(f["name"], sentence, **{FIRST_DIVERGENCE: True, "zero_stage": zero_stage, "step": step,
                                        "where": f["where"], "phase": PHASES[phase], "ranks": ranks, **f["details"]})


def _which_norm(findings: list, world: int) -> str:
    """Which wrong norm the engine used, when every rank's finding tells (a global-norm clause)."""
    if len(findings) != world or any(g["details"].get("engine_norm") is None for g in findings):
        return ""
    return which_norm([g["details"]["engine_norm"] for g in findings], [g["details"]["own_norm"] for g in findings],
                      findings[0]["details"]["ref_norm"])


def first_divergence_comparison(finding: dict, *, rank: int) -> Comparison:
    """The row's first comparison: failed, carrying the finding as its diagnosis."""
    return Comparison(name=f"first divergence: {finding['details'].get('where', '')}", passed=False, rank=rank,
                      kind="equal", note=finding["sentence"], diagnosis=finding)

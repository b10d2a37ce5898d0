"""A half-precision engine row's mathematics, in one place for the tool and its standalone reproduction script: the
loss scale over the steps as DeepSpeed's fp16 section defines it, DeepSpeed's CPU fp16 answer overridden in a rank,
the fp32 master weights the optimizer steps, and the reading of a step the noise model fails by one common factor
per parameter group (the loss scale never applied or applied twice, a clip norm without a group, a loss scale left
in the reported gradient).

Stdlib and torch only (DeepSpeed is imported where it is used): `--repro` pastes this file into the script after
noisemath.py and rowmath.py (libraries/repro), so the script and the tool name the same mechanism with the same
figures (tests/libraries/test_repro.py compares them).
"""

import contextlib
import math

import torch

from moebench.libraries.deepspeed.rowmath import SINGULAR, implied_norm  # @PASTED@ (the script has it above)
from moebench.parity.noisemath import BF16_NOISE_RATIO, GROUP_FIT_RTOL, distance, fit  # @PASTED@ (pasted above)


class LossScaler:
    """fp16's loss scale over a row's steps, as DeepSpeed's fp16 section defines it (the reference's, never read
    from the engine). `loss_scale` > 0: that scale, always. 0: dynamic, starting at 2^initial_scale_power; a step
    whose scaled gradients overflow is skipped; an overflow spends one of `hysteresis` chances and the one that
    spends the last halves the scale (not below min_loss_scale); `loss_scale_window` steps in a row without
    overflow double it and refill the chances (consecutive_hysteresis: every step without overflow refills them).
    bf16 and fp32 rows: 1, never changing."""

    def __init__(self, s) -> None:
        fp16 = s.precision == "fp16"
        self.dynamic = fp16 and s.loss_scale == 0
        self.scale = float(2 ** s.initial_scale_power) if self.dynamic else float(s.loss_scale) if fp16 else 1.0
        self.window, self.hysteresis = s.loss_scale_window, s.hysteresis
        self.consecutive, self.min_scale = s.consecutive_hysteresis, float(s.min_loss_scale)
        self.chances, self.step, self.last_overflow = s.hysteresis, 0, -1

    def update(self, overflow: bool) -> None:
        """After a step: `overflow` says whether its scaled gradients overflowed."""
        if self.dynamic and overflow:
            if self.chances <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.chances -= 1
            self.last_overflow = self.step
        elif self.dynamic:
            if self.consecutive:
                self.chances = self.hysteresis
            stable = self.step - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                self.chances = self.hysteresis
                self.scale *= 2
        self.step += 1


# ------------------------------------------------------------------ DeepSpeed's half precision on CPU


@contextlib.contextmanager
def cpu_fp16_allowed(enabled: bool = True):
    """Within the block, DeepSpeed's CPU accelerator answers that it supports fp16: DeepSpeed asks
    `is_fp16_supported()` (this CPU's mkldnn fp16) in `engine._do_sanity_check` ("Type fp16 is not supported on your
    device") and for the dtypes its ZeRO 0 all-reduce takes, though torch and gloo compute fp16 on any CPU. Only that
    answer is overridden, only in this process (call it in the rank, never the parent), no DeepSpeed file changed;
    an answer set on the accelerator before is restored after. Another accelerator is left as it is."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not enabled or accelerator.device_name() != "cpu":
        yield
        return
    own = vars(accelerator).get("is_fp16_supported")
    accelerator.is_fp16_supported = lambda: True  # an instance attribute shadows the method
    try:
        yield
    finally:
        if own is not None:
            accelerator.is_fp16_supported = own
        else:
            del accelerator.is_fp16_supported


def fp32_masters(names: dict, engine=None) -> dict[str, torch.Tensor] | None:
    """Each parameter's float32 master weight (float64 copies): DeepSpeed's `safe_get_full_fp32_param` (ZeRO 1/2),
    else the unfused fp16 optimizer's own fp32 copies (ZeRO 0, fp16 and bf16: `fp16_groups` / `fp32_groups`);
    None where this release keeps none that can be read."""
    try:
        from deepspeed.utils import safe_get_full_fp32_param
    except ImportError:
        safe_get_full_fp32_param = None
    pairs = {}
    optimizer = getattr(engine, "optimizer", None)
    for low, high in zip(getattr(optimizer, "fp16_groups", ()) or (), getattr(optimizer, "fp32_groups", ()) or ()):
        pairs.update({id(p): q for p, q in zip(low, high)})
    out = {}
    for n, p in names.items():
        master = safe_get_full_fp32_param(p) if safe_get_full_fp32_param is not None else None
        if master is None:
            master = pairs.get(id(p))
        if master is None:
            return None
        out[n] = master.detach().double().clone()
    return out


# ------------------------------------------------------------------ reading a half-precision step
HALF_MATCH_RTOL = 0.02
"""A half-precision common factor names a loss scale mechanism (1/scale, scale) when within 2 % of it: factors are
read to ~0.5 % in bf16, ~0.1 % in fp16 (the noise model's distances), and loss scales are powers of 2 apart."""
DEPARTURE_RTOL = 0.1
"""A clip factor k names a norm when k - 1 is within 10 % of what that norm predicts: measured 1.184 for 1.185
(W = 2) and 1.039 for 1.039 (W = 4) in bf16; a factor near 1 (1.039) needs its departure read, not its value."""
NEVER_APPLIED, APPLIED_TWICE, LEFT_IN = "loss-scale-never-applied", "loss-scale-twice", "loss-scale"
WITHOUT_GROUP, NORM, EXPERTS_SCALED = "clip-norm-without-group", "global-norm", "expert-grad-scale"
"""What half_reading names (moebench.parity.diagnosis holds the same names)."""


def clip_coef(clip: float, norm: float) -> float:
    """DeepSpeed's and the reference's clip coefficient at global norm `norm` (1 without clipping)."""
    return min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= HALF_MATCH_RTOL * abs(b)


def _matches(factor: float, predicted: float) -> bool:
    """A clip factor (near 1) is the predicted one: its departure from 1 within DEPARTURE_RTOL of the predicted."""
    return abs(factor - predicted) <= DEPARTURE_RTOL * abs(predicted - 1) + MIN_SLACK


MIN_SLACK = 1e-3
"""The least a group's factor must differ from another to count (a one-process run with no rounding of its own)."""


def _slack(base) -> float:
    """How far rounding alone moves a group's factor: BF16_NOISE_RATIO x the one-process run's distance (noisemath)."""
    d = distance(base)
    return max(BF16_NOISE_RATIO * d, MIN_SLACK) if math.isfinite(d) else MIN_SLACK


def _common(groups: dict, base: dict) -> tuple[float | None, dict, set]:
    """(the one factor k != 1 every group with a reference shares within its noise, or None; the groups scaled by a
    factor of their own beyond their noise; the groups right within it). k is fitted over every group together,
    so a noisy group (a router whose top-k flips in bf16) agrees with it instead of vetoing it."""
    present = [g for g, t in groups.items() if float(t[2]) > 0]
    if not present:
        return None, {}, set()
    fits = {g: fit(groups[g]) for g in present}
    slack = {g: _slack(base[g]) for g in present}
    single = {g for g in present if fits[g][1] <= max(GROUP_FIT_RTOL, slack[g])}
    right = {g for g in single if abs(fits[g][0] - 1) <= slack[g]}
    scaled = {g: fits[g][0] for g in single - right}
    k = fit(sum(groups[g] for g in present))[0]
    agree = single == set(present) and all(abs(fits[g][0] - k) <= slack[g] * max(1.0, abs(k)) for g in present)
    total = _slack(sum(base[g] for g in present))
    return (k if agree and abs(k - 1) > total and scaled else None), scaled, right


def half_reading(*, precision: str, scale: float, clip: float, grad: dict, grad_base: dict, update: dict,
                 update_base: dict, group_norms: dict) -> dict | None:
    """The mechanism behind a half-precision step that the noise model fails, from per-group sums (noisemath.sums,
    keyed by GROUPS) of the reported gradient (divided by the step's loss scale `scale`) and of the applied update,
    each against the float32 reference, and the same of the one-process run in that precision (`*_base`: the
    noise). `group_norms`: the reference gradient's norm per group. One common factor is fitted before anything is
    called noise; None: no mechanism explains it. Else {"phase", "name", "sentence", "factor", ...}."""
    k, scaled, right = _common(grad, grad_base)
    ku, _, right_u = _common(update, update_base)
    trained = bool(update) and right_u == {g for g, t in update.items() if float(t[2]) > 0}
    if set(scaled) == {"experts"} and right == {g for g, t in grad.items() if float(t[2]) > 0} - {"experts"}:
        return {"phase": "reduced gradient", "name": EXPERTS_SCALED, "factor": scaled["experts"],
                "sentence": f"expert gradients scaled by {scaled['experts']:.3g} ({precision}; dense and gate right "
                            "within the noise)"}
    if k is not None:
        said = f"every reported gradient is {k:.4g} x the reference's"
        if precision == "fp16" and _near(k, 1 / scale):
            return {"phase": "reduced gradient", "name": NEVER_APPLIED, "factor": k, "update_factor": ku,
                    "sentence": f"{said} (x loss scale {scale:g}) = 1/{scale:g}: the loss was never multiplied by "
                                f"the loss scale, yet the step divides by it: every update is 1/{scale:g} of the "
                                "gradient step" + (f", never clipped (the norm read is 1/{scale:g} of the true one)"
                                                   if clip > 0 else "")
                                + (f"; measured: every update x {ku:.4g}" if ku is not None else "")}
        if precision == "fp16" and _near(k, scale):
            return {"phase": "reduced gradient", "name": APPLIED_TWICE, "factor": k, "update_factor": ku,
                    "sentence": f"{said} (x loss scale {scale:g}) = {scale:g}: the loss was multiplied by the "
                                "loss scale twice"}
        return {"phase": "reduced gradient", "name": LEFT_IN, "factor": k,
                "sentence": f"{said} ({precision}): the loss scale (or 1/grad_accum) is not undone, or undone twice"
                            + ("; the update the optimizer applied to the fp32 masters is right within the noise, "
                               "so the training is right and only the gradient DeepSpeed reports "
                               "(safe_get_full_grad) is wrong" if trained else "")}
    if ku is None:
        return None
    full = math.sqrt(sum(n * n for n in group_norms.values()))
    coef = clip_coef(clip, full)
    said = f"every update is {ku:.4g} x the reference's"
    if precision == "fp16" and _near(ku, clip_coef(clip, full / scale) / (scale * coef)):
        return {"phase": "update", "name": NEVER_APPLIED, "factor": ku,
                "sentence": f"{said} (loss scale {scale:g}): the loss scale is divided out but was never applied, "
                            "and clipping never binds"}
    if precision == "fp16" and not _near(scale, 1.0) and _near(ku, scale * clip_coef(clip, full * scale) / coef):
        return {"phase": "update", "name": APPLIED_TWICE, "factor": ku,
                "sentence": f"{said} (loss scale {scale:g}): the loss scale is applied twice"}
    for group, norm in group_norms.items():
        without = math.sqrt(max(full * full - norm * norm, 0.0))
        predicted = clip_coef(clip, without) / coef if clip > 0 and without > 0 else 1.0
        if clip > 0 and abs(predicted - 1) > MIN_SLACK and _matches(ku, predicted):
            return {"phase": "update", "name": WITHOUT_GROUP, "factor": ku, "predicted": predicted, "group": group,
                    "norm": full, "norm_without": without,
                    "sentence": f"{said}; clipping by the norm without the {SINGULAR[group]} gradients "
                                f"({without:.4g}) instead of every parameter's ({full:.4g}) predicts x "
                                f"{predicted:.4g}: the clip norm leaves out the {SINGULAR[group]} gradients"}
    if clip > 0:
        implied = implied_norm(clip, ku, coef)
        return {"phase": "update", "name": NORM, "factor": ku, "engine_norm": implied, "ref_norm": full,
                "sentence": f"{said}: the engine clipped as if the global norm were {implied:.4g}; the reference's "
                            f"is {full:.4g}"}
    return {"phase": "update", "name": LEFT_IN, "factor": ku,
            "sentence": f"{said} ({precision}): a loss scale (or 1/grad_accum) left in, or undone twice"}

"""The mathematics of a DeepSpeed engine row, in one place for the tool and its standalone reproduction script:
the row's sizes, its data, its loss, the engine's config, the one-process reference step, and how an applied
update that is the reference's times a factor is read (the common factors, the norm the engine clipped by).

Stdlib and torch only (DeepSpeed is imported where it is used), as moebench/models/deepspeed_moe.py: `--repro`
pastes both files into the script (libraries/repro), so the script and the tool build the same model from the
same seed, draw the same batches, and print the same figures (tests/libraries/test_repro.py compares them).
"""

import dataclasses
import math
import types

import torch
from torch import nn

from moebench.models.deepspeed_moe import TINY_EXPERT_PREFIX  # @PASTED@ (the script has it: tinymoe)

D_MODEL = 8
D_HIDDEN = 16
EXPERTS_PER_RANK = 1
"""Experts = EXPERTS_PER_RANK x W: one per rank at ep_size = W, W / ep_size per rank below."""
MICRO = (2, 4)
"""(batch, seq) of one micro-batch on one rank."""
LR = 0.1
"""SGD's learning rate: an update (lr x gradient) stands well above the float32 rounding of the
parameters it is read from (checks_engine._update_tolerance)."""
STEPS = 2
"""Optimizer steps per row: the second shows whether the first step's weights were right everywhere."""
AUX_WEIGHT = 0.01
"""Weight of DeepSpeed's load-balancing loss in the training loss (so the gate's gradient includes it)."""
DROPS_CAPACITY_FACTOR = 0.5
"""capacity_factor of a drops row: half of the even share, so some routes are dropped at every step
(asserted in the row)."""


def moe_fields(settings, ep_size: int) -> types.SimpleNamespace:
    """What the DeepSpeed MoE layer of a row is built with (models/deepspeed_moe.DeepSpeedMoEMLP reads these)."""
    return types.SimpleNamespace(d_hidden=D_HIDDEN, ep_size=ep_size, top_k=settings.top_k,
                                 capacity_factor=DROPS_CAPACITY_FACTOR if settings.drop_tokens else 1.0,
                                 eval_capacity_factor=1.0, min_capacity=0, noisy_gate_policy="none",
                                 drop_tokens=settings.drop_tokens, use_rts=False, use_residual=settings.use_residual)


HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""A half-precision row's compute dtype, by its precision."""
FP16_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
             "min_loss_scale")
"""The keys of DeepSpeed's fp16 section a row sets (each a field of the row's settings, of the same name)."""


def engine_config(settings, world: int) -> dict:
    """The DeepSpeed config a row's engine is initialised with."""
    config = {
        "train_batch_size": MICRO[0] * world * settings.grad_accum, "train_micro_batch_size_per_gpu": MICRO[0],
        "gradient_accumulation_steps": settings.grad_accum, "gradient_clipping": settings.clip,
        "zero_optimization": {"stage": settings.zero_stage}, "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    if settings.precision == "bf16":
        config["bf16"] = {"enabled": True}
    if settings.precision == "fp16":
        config["fp16"] = {"enabled": True, **{k: getattr(settings, k) for k in FP16_KEYS}}
    return config


SPIKE = 1000.0
"""An outlier target: in an overflow row's spiked batch one target element is -SPIKE, so the loss's gradient at the
output is ~30 (2 x 1000 / 64 elements) and x the loss scale 2^16 it overflows fp16 (max 65504) by ~30x, while the
other steps' scaled gradients stay 4-8x below it (measured: they overflow from 2^19 on)."""


def batch(seed: int, stage: int, step: int, micro: int, rank: int, settings=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s slice of the global batch of optimizer step `step`, micro-step `micro` (an overflow row's
    spiked step: rank 0's first micro-batch carries the SPIKE target)."""
    g = torch.Generator().manual_seed(seed * 100_003 + 10_000 * stage + 100 * step + 10 * micro + rank)
    x, y = torch.randn(*MICRO, D_MODEL, generator=g), torch.randn(*MICRO, D_MODEL, generator=g)
    if settings is not None and step + 1 == getattr(settings, "overflow_step", 0) and rank == micro == 0:
        y[0, 0, 0] = -SPIKE
    return x, y


def loss_of(model, x, y, multiplier: float = 1.0):
    """MSE plus the MoE's load-balancing loss, times the row's loss multiplier (how a large clip binds)."""
    pred, aux = model(x)
    return (torch.nn.functional.mse_loss(pred.float(), y) + AUX_WEIGHT * aux.float()) * multiplier


@dataclasses.dataclass(kw_only=True)
class RefStep:
    """What the one-process reference computed for one optimizer step (global parameter names)."""

    losses: list[float]
    """Mean loss over the W slices, per micro-step."""
    slice_losses: list[list[float]]
    """[micro][slice] each slice's own loss (each rank's, as the engine computes it)."""
    grad: dict[str, torch.Tensor]
    """The reduced gradient: mean over slices and micro-steps (float64)."""
    per_slice: list[list[dict[str, torch.Tensor]]]
    """[slice][micro] gradient of that slice's loss alone (float64): accumulation alternatives."""
    norm: float
    """Global L2 norm of `grad` over every parameter (each expert once)."""
    coef: float
    """Clip coefficient min(1, clip / (norm + 1e-6)) (1.0 without clipping)."""
    update: dict[str, torch.Tensor]
    """-lr x coef x grad."""
    dropped: int
    """Routes dropped at capacity over every slice and micro-step."""
    routes: int
    """Routes requested over every slice and micro-step."""
    overflow: bool = False
    """A gradient of the scaled loss was not finite (a half-precision `compute` model's only)."""
    skipped: bool = False
    """No update was applied: the step overflowed (loss scaling skips it by design)."""


def reference_step(ref: nn.Module, s, world: int, seed: int, step: int, *,
                   compute: nn.Module | None = None, loss_scale: float = 1.0, skip: bool = False) -> RefStep:
    """One step of the reference on this process: every slice of every micro-step through the
    ep_size = 1 model, the gradient averaged as DeepSpeed's data parallelism defines it, clipped by the
    global norm, SGD applied to `ref` in place. `compute`: a low-precision copy that computes the
    gradients from `ref`'s weights (copied into it first, inputs cast to its dtype) while `ref` keeps the
    float32 master weights (mixed precision on one process: the half-precision noise model's baseline); with
    `loss_scale` it backpropagates the loss x loss_scale / grad_accum (as DeepSpeed's fp16 does) and divides the
    gradients back in float64, and a gradient that is not finite in `compute`'s dtype is an overflow: the step is
    then skipped. `skip`: apply no update (the mixed-precision run skipped this step on overflow)."""
    params = dict(ref.named_parameters())
    model, dtype = ref, torch.float32
    if compute is not None:
        model, dtype = compute, next(compute.inp.parameters()).dtype
        with torch.no_grad():
            for n, p in compute.named_parameters():
                p.copy_(params[n])
    used = dict(model.named_parameters())
    per_slice: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(world)]
    losses, slice_losses, dropped, routes, overflow = [], [], 0, 0, False
    for m in range(s.grad_accum):
        total = 0.0
        slice_losses.append([])
        for r in range(world):
            x, y = batch(seed, s.zero_stage, step, m, r, s)
            loss = loss_of(model, x.to(dtype), y, s.loss_multiplier)
            scale = loss_scale / s.grad_accum if compute is not None else 1.0
            grads = torch.autograd.grad(loss * scale if scale != 1.0 else loss, list(used.values()),
                                        allow_unused=True)
            overflow = overflow or any(g is not None and not bool(torch.isfinite(g).all()) for g in grads)
            per_slice[r].append({n: (g.double() / scale if g is not None else torch.zeros_like(p, dtype=torch.float64))
                                 for (n, p), g in zip(used.items(), grads)})
            total += float(loss.detach())
            slice_losses[-1].append(float(loss.detach()))
            last = model.moe.last
            dropped, routes = dropped + last.dropped, routes + last.routes
        losses.append(total / world)
    grad = {n: sum(per_slice[r][m][n] for r in range(world) for m in range(s.grad_accum)) / (world * s.grad_accum)
            for n in params}
    norm = math.sqrt(sum(float((g * g).sum()) for g in grad.values()))
    coef = min(1.0, s.clip / (norm + 1e-6)) if s.clip > 0 and math.isfinite(norm) else 1.0
    skipped = skip or overflow
    update = {n: (torch.zeros_like(g) if skipped else -LR * coef * g) for n, g in grad.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.add_(update[n].to(p.dtype))
    return RefStep(losses=losses, slice_losses=slice_losses, grad=grad, per_slice=per_slice, norm=norm, coef=coef,
                   update=update, dropped=dropped, routes=routes, overflow=overflow, skipped=skipped)


# ------------------------------------------------------------------ reading an update scaled by one factor
RATIO_ULPS = 2000
"""Update ratios actual / expected are read only where |expected| >= RATIO_ULPS float32 ulps of the
tensor's largest |parameter|: an update is read as after - before of float32 parameters (~1 ulp of
rounding), so there the ratio's noise stays <= 1/2000 = 5e-4, a quarter of CLUSTER_RTOL."""
CLUSTER_RTOL = 2e-3
"""Two update ratios belong to one common factor when within 0.2 % of each other: 4x the ratio noise
(RATIO_ULPS); the clip coefficients of different ranks differ by >= 1 % in every case seen."""
def common_factors(updates: dict, afters: dict, world: int) -> list[float] | None:
    """The distinct factors actual / expected of every update element (at most `world` of them, each a
    tight cluster), or None when the updates are not piecewise one factor."""
    ratios = []
    for name, (a, e) in updates.items():
        before = afters[name][0] - a
        keep = e.abs() >= RATIO_ULPS * torch.finfo(torch.float32).eps * float(before.abs().max())
        if bool(keep.any()):
            ratios.append((a[keep] / e[keep]).flatten())
    if not ratios:
        return None
    rho, _ = torch.sort(torch.cat(ratios))
    clusters, start = [], 0
    for i in range(1, len(rho) + 1):
        if i == len(rho) or abs(float(rho[i] - rho[i - 1])) > CLUSTER_RTOL * abs(float(rho[i - 1])):
            clusters.append(rho[start:i])
            start = i
    if len(clusters) > world:
        return None
    factors = [float(c.mean()) for c in clusters]
    if all(abs(f - 1.0) <= CLUSTER_RTOL for f in factors):
        return None
    return factors


def implied_norm(clip: float, factor: float, clip_coef: float) -> float:
    """The global norm an engine clipped by, when its update is the reference's x `factor` (the reference's clip
    coefficient `clip_coef`): clip / (norm + 1e-6) = factor x clip_coef."""
    return clip / (factor * clip_coef) - 1e-6


NORM_MATCH_RTOL = 1e-3
"""An engine's global norm (read, or implied by its clip factor) matches a candidate norm within 0.1 %:
clip factors are read to ~5e-4 (CLUSTER_RTOL / 4), candidates differ by >= 1 % in every case seen."""


GROUPS = ("experts", "gate", "dense")
"""The parameter groups: the experts, the gate, every other (replicated) one."""
SINGULAR = {"experts": "expert", "gate": "gate", "dense": "dense"}


def param_group(name: str) -> str:
    """The group of a parameter's (global) name: "experts", "gate" or "dense" (every other, replicated one)."""
    if name.startswith(TINY_EXPERT_PREFIX):
        return "experts"
    return "gate" if ".gate." in name else "dense"


def group_norms(grad: dict) -> dict[str, float]:
    """The norm of a gradient (by global name) over each group's parameters."""
    squares = {"experts": 0.0, "gate": 0.0, "dense": 0.0}
    for name, g in grad.items():
        squares[param_group(name)] += float((g.double() ** 2).sum())
    return {k: math.sqrt(v) for k, v in squares.items()}


def without_group(norm: float, norms: dict[str, float]) -> str:
    """The clause naming the group a norm leaves out, when `norm` is the norm of every group's but one within
    NORM_MATCH_RTOL ("" when it is not)."""
    full = math.sqrt(sum(n * n for n in norms.values()))
    for group, n in norms.items():
        rest = math.sqrt(max(full * full - n * n, 0.0))
        if n > 0 and abs(norm - rest) <= NORM_MATCH_RTOL * rest:
            return (f"; that is the norm of every gradient but the {SINGULAR[group]} ones ({rest:.4g}): the clip norm "
                    f"leaves out the {SINGULAR[group]} gradients")
    return ""


def which_norm(engine: list[float], own: list[float], ref: float) -> str:
    """Which wrong norm the engine used, from every rank's norm (read, or implied by its clip factor), each rank's
    own-parameter norm of the reference's gradient and the reference's global norm: a clause ("" when none fits)."""

    def near(a: float, b: float) -> bool:
        return abs(a - b) <= NORM_MATCH_RTOL * abs(b)

    mean_own = sum(own) / len(own)
    if all(near(e, mean_own) for e in engine) and not near(mean_own, ref):
        return (f"; the engine's norm {engine[0]:.4g} is the MEAN over ranks of each rank's own-parameter norm "
                f"(its own experts only), not the norm over every parameter ({ref:.4g}, each expert once)")
    if all(near(e, o) for e, o in zip(engine, own)) and not all(near(o, ref) for o in own):
        return (f"; each rank's norm ({', '.join(f'{e:.4g}' for e in engine)}) is its own parameters' alone, "
                f"not the norm over every parameter ({ref:.4g})")
    if not all(near(e, engine[0]) for e in engine):
        return (f"; the ranks disagree on the global norm ({', '.join(f'{e:.4g}' for e in engine)}): each used a "
                f"norm of its own, not the one over every parameter ({ref:.4g})")
    return ""

"""A bf16 Megatron row, on every rank: megatron-core in bf16 (bf16 parameters and activations, gradients reduced in
float32, its mixed-precision optimizer's float32 masters) through the same DDP, finalize_model_grads and Adam with
clipping as the float32 rows, judged by the noise model (moebench.parity.noise).

In bf16 every element differs from float32 by rounding, so each step judges, per group, one relative L2 distance from
the float32 truth (reference.py in float32, from the same bf16-rounded weights) over the whole model, every piece of a
parameter counted once over the ranks that hold it: the output, the router's gradient, the experts' (by global index),
the shared expert's, the input gradient, the gradient norm the optimizer clips by, and the weights after the step.
Each must be at most BF16_NOISE_RATIO x the distance of the same mathematics in bf16 on one process (reference.py in
bfloat16: its routing, experts and gradients in bf16, its masters and AdamW in float32). A group outside the noise
is read as one factor (`uniform-scale`, x W named), else named `bf16-noise` with its fitted factor; the norm against
the known-wrong norms of parity.py. No `--repro` script: a per-element script would be wrong here.
"""

from __future__ import annotations

import math
from typing import Any

from moebench.libraries.megatron import step
from moebench.libraries.megatron.parity import STEPS, Wrong, group_of, in_row, rank_table
from moebench.libraries.megatron.reference import Reference
from moebench.libraries.spec import Row
from moebench.parity import noise
from moebench.parity.diagnosis import (
    BF16_NOISE,
    EXPERTS,
    INPUT_GRAD,
    OUTPUT,
    REPLICATED,
    ROUTER,
    UNIFORM_SCALE,
    make,
)

WORDS = {ROUTER: "router", EXPERTS: "expert", REPLICATED: "shared-expert"}


def run(ctx, row: Row, opts) -> list:
    """The row on this rank (parity.in_row: the stand-ins, eager, quiet)."""
    with in_row():
        return _run(ctx, row.settings.fields(), opts)


def _holders(held: dict) -> dict[tuple[str, str], int]:
    """(unit, slice) -> how many ranks hold that piece (all-gathered)."""
    import torch.distributed as dist

    mine = sorted({(p.unit, repr(p.index)) for pieces in held.values() for p in pieces})
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    counts: dict[tuple[str, str], int] = {}
    for keys in every:
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
    return counts


def _run(ctx, settings: dict, opts) -> list:
    import torch
    import torch.distributed as dist

    r, w, seed = ctx.rank, ctx.world_size, opts.seed
    mrun = step.build(settings, seed, w)
    sizes, ranks = mrun.sizes, mrun.ranks
    table = rank_table(ranks)
    holders = _holders(mrun.held)
    values = {n: v.to(torch.bfloat16).float() for n, v in step.initial_values(settings, seed).items()}
    kwargs = dict(seq=step.SEQ, micro=step.MICRO, lr=step.LR, betas=step.ADAM_BETAS, eps=step.ADAM_EPS,
                  weight_decay=step.WEIGHT_DECAY, clip=step.CLIP)
    truth = Reference(settings, values, **kwargs)
    base = Reference(settings, values, dtype=torch.bfloat16, **kwargs)
    out: list = []
    for k in range(STEPS):
        tag = f"step {k + 1}"
        x_all, t_all = step.batch(settings, seed, k, w)
        x_all = x_all.to(torch.bfloat16).float()  # the run's inputs are bf16: the truth takes the same values
        before = {name: v.detach().clone() for name, v in truth.params.items()}
        rec = step.train_step(mrun, seed, k, w)
        res, bres = truth.step(x_all, t_all, sizes["tp"], sizes["dp"]), base.step(x_all, t_all, sizes["tp"],
                                                                                   sizes["dp"])

        def mine(t):
            return step.chunk(t, ranks["tp"], ranks["dp"], sizes["tp"])

        scale = step.SEQ * step.MICRO * sizes["dp"] if settings.get("per_token") else sizes["dp"]
        io = torch.stack([noise.sums([(rec.output, mine(res.output))]),
                          noise.sums([(rec.input_grad, mine(res.input_grad) * scale)])])
        groups = (ROUTER, EXPERTS, REPLICATED)
        run_grads = {g: torch.zeros(3, dtype=torch.float64) for g in groups}
        run_after = {g: torch.zeros(3, dtype=torch.float64) for g in groups}
        for name, held in mrun.held.items():
            for piece in held:
                weight = 1.0 / holders[(piece.unit, repr(piece.index))]
                g = group_of(piece.unit)
                run_grads[g] += noise.sums([(piece.view(rec.grads[name]), res.grads[piece.unit][piece.index])],
                                           weight)
                run_after[g] += noise.sums([(piece.view(rec.params[name]), res.values[piece.unit][piece.index])],
                                           weight)
        for s in (io, *run_grads.values(), *run_after.values()):
            dist.all_reduce(s)
        base_grads = {g: noise.sums([(bres.grads[u], res.grads[u]) for u in res.grads if group_of(u) == g])
                      for g in groups}
        base_after = {g: noise.sums([(bres.values[u].to(torch.bfloat16).float(), res.values[u])  # bf16 params
                                     for u in res.values if group_of(u) == g]) for g in groups}
        out.append(noise.judge(tag, "output", io[0], noise.sums([(bres.output, res.output)]), rank=r, group=OUTPUT))
        for g in groups:
            if base_grads[g][2] == 0:  # no shared expert in this model
                continue
            judged = noise.judge(tag, f"{WORDS[g]} gradient", run_grads[g], base_grads[g], rank=r, group=g)
            if not judged.passed:
                judged.diagnosis = _diagnosis(g, judged, run_grads[g], base_grads[g], w)
            out.append(judged)
        if rec.grad_norm is not None:
            out.append(_norm(tag, rec.grad_norm, _gathered(mrun.held, rec.grads), r, w,
                             Wrong(truth, before, None, settings, sizes, ranks, table, x_all, t_all)))
        out.append(noise.judge(tag, "input grad", io[1], noise.sums([(bres.input_grad, res.input_grad)]), rank=r,
                               group=INPUT_GRAD))
        for g in groups:
            if base_after[g][2] == 0:
                continue
            out.append(noise.judge(tag, f"{WORDS[g]} weights after Adam", run_after[g], base_after[g], rank=r,
                                   group=g))
    return out


def _gathered(held: dict, grads: dict) -> dict:
    """Every unit's gradient as this run holds it after finalize_model_grads: each rank's pieces, all-gathered."""
    import torch
    import torch.distributed as dist

    mine = [(p.unit, p.index, p.view(grads[name]).clone()) for name, pieces in held.items() for p in pieces]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    shapes = _units_of(every)
    full = {unit: torch.zeros(shape) for unit, shape in shapes.items()}
    for pieces in every:
        for unit, index, value in pieces:
            full[unit][index] = value
    return full


def _norm(tag: str, norm: float, grads: dict, r: int, w: int, wrong: Wrong):
    """The norm Megatron's optimizer clips by against the norm of the gradients this run holds (each piece once):
    which gradients the norm counts is exact arithmetic whatever the precision; a mismatch is named by the known-wrong
    norm it matches (parity.Wrong.norm_alternatives, from those same gradients)."""
    import torch

    from moebench.parity.compare import STRICT, compare

    expected = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    what = f"{tag}: gradient norm (Megatron's optimizer) = the norm of the gradients it holds"
    c = compare(what, torch.tensor([norm]), torch.tensor([expected]), STRICT, rank=r, world_size=w, group=REPLICATED)
    if not c.passed:
        c = compare(what, torch.tensor([norm]), torch.tensor([expected]), STRICT, rank=r, world_size=w,
                    group=REPLICATED, alternatives=wrong.norm_alternatives(grads))
    return c


def _diagnosis(group: str, judged, run, baseline, w: int) -> dict[str, Any]:
    """A group outside the noise: the truth scaled by one factor (x W named), else the distance with its fit."""
    found = noise.fit(run)
    if found is not None and found[1] <= noise.GROUP_FIT_RTOL:
        c = found[0]
        n = round(c) if round(c) >= 2 and abs(c - round(c)) <= noise.GROUP_FIT_RTOL * c else None
        why = f": summed instead of averaged over {w} ranks (the world size)" if n == w else ""
        return make(UNIFORM_SCALE, f"bf16: {WORDS[group]} gradients scaled by {c:.3g}{why}", scale=c, integer=n)
    fitted = f"x{found[0]:.3g} (residual {100 * found[1]:.0f} %)" if found else "no reference"
    base = noise.distance(baseline)
    return make(BF16_NOISE, f"{judged.name.split(': ', 1)[1]} ({judged.note}); fitted: {fitted}",
                fit=list(found) if found else None, distance=noise.distance(run),
                baseline=None if math.isinf(base) else base)


def _units_of(every: list) -> dict[str, tuple[int, ...]]:
    """The full shape of each unit some rank holds a piece of (from the pieces' slices and values)."""
    shapes: dict[str, list[int]] = {}
    for pieces in every:
        for unit, index, value in pieces:
            dims = shapes.setdefault(unit, [0] * value.dim())
            for axis, (sl, n) in enumerate(zip(index, value.shape)):
                dims[axis] = max(dims[axis], (sl.start or 0) + n if sl.stop is not None or sl.start else n)
    return {u: tuple(d) for u, d in shapes.items()}

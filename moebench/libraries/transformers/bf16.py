"""A transformers bf16 row, on every rank: the expert-parallel model loaded in bf16, one forward and backward of the
global batch, judged by the noise model (moebench.parity.noise) against the float32 block on one process."""

from __future__ import annotations

from typing import Any

from moebench.libraries.spec import Row
from moebench.libraries.transformers.api import BLOCK, distributed_config, shares_batch
from moebench.libraries.transformers.build import (
    batch,
    block_output,
    copy,
    experts_held,
    full,
    is_expert,
    local,
    quiet,
    shape_of,
    state_dict,
)
from moebench.libraries.transformers.parity import every_expert_routed, param_group
from moebench.parity import noise
from moebench.parity.compare import assertion
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

_OLD_NAMES = {EXPERTS: "experts", ROUTER: "router", REPLICATED: "rest"}
"""A group's name in the diagnosis details (what the JSON has always said)."""


def _ORDER(group: str) -> str:  # noqa: N802 - a sort key
    """Groups in the order the sentences name them: by their name in the details."""
    return _OLD_NAMES[group]


GROUP_WORDS = {EXPERTS: "expert", ROUTER: "router", REPLICATED: "other"}
"""How a parameter group of a bf16 row is named in a sentence ("expert gradients scaled by 2")."""


def diagnosis_of(groups: dict, baseline: dict, judged, world_size: int) -> dict[str, Any]:
    """What a bf16 gradient farther from float32 than the noise model allows is: a group scaled by one factor
    (named as in float32: expert gradients x W are `uniform-scale`), else the distance and each group's fit."""
    present = {g for g, s in groups.items() if s[2] > 0}
    scaled, right = noise.scaled_groups({g: groups[g] for g in present}, baseline)
    k = noise.common_factor(scaled)
    if k is not None and right == present - set(scaled):
        integer = round(k) if round(k) >= 2 and abs(k - round(k)) <= noise.GROUP_FIT_RTOL * k else None
        why = f": summed instead of averaged over {world_size} ranks (the world size)" if integer == world_size else ""
        named = ", ".join(GROUP_WORDS[g] for g in sorted(right, key=_ORDER))
        rest = f" ({named} right within the noise)" if right else ""
        return make(UNIFORM_SCALE, f"bf16: {' and '.join(GROUP_WORDS[g] for g in sorted(scaled, key=_ORDER))} "
                    f"gradients scaled by {k:.3g}{rest}{why}", integer=integer, scale=k,
                    groups=[_OLD_NAMES[g] for g in sorted(scaled, key=_ORDER)])
    fits = {g: noise.fit(groups[g]) for g in sorted(present, key=_ORDER)}
    shown = ", ".join(f"{GROUP_WORDS[g]} x{c:.3g} (residual {100 * resid:.0f} %)" for g, (c, resid) in fits.items())
    return make(BF16_NOISE, f"{judged.name.split(': ', 1)[1]} ({judged.note}); fitted per group: {shown}",
                fits={_OLD_NAMES[g]: list(f) for g, f in fits.items()})


def run(ctx, row: Row, opts) -> list:
    """The row on this rank, with transformers' progress bars, info logs and warnings off the console."""
    with quiet():
        return _run(ctx, row, opts)


def _run(ctx, row: Row, opts) -> list:
    """A bf16 row: the expert-parallel model loaded in bf16 (`dtype=torch.bfloat16`), one forward and backward
    of the global batch, judged by the noise model (moebench.parity.noise) against the float32 block on one
    process: the output, every parameter's gradient (each expert once over the ranks) and the input gradient,
    each at most BF16_NOISE_RATIO x the distance of the same block in bf16 on one process from float32."""
    import torch
    import torch.distributed as dist

    r, w = ctx.rank, ctx.world_size
    shape = shape_of(row)
    model_cls, config = shape.model_cls, shape.config()
    state = state_dict(model_cls, config, opts.seed, shape, w)
    models = [model_cls.from_pretrained(None, config=config, state_dict=copy(state),
                                        experts_implementation=row.backend, **extra)
              for extra in ({}, {"dtype": torch.bfloat16},
                            {"dtype": torch.bfloat16, "distributed_config": distributed_config(row)})]
    ref, base, par = (m.train().get_submodule(BLOCK) for m in models)  # `models` keeps the whole models alive
    shared = shares_batch(row)
    n = shape.seqs_per_rank
    rows = slice(None) if shared else slice(r * n, (r + 1) * n)
    share = 1 / w if shared else 1.0  # every rank holds the whole shared batch: counted once over the ranks
    x_all, t_all = batch(opts.seed, 0, w, shape)

    def forward_backward(block, x, t, dtype):
        x = x.detach().to(dtype).clone().requires_grad_(True)
        y = block_output(block, x)
        ((y.float() * t).sum() / t[..., 0].numel()).backward()  # mean over the tokens this process holds
        return y.detach().float(), x.grad.float()

    y_ref, gx_ref = forward_backward(ref, x_all, t_all, torch.float32)
    y_base, gx_base = forward_backward(base, x_all, t_all, torch.bfloat16)
    y_par, gx_par = forward_backward(par, x_all[rows], t_all[rows], torch.bfloat16)
    scale = 1 if shared else w  # a rank's input gradient is of its own loss: W x the global mean's
    out, missing = ([every_expert_routed(ref, shape, x_all, r)] if shape.user else []), []
    ref_params, base_params = dict(ref.named_parameters()), dict(base.named_parameters())
    run = {g: torch.zeros(3, dtype=torch.float64) for g in (EXPERTS, ROUTER, REPLICATED)}
    baseline = {g: torch.zeros(3, dtype=torch.float64) for g in run}
    for name, p in par.named_parameters():
        g, ref_grad = param_group(name), ref_params[name].grad
        baseline[g] += noise.sums([(base_params[name].grad, ref_grad)])
        if p.grad is None:
            missing.append(name)
        elif is_expert(name):  # each local slot against the global expert the layout says it holds
            held, weights = local(p.grad), local(p.detach())
            for i, e in enumerate(experts_held(p, shape.num_experts)):
                if not torch.equal(weights[i], base_params[name].detach()[e]):  # bf16 weights: equal
                    missing.append(f"{name}[local {i}]")
                else:
                    run[g] += noise.sums([(held[i], ref_grad[e])])
        else:
            run[g] += noise.sums([(full(p.grad), ref_grad)], 1 / w)
    sums = torch.stack([noise.sums([(y_par, y_ref[rows])], share), noise.sums([(gx_par, gx_ref[rows] * scale)], share),
                        *run.values()])
    dist.all_reduce(sums)
    y_run, gx_run, *grads = sums
    run = dict(zip(run, grads))
    out.append(assertion("every parameter has a gradient and every local expert is one of the reference's",
                         not missing, rank=r, group=EXPERTS, note=f"missing: {', '.join(missing)}" if missing else ""))
    out.append(noise.judge("step 1", "output", y_run, noise.sums([(y_base, y_ref)]), rank=r, group=OUTPUT))
    judged = noise.judge("step 1", "parameter gradient", sum(run.values()), sum(baseline.values()), rank=r,
                         group=REPLICATED)
    if not judged.passed:
        judged.diagnosis = diagnosis_of(run, baseline, judged, w)
    out.append(judged)
    out.append(noise.judge("step 1", "input grad", gx_run, noise.sums([(gx_base, gx_ref)]), rank=r,
                           group=INPUT_GRAD))
    return out

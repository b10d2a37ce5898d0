"""An Automodel row, on every rank: the row's model with `apply_ep` over the W ranks against the same model on one
process (deep-copied before `apply_ep`, so the same weights), STEPS SGD steps with the trainer's gradient convention.

Per step, as `recipes/llm/train_ft.py` does it: each rank's loss is the sum over its tokens / the global token count,
`(loss * dp).backward()`; the plain (non-expert) gradients are averaged over the ranks (FSDP's reduce-scatter does
this in the trainer; FSDP itself is not applied here), then `scale_grads_and_clip_grad_norm` divides the expert
gradients by dp / ep_shard; clip rows then clip with Automodel's own `clip_grad_norm` and the EP mesh (the trainer
does both in one call; two calls let the gradients be compared before the clip). The reference: the global batch
on one process, loss = the global sum / the global token count, torch's clip_grad_norm_ on clip rows.

Compared (strict float32): the output, the router's gradient, every expert's gradient by its GLOBAL index, the
other parameters' gradients, the input gradient (block rows), the clip norm (clip rows), the loss curve and every
weight after the steps. A failure is checked against what known-wrong gathers would give (diagnose's
`alternatives`), so the mechanism is named in Automodel's terms.
"""

from __future__ import annotations

import copy
from typing import Any

from moebench.libraries.automodel import api
from moebench.libraries.spec import Row
from moebench.parity.diagnosis import EXPERTS, INPUT_GRAD, OUTPUT, REPLICATED, ROUTER, VACUOUS_ROW, make

STEPS = 3
LR = 0.1
DETACHED_WHERE = "in Automodel: GroupedExperts gathers them over the EP ranks with differentiable=False"
UNREDUCED_WHERE = "_AllGatherConcatVarlenFn.backward, GroupedExperts' EP all-gather"
NORM_WHERE = "training.utils.clip_grad_norm: the norm was not reduced over the EP mesh"


def param_group(name: str, expert_params: set[str]) -> str:
    """A parameter's group: the experts (sharded by apply_ep), the router (the MoE block's `gate`), the rest."""
    return EXPERTS if name in expert_params else ROUTER if ".gate." in f".{name}" else REPLICATED


def _batch(row: Row, seed: int, step: int, w: int):
    """(inputs, targets) of the global batch at `step`, rank-major: rank r holds rows [r * n, (r + 1) * n)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + step)
    if row.model == "block":
        n = w * api.TOKENS_PER_RANK
        return torch.randn(n, api.HIDDEN, generator=g), torch.randn(n, api.HIDDEN, generator=g)
    n = w * api.SEQS_PER_RANK
    return (torch.randint(api.VOCAB, (n, api.SEQ_LEN), generator=g),
            torch.randint(api.VOCAB, (n, api.SEQ_LEN), generator=g))


def _per_rank(row: Row) -> int:
    return api.TOKENS_PER_RANK if row.model == "block" else api.SEQS_PER_RANK


def _forward(model, row: Row, inputs):
    out = model(inputs)
    return out if row.model == "block" else getattr(out, "logits", out)


def _loss(row: Row, out, targets, tokens: int):
    """The sum over the tokens given of each token's loss, / the global token count (the trainer's normalisation)."""
    import torch.nn.functional as F

    if row.model == "block":  # a weighted sum of the outputs: terms of both signs
        return (out * targets).sum() / tokens
    return F.cross_entropy(out.reshape(-1, api.VOCAB).float(), targets.reshape(-1), reduction="sum") / tokens


def _own_rank_only(experts, tokens_per_rank: int, w: int) -> None:
    """Make the one-process `experts` give each token's input and routing weights gradient only through the
    experts of its own rank (what an all-gather backward without its all-reduce gives); the output is unchanged."""
    import torch

    per_rank = api.NUM_EXPERTS // w
    plain = experts.forward

    def forward(x, token_mask, weights, indices):
        owner = (torch.arange(x.shape[0]) // tokens_per_rank)[:, None]
        own = (indices // per_rank) == owner
        skip = torch.full_like(indices, -1)  # an expert id no expert matches: the slot adds nothing
        live = plain(x, token_mask, weights, torch.where(own, indices, skip))
        return live + plain(x.detach(), token_mask, weights.detach(), torch.where(own, skip, indices)).detach()

    experts.forward = forward


def _wrong(ref, row: Row, w: int, inputs, targets, tokens: int) -> tuple[Any, dict[str, Any]]:
    """(input gradient, {parameter: gradient}) of a copy of the reference whose experts' gradient reaches each token
    through its own rank's experts only."""
    from nemo_automodel.components.moe.layers import MoE

    wrong = copy.deepcopy(ref)
    wrong.zero_grad(set_to_none=True)
    moe = next(m for m in wrong.modules() if isinstance(m, MoE))
    tokens_per_rank = api.TOKENS_PER_RANK if row.model == "block" else api.SEQS_PER_RANK * api.SEQ_LEN
    _own_rank_only(moe.experts, tokens_per_rank, w)
    x = inputs.clone().requires_grad_(True) if row.model == "block" else inputs
    _loss(row, _forward(wrong, row, x), targets, tokens).backward()
    return (x.grad if row.model == "block" else None), {n: p.grad for n, p in wrong.named_parameters()}


def run(ctx, row: Row, opts) -> list:
    """The row on this rank, eager (TORCH_COMPILE), with the deprecation warnings of Automodel's all_reduce and
    transformers' config off the console."""
    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    torch.compiler.set_stance("force_eager")  # this rank only: ranks are forked per row
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # Automodel reads config.torch_dtype, which transformers 5 calls deprecated
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_reduce is deprecat")
            return _run(ctx, row, opts)
    finally:
        hf_logging.set_verbosity(level)


def _run(ctx, row: Row, opts) -> list:
    """Every rank: the row's model under apply_ep vs one process, STEPS SGD steps (module docstring)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from moebench.parity.compare import SEED_ALLCLOSE_DEFAULT, STRICT, assertion, compare, of_terms, pick
    from moebench.parity.layout import ExpertLayout

    tol, asserted = pick(opts.tolerance, strict=STRICT, seed=SEED_ALLCLOSE_DEFAULT)
    r, w = ctx.rank, ctx.world_size
    max_norm = row.settings.max_grad_norm
    model, _ = api.build(row.model, row.backend, opts.seed)
    ref = copy.deepcopy(model)  # the same weights, on this process alone
    mesh = api.ep_mesh(w)
    api.apply_ep(model, mesh)
    layout = ExpertLayout(api.NUM_EXPERTS, w)
    mine = layout.experts_of(r)
    ref_params = dict(ref.named_parameters())
    params = dict(model.named_parameters())
    expert_params = {n for n, p in params.items() if isinstance(p, DTensor)}
    order = sorted(params, key=lambda n: (param_group(n, expert_params) != ROUTER, n not in expert_params))
    out: list = []

    def cmp(name, actual, expected, group, **kw):
        c = compare(name, actual, expected, tol, rank=r, asserted=asserted, world_size=w, group=group, **kw)
        out.append(c)
        return c

    for name in sorted(expert_params):  # each local slot holds the global expert the layout says, with its weights
        held = params[name].to_local().detach()
        wrong = [i for i, e in enumerate(mine) if not torch.equal(held[i], ref_params[name].detach()[e])]
        out.append(assertion(f"{name}: local slots hold experts {mine[0]}-{mine[-1]}", not wrong, rank=r,
                             group=EXPERTS, note=f"local slots {wrong} hold other weights" if wrong else ""))

    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, foreach=False)
    n = _per_rank(row)
    rows = slice(r * n, (r + 1) * n)
    curve, ref_curve, terms = [], [], 0.0
    for step in range(STEPS):
        inputs, targets = _batch(row, opts.seed, step, w)
        tokens = targets.shape[0] if row.model == "block" else targets.numel()
        x = inputs[rows].clone().requires_grad_(True) if row.model == "block" else inputs[rows]
        y = _forward(model, row, x)
        loss = _loss(row, y, targets[rows], tokens)
        (loss * w).backward()  # train_ft: (local_loss * dp_group_size).backward()
        never = []
        for name in params:  # FSDP's part, emulated: the plain gradients averaged over the ranks
            p = params[name]
            if name in expert_params or not p.requires_grad:
                continue
            if p.grad is None:  # every rank joins the all-reduce; the row says it never arrived
                never.append(name)
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad.div_(w)
        api.scale_grads(model, mesh, w)
        xr = inputs.clone().requires_grad_(True) if row.model == "block" else inputs
        yr = _forward(ref, row, xr)
        ref_loss = _loss(row, yr, targets, tokens)
        ref_loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the global loss: the sum of the ranks' shares
        curve.append(float(total))
        ref_curve.append(float(ref_loss.detach()))
        terms = max(terms, float((yr.detach() * targets).abs().sum() / tokens) if row.model == "block"
                    else float(ref_loss.detach()))
        if step == 0:
            _first_step(out, cmp, row, w, r, rows, y, yr, x, xr, model, ref, params, ref_params, expert_params, order,
                        mine, never, inputs, targets, tokens, mesh, max_norm)
        elif max_norm is not None:
            api.clip_grad_norm(model, mesh, max_norm)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    out.append(compare(f"loss curve ({STEPS} SGD steps)", torch.tensor(curve), torch.tensor(ref_curve),
                       of_terms(tol, terms), rank=r, asserted=asserted, world_size=w, group=OUTPUT))
    for name in order:
        p, e_ref = params[name], ref_params[name].detach()
        if name in expert_params:
            held = p.to_local().detach()
            for i, e in enumerate(mine):
                cmp(f"{name}[expert {e}] after {STEPS} SGD steps", held[i], e_ref[e], EXPERTS)
        else:
            cmp(f"{name} after {STEPS} SGD steps", p.detach(), e_ref, param_group(name, expert_params))
    return out


def _first_step(out, cmp, row, w, r, rows, y, yr, x, xr, model, ref, params, ref_params, expert_params, order, mine,
                never, inputs, targets, tokens, mesh, max_norm) -> None:
    """Step 1's comparisons: output, gradients before the clip (router, experts, the rest, the input), then the clip
    norm and the clip itself (clip rows)."""
    import math

    import torch

    from moebench.parity.compare import assertion
    from moebench.parity.diagnose import gather_backward_unreduced, per_rank_norm, router_detached, scaled_experts_norm

    wrong_x, wrong_grads = _wrong(ref, row, w, inputs, targets, tokens)

    def alternatives(name: str | None):
        t = wrong_x[rows] * w if name is None else wrong_grads.get(name)
        return {"own-rank experts only": gather_backward_unreduced(t, UNREDUCED_WHERE)} if t is not None else {}

    output = cmp("output", y.detach(), yr.detach()[rows], OUTPUT)
    squares = torch.zeros(3, dtype=torch.float64)  # this rank's [all, experts] and the reference's experts
    for name in order:
        p, group = params[name], param_group(name, expert_params)
        ref_grad = ref_params[name].grad
        if name in expert_params:
            held = p.grad.to_local()
            squares[:2] += float(held.double().square().sum())
            for i, e in enumerate(mine):
                cmp(f"grad {name}[expert {e}]", held[i], ref_grad[e], EXPERTS)
            squares[2] += float(ref_grad.double().square().sum())
            continue
        if ref_grad is None and (p.grad is None or name in never):
            continue
        ref_grad = torch.zeros_like(p) if ref_grad is None else ref_grad
        squares[0] += float(p.grad.double().square().sum())
        c = cmp(f"grad {name}", p.grad, ref_grad, group, alternatives=alternatives(name),
                note="no gradient reached it (None)" if name in never else "")
        if group == ROUTER and output.passed:
            router_detached(c, DETACHED_WHERE)
    if row.model == "block":  # a rank's input gradient is of its own loss x dp: W x the global mean's
        cmp("input grad", x.grad, xr.grad[rows] * w, INPUT_GRAD, alternatives=alternatives(None))
    if max_norm is None:
        return
    ref_total = math.sqrt(sum(float(p.grad.double().square().sum()) for p in ref.parameters() if p.grad is not None))
    premise = assertion(f"the clip binds: the reference's norm {ref_total:.4g} > max_grad_norm {max_norm:g}",
                        ref_total > max_norm, rank=r, group=REPLICATED)
    if not premise.passed:
        premise.diagnosis = make(VACUOUS_ROW, "the clip row's premise fails: its clip does not bind")
    out.append(premise)
    norm = api.clip_grad_norm(model, mesh, max_norm)
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
    rest = ref_total ** 2 - float(squares[2])  # the reference's non-expert share of the squared norm
    cmp(f"clip norm (training.utils.clip_grad_norm, max_grad_norm {max_norm:g})", torch.tensor(norm),
        torch.tensor(ref_norm), REPLICATED,
        alternatives={"per-rank norm": per_rank_norm(torch.tensor(math.sqrt(float(squares[0]))), NORM_WHERE),
                      "experts x W": scaled_experts_norm(torch.tensor(math.sqrt(rest + w * w * float(squares[2]))),
                                                         w)})

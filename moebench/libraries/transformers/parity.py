"""A transformers float32 row, on every rank: the row's model under its expert parallelism against the same model on
one process, STEPS SGD steps; each failure checked against known-wrong references of the block, so a match is
named (moebench.parity.diagnose's `alternatives`). And the row's standalone reproduction script's settings.
"""

from __future__ import annotations

from typing import Any

from moebench.libraries.repro import fill
from moebench.libraries.spec import Row
from moebench.libraries.transformers.api import BLOCK, distributed_kwargs, shares_batch
from moebench.libraries.transformers.build import (
    LR,
    OUTPUT,
    STEPS,
    Shape,
    batch,
    block_output,
    build,
    experts_held,
    full,
    is_expert,
    local,
    quiet,
    shape_of,
)
from moebench.parity import diagnosis
from moebench.parity.diagnosis import (
    EXPERTS,
    INPUT_GRAD,
    MISSING_BACKWARD_EXCHANGE,
    REPLICATED,
    ROUTER,
    SCORES_MISPAIRED,
)
from moebench.parity.diagnosis import OUTPUT as OUTPUT_GROUP


def param_group(name: str) -> str:
    """A block parameter's group: its experts, its router (the gate; GPT-OSS's router), or the rest (shared
    experts, ...)."""
    return EXPERTS if is_expert(name) else ROUTER if name.split(".")[0] in ("gate", "router") else REPLICATED


# What two known-wrong expert-parallel implementations would give, so a failure that matches one is named
# (moebench.parity.diagnose's `alternatives`): label -> what the implementation does.
RANK_LOCAL = ("rank-local gradient", "a router gradient never all-reduced over the ranks: each rank's "
              "routing weights get gradient only through the experts it holds (AllReduceEP's backward "
              "all-reduce of top_k_weights missing)")
NO_BACKWARD_EXCHANGE = ("missing backward exchange", "an all-to-all with no backward: the gradient through "
                        "the experts never returns to the rank holding the token (input gradient through "
                        "the router only)")

UNROUTED_SLOTS = "router gradient from unrouted slots"
"""all_reduce mode: a rank's routes to other ranks' experts (sentinel slots) run through its last local expert
(batched_mm clamps the sentinel id in-bounds) weighted by a zero that hides them in the forward only
(huggingface/transformers#48687); the entry's description comes from moebench.parity.diagnose.unrouted_slots."""

RANK_LOCAL_AND_UNROUTED = "rank-local gradient with unrouted slots"
"""Both mechanisms at once, where they interact (their errors do not add): the routing weights' gradient is
all-reduced at the experts' input, so each slot collects every rank's sentinel leak, then the router's mask keeps
only this rank's own slots and the gate's gradient is never all-reduced (transformers 5.16's all_reduce EP, whose
install_forward never passes is_expert_parallel)."""

SWAPPED_SCORES = ("scores paired wrong", "routing weights paired with the wrong experts: each token's top-k "
                  "weights applied to its selected experts in the wrong order")


def _wrong_references(ref, row: Row, rank: int, x_all, t_all,
                      shape: Shape) -> dict[str, tuple[Any, dict[str, Any]]]:
    """label -> (input gradient, {parameter: gradient}) of the one-process block made wrong on purpose,
    on copies of it (the reference itself is untouched)."""
    import copy

    import torch

    out: dict[str, tuple[Any, dict[str, Any]]] = {}

    def run(block, label):
        x = x_all.clone().requires_grad_(True)
        y = block_output(block, x)
        ((y * t_all).sum() / t_all[..., 0].numel()).backward()
        grads = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
        out[label] = (x.grad, {**grads, OUTPUT: y.detach()})

    swapped = copy.deepcopy(ref)
    swapped.get_submodule(shape.router).register_forward_hook(
        lambda module, args, output: (output[0], output[1].flip(-1), output[2]))
    run(swapped, SWAPPED_SCORES[0])
    cut = copy.deepcopy(ref)
    cut.experts.register_forward_pre_hook(lambda module, args: (args[0].detach(), *args[1:]))
    run(cut, NO_BACKWARD_EXCHANGE[0])
    if row.ep_mode == "all_reduce":
        local = copy.deepcopy(ref)
        per_rank = shape.num_experts // row.world_size

        def routes_local_only(module, args, output):
            logits, weights, index = output
            off_rank = (index // per_rank) != rank
            return logits, weights.detach().where(off_rank, weights), index

        local.get_submodule(shape.router).register_forward_hook(routes_local_only)
        run(local, RANK_LOCAL[0])
        leaky, both = copy.deepcopy(ref), copy.deepcopy(ref)

        def sentinel_slots_in_router_grad(module, args, output):
            hidden, index, weights = args[:3]
            if weights.shape != index.shape:
                return output
            for other in range(row.world_size):  # each rank's sentinel slots, summed by the backward all-reduce
                off_rank = (index // per_rank) != other
                last = torch.full_like(index[:, :1], (other + 1) * per_rank - 1)
                clamped = module.forward(hidden.detach(), last, torch.ones_like(weights[:, :1])).detach()
                output = output + ((weights - weights.detach()) * off_rank).sum(-1, keepdim=True) * clamped
            return output

        leaky.experts.register_forward_hook(sentinel_slots_in_router_grad)
        run(leaky, UNROUTED_SLOTS)
        # Both at once, which do not add: the off-rank slots' weights are cut (rank-local), so the leak only
        # reaches this rank's own slots, from the other ranks' sentinel slots (their backward all-reduce sums it in).
        both.get_submodule(shape.router).register_forward_hook(routes_local_only)
        both.experts.register_forward_hook(sentinel_slots_in_router_grad)
        run(both, RANK_LOCAL_AND_UNROUTED)
    return out


def every_expert_routed(block, shape: Shape, x, rank: int):
    """The assertion that every expert gets tokens from the global batch, read off the one-process block's router
    (its third output: each token's top-k expert ids), never the library's."""
    import torch

    from moebench.parity.compare import assertion

    with torch.no_grad():
        index = block.get_submodule(shape.router)(x.detach().reshape(-1, shape.hidden))[2]
    routes = torch.bincount(index.reshape(-1), minlength=shape.num_experts)
    none = (routes == 0).nonzero().flatten().tolist()
    return assertion(f"every expert gets tokens (routes per expert: {int(routes.min())} to {int(routes.max())})",
                     not none, rank=rank, group=ROUTER,
                     note=f"experts {none[:12]}{' ...' if len(none) > 12 else ''} get none: their comparisons would "
                     "be vacuous" if none else "")


def run(ctx, row: Row, opts) -> list:
    """The row on this rank, with transformers' progress bars, info logs and warnings off the console."""
    with quiet():
        return _run(ctx, row, opts)


def _run(ctx, row: Row, opts) -> list:
    """Every rank: the row's block under its expert parallelism vs the one-process block, STEPS SGD steps."""
    import torch
    import torch.distributed as dist

    from moebench.parity.compare import SEED_ALLCLOSE_DEFAULT, STRICT, assertion, compare, of_terms, pick
    from moebench.parity.diagnose import together, unrouted_slots

    tol, asserted = pick(opts.tolerance, strict=STRICT, seed=SEED_ALLCLOSE_DEFAULT)
    r, w = ctx.rank, ctx.world_size
    shape = shape_of(row)
    ref, _model, par = build(row, opts.seed, shape)
    shared = shares_batch(row)
    n = shape.seqs_per_rank
    rows = slice(None) if shared else slice(r * n, (r + 1) * n)
    ref_params = dict(ref.named_parameters())
    out: list = []

    def cmp(name, actual, expected, group, **kw):
        out.append(compare(name, actual, expected, tol, rank=r, asserted=asserted, world_size=w, group=group, **kw))

    experts: dict[str, list[int]] = {}
    for name, p in par.named_parameters():
        if is_expert(name):  # each local slot holds the global expert the layout says, with its weights
            experts[name] = experts_held(p, shape.num_experts)
            held = local(p.detach())
            wrong = [i for i, e in enumerate(experts[name]) if not torch.equal(held[i], ref_params[name].detach()[e])]
            out.append(assertion(f"{name}: every local expert is one of the reference's", not wrong, rank=r,
                                 group=EXPERTS, note=f"local slots {wrong} do not hold the weights of experts "
                                 f"{[experts[name][i] for i in wrong]}" if wrong else ""))

    opt = torch.optim.SGD(par.parameters(), lr=LR, foreach=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, foreach=False)
    curve, ref_curve, terms = [], [], 0.0
    for step in range(STEPS):
        x_all, t_all = batch(opts.seed, step, w, shape)
        x = x_all[rows].clone().requires_grad_(True)
        y = block_output(par, x)
        loss = (y * t_all[rows]).sum() / t_all[rows][..., 0].numel()  # mean over the tokens this rank holds
        loss.backward()
        xr = x_all.clone().requires_grad_(True)
        if step == 0 and shape.user:  # the row's premise: every expert gets tokens (else its comparisons are vacuous)
            out.append(every_expert_routed(ref, shape, xr, r))
        yr = block_output(ref, xr)
        ref_loss = (yr * t_all).sum() / t_all[..., 0].numel()  # mean over every token of the global batch
        ref_loss.backward()
        terms = max(terms, float((yr.detach() * t_all).abs().sum() / t_all[..., 0].numel()))  # of both signs
        total = loss.detach().clone()
        if not shared:  # the global loss: the mean over ranks of the rank losses
            dist.all_reduce(total)
            total /= w
        curve.append(float(total))
        ref_curve.append(float(ref_loss.detach()))
        if step == 0:
            wrong = _wrong_references(ref, row, r, x_all, t_all, shape)
            # each known-wrong reference under the diagnosis name every adapter and check uses
            named = ((NO_BACKWARD_EXCHANGE, MISSING_BACKWARD_EXCHANGE), (RANK_LOCAL, diagnosis.RANK_LOCAL),
                     (SWAPPED_SCORES, SCORES_MISPAIRED))
            described: dict[str, Any] = {label: (what, name, "") for (label, what), name in named}
            described[UNROUTED_SLOTS] = unrouted_slots(None, "the last local expert: batched_mm clamps the "
                                                       "sentinel id in-bounds")[1:]
            described[RANK_LOCAL_AND_UNROUTED] = together(
                None, ("a gate gradient left rank-local", diagnosis.RANK_LOCAL),
                ("the other ranks' unrouted slots leaking into this rank's own", diagnosis.UNROUTED_SLOTS),
                "batched_mm runs a sentinel slot through the last local expert, whose output its zero weight hides "
                "in the forward only; the routing weights' backward all-reduce sums that leak from every rank into "
                "each slot, the router's mask keeps this rank's own slots, and the gate's gradient is never "
                "all-reduced")[1:]

            def alternatives(param: str | None, scale: float = 1.0) -> dict[str, Any]:
                found = {}
                for label, (input_grad, grads) in wrong.items():
                    t = input_grad[rows] * scale if param is None else grads.get(param)
                    t = t[rows] if param == OUTPUT and t is not None else t
                    if t is not None:
                        entry = described[label]  # a description, or (what, diagnosis name, cause)
                        found[label] = (t, *entry) if isinstance(entry, tuple) else (t, entry)
                return found

            cmp("output", y.detach(), yr.detach()[rows], OUTPUT_GROUP, alternatives=alternatives(OUTPUT))
            for name, p in par.named_parameters():
                ref_grad = ref_params[name].grad
                if p.grad is None:
                    out.append(assertion(f"grad {name}", False, rank=r, group=param_group(name),
                                         note="no gradient reached it (None)"))
                    continue
                if name in experts:
                    held = local(p.grad)
                    for i, e in enumerate(experts[name]):
                        cmp(f"grad {name}[expert {e}]", held[i], ref_grad[e], EXPERTS)
                else:
                    cmp(f"grad {name}", full(p.grad), ref_grad, param_group(name), alternatives=alternatives(name))
            # After the parameters' gradients, so that a wrong router gradient (which also bends the input
            # gradient through the router) is the first failure named, not its consequence.
            # A rank's input gradient is of its own loss: W x the global mean's when it holds 1/W of the batch.
            scale = 1 if shared else w
            cmp("input grad", x.grad, xr.grad[rows] * scale, INPUT_GRAD, alternatives=alternatives(None, scale))
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    out.append(compare(f"loss curve ({STEPS} SGD steps)", torch.tensor(curve), torch.tensor(ref_curve),
                       of_terms(tol, terms), rank=r, asserted=asserted, world_size=w, group=OUTPUT_GROUP))
    for name, p in par.named_parameters():
        if name in experts:
            held = local(p.detach())
            for i, e in enumerate(experts[name]):
                cmp(f"{name}[expert {e}] after {STEPS} SGD steps", held[i], ref_params[name].detach()[e], EXPERTS)
        else:
            cmp(f"{name} after {STEPS} SGD steps", full(p.detach()), ref_params[name].detach(), param_group(name))
    return out


def repro_script(row: Row, seed: int) -> str:
    """The standalone script of a float32 row (libraries/repro, template transformers_moe.py)."""
    shape = shape_of(row)
    settings = {"config_class": shape.config_cls.__name__, "model_class": shape.model_cls.__name__,
                "config": shape.kwargs, "backend": row.backend, "distributed": distributed_kwargs(row),
                "shares_batch": shares_batch(row), "world_size": row.world_size, "seed": seed, "steps": STEPS,
                "lr": LR, "block": BLOCK, "seqs_per_rank": shape.seqs_per_rank, "seq_len": shape.seq_len}
    return fill("transformers_moe", settings, key=row.key())

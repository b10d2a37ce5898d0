"""Check 9 `moe-expert-parallel`: the fastmoe-style layer (`run fastmoe`'s reference backend)
with its experts spread over the ranks vs one process holding all of them.

One process: FMoEReference(num_expert=E) on the global batch. W ranks: FMoEReference(num_expert
= E / W, world_size = W) loaded with the same weights (`shard_state_dict`), each rank on its slice
of the batch, slots exchanged by all-to-all, gradients made global by `sync_gradients`.
Compared on every rank over 2 SGD steps: outputs, input gradients, the gate's gradients and each
local expert's gradients (vs the matching global expert), and the weights after each step.
Loss on rank r: a weighted mean of its outputs (fixed random weights, so a misrouted gradient
cannot cancel out); the one process descends the same weights' mean over the global batch.
The gate's rows are rescaled to equal norm and each rank's first tokens are steered at its own
experts, so every expert receives slots and no expert gradient is a vacuous zero-vs-zero.

--impl moe=pkg.mod:Class replaces the layer (FMoEReference's constructor: num_expert, d_model,
d_hidden, world_size, top_k; same state_dict keys); --impl moe-sync=pkg.mod:fn replaces the
gradient synchronisation fn(model) (default expert_parallel.sync_gradients).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moebench.parity.compare import SEED_ALLCLOSE_DEFAULT, STRICT, compare, pick
from moebench.parity.diagnose import no_backward_exchange, rank_local, unrouted_slots
from moebench.parity.layout import ExpertLayout
from moebench.parity.registry import Check, CheckOptions, SkipCheck, impl_or_default, register

D_MODEL = 8
D_HIDDEN = 16
TOP_K = 2
EXPERTS_PER_RANK = 2
TOKENS_PER_RANK = 16  # equal on every rank (global mean = mean of rank means); enough that every expert gets slots
STEPS = 2
LR = 0.5
TOKEN_SCALE = 4.0  # |randn(8)| ~ 2.8: a steered token dominates its gate logits


def _first(out):
    """The layer's output (layers may return (y, aux_loss))."""
    return out[0] if isinstance(out, tuple) else out


def dense_reference(params: dict, x: torch.Tensor, experts: int, top_k: int,
                    detached: frozenset[int] = frozenset()) -> torch.Tensor:
    """The MoE layer as plain math: NaiveGate top-k softmax, every expert on every token, mix.

    The outputs of the experts in `detached` keep their values but pass no gradient back (what an
    exchange without a backward leaves: only the gate's path differentiates)."""
    logits = F.linear(x, params["gate.gate.weight"], params.get("gate.gate.bias"))
    top_val, top_idx = logits.topk(top_k, dim=-1)
    score = top_val.softmax(dim=-1)
    outs = []
    for e in range(experts):
        h = F.gelu(F.linear(x, params[f"experts.{e}.htoh4.weight"][0], params[f"experts.{e}.htoh4.bias"][0]))
        out = F.linear(h, params[f"experts.{e}.h4toh.weight"][0], params[f"experts.{e}.h4toh.bias"][0])
        outs.append(out.detach() if e in detached else out)
    every = torch.stack(outs, dim=1)  # (tokens, experts, d_model)
    picked = every.gather(1, top_idx[..., None].expand(-1, -1, every.shape[-1]))
    return (score[..., None] * picked).sum(dim=1)


def _input_grad(params: dict, x: torch.Tensor, weights: torch.Tensor, experts: int,
                detached: frozenset[int]) -> torch.Tensor:
    """d(this rank's loss)/dx with the experts in `detached` passing no gradient back."""
    x = x.detach().clone().requires_grad_(True)
    loss = (dense_reference(params, x, experts, TOP_K, detached) * weights).mean()
    return torch.autograd.grad(loss, x)[0]


def _unrouted_slot_grads(params: dict, x_all: torch.Tensor, weights: torch.Tensor, experts: int,
                         world_size: int) -> tuple[torch.Tensor, dict]:
    """(input gradient, {parameter: gradient}) of the global mean loss when each rank's router also
    collects gradient from its tokens' slots whose expert lives on another rank: such a slot runs through
    the rank's last local expert (a sentinel clamped in-bounds) with a score that is zero in the forward
    only. The output is unchanged; the gate gets <output grad, that expert's output> for those slots."""
    x = x_all.detach().clone().requires_grad_(True)
    logits = F.linear(x, params["gate.gate.weight"], params.get("gate.gate.bias"))
    top_val, top_idx = logits.topk(TOP_K, dim=-1)
    score = top_val.softmax(dim=-1)
    home = torch.arange(x.shape[0]) // TOKENS_PER_RANK
    off_rank = (top_idx // EXPERTS_PER_RANK) != home[:, None]
    sentinel = {r: r * EXPERTS_PER_RANK + EXPERTS_PER_RANK - 1 for r in range(world_size)}
    h = {e: F.gelu(F.linear(x, params[f"experts.{e}.htoh4.weight"][0], params[f"experts.{e}.htoh4.bias"][0]))
         for e in sentinel.values()}
    out = {e: F.linear(h[e], params[f"experts.{e}.h4toh.weight"][0], params[f"experts.{e}.h4toh.bias"][0]).detach()
           for e in h}
    leaked = torch.stack([out[sentinel[int(r)]][i] for i, r in enumerate(home)])
    zero_in_forward_only = ((score - score.detach()) * off_rank).sum(-1, keepdim=True)
    y = dense_reference(params, x, experts, TOP_K) + zero_in_forward_only * leaked
    names = list(params)
    grads = torch.autograd.grad((y * weights).mean(), [x] + [params[n] for n in names], allow_unused=True)
    return grads[0], {n: torch.zeros_like(params[n]) if g is None else g for n, g in zip(names, grads[1:])}


def _rank_loss_grads(params: dict, x: torch.Tensor, weights: torch.Tensor, experts: int) -> dict:
    """The gradient of every parameter from this rank's own tokens and loss alone (never all-reduced)."""
    names = list(params)
    loss = (dense_reference(params, x.detach(), experts, TOP_K) * weights).mean()
    grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
    return {n: torch.zeros_like(params[n]) if g is None else g for n, g in zip(names, grads)}


def _rank(ctx, opts: CheckOptions) -> list:
    try:
        from moebench.distributed import expert_parallel
        from moebench.models.moe.layer import FMoEReference
    except ImportError as exc:
        raise SkipCheck(f"the fastmoe-style layer is not available: {exc}") from None
    layer_cls, label = impl_or_default(opts, "moe", FMoEReference)
    sync, sync_label = impl_or_default(opts, "moe-sync", expert_parallel.sync_gradients)
    # No seed has this check; seed mode uses torch.allclose defaults, like the chapter's other seeds.
    tol, asserted = pick(opts.tolerance, strict=STRICT, seed=SEED_ALLCLOSE_DEFAULT)
    r, w = ctx.rank, ctx.world_size
    experts = EXPERTS_PER_RANK * w
    layout = ExpertLayout(experts, w)  # rank r holds experts r*n .. r*n+n-1
    torch.manual_seed(opts.seed)
    # moebench's layer only as the holder of the reference weights (fastmoe's init and keys);
    # the reference forward is the dense math below, independent of any implementation.
    holder = FMoEReference(num_expert=experts, d_model=D_MODEL, d_hidden=D_HIDDEN, top_k=TOP_K)
    gate_weight = dict(holder.named_parameters())["gate.gate.weight"]
    with torch.no_grad():  # equal-norm gate rows: token c * row_e then picks expert e first
        gate_weight /= gate_weight.norm(dim=1, keepdim=True)
    local = layer_cls(num_expert=EXPERTS_PER_RANK, d_model=D_MODEL, d_hidden=D_HIDDEN, top_k=TOP_K,
                      world_size=w)
    local.load_state_dict(expert_parallel.shard_state_dict(holder.state_dict(), r, EXPERTS_PER_RANK))
    single_params = dict(holder.named_parameters())
    rows = slice(r * TOKENS_PER_RANK, (r + 1) * TOKENS_PER_RANK)
    results = []
    for step in range(STEPS):
        prefix = f"step {step + 1}"
        g = torch.Generator().manual_seed(opts.seed * 1000 + step)
        x_all = torch.randn(w * TOKENS_PER_RANK, D_MODEL, generator=g)
        weights = torch.randn(w * TOKENS_PER_RANK, D_MODEL, generator=g)
        # Every expert gets at least one slot (an expert with no tokens has an all-zero gradient,
        # and comparing zeros with zeros proves nothing): rank s's first tokens point along its
        # own experts' gate rows.
        for e in range(experts):
            owner, j = divmod(e, EXPERTS_PER_RANK)
            row = gate_weight.detach()[e]
            x_all[owner * TOKENS_PER_RANK + j] = TOKEN_SCALE * row / row.norm()

        x = x_all[rows].clone().requires_grad_(True)
        y = _first(local(x))
        ((y * weights[rows]).mean()).backward()
        sync(local)

        big_x = x_all.clone().requires_grad_(True)
        y_ref = dense_reference(single_params, big_x, experts, TOP_K)
        ((y_ref * weights).mean()).backward()

        if r == 0:  # the implementation's own one-process path, same weights
            whole = layer_cls(num_expert=experts, d_model=D_MODEL, d_hidden=D_HIDDEN, top_k=TOP_K)
            whole.load_state_dict(holder.state_dict())
            with torch.no_grad():
                results.append(compare(f"{prefix}: one-process layer output", _first(whole(x_all)),
                                       y_ref.detach(), tol, asserted=asserted))
        results.append(compare(f"{prefix}: output", y, y_ref[rows], tol, asserted=asserted,
                               note=f"layer {label}, sync {sync_label}"))
        # What the two exchange bugs and a rank-local sync would leave, for the diagnoses only.
        own = range(r * EXPERTS_PER_RANK, (r + 1) * EXPERTS_PER_RANK)
        wrong_input = no_backward_exchange(
            _input_grad(single_params, x_all[rows], weights[rows], experts, frozenset(range(experts))),
            _input_grad(single_params, x_all[rows], weights[rows], experts, frozenset(range(experts)) - set(own)))
        alone = _rank_loss_grads(single_params, x_all[rows], weights[rows], experts)
        leak_input, leak = _unrouted_slot_grads(single_params, x_all, weights, experts, w)
        wrong_input["unrouted slots"] = unrouted_slots(leak_input[rows] * w, "the rank's last local expert")
        # A token's output depends on no other token: its input gradient is d(rank mean)/dx,
        # W times d(global mean)/dx.
        results.append(compare(f"{prefix}: input grad", x.grad, big_x.grad[rows] * w, tol, asserted=asserted,
                               alternatives=wrong_input))
        for name, p in local.named_parameters():
            ref_name = layout.global_name(name, "experts.", r)
            q = single_params[ref_name]
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            wrong = {"rank-local": rank_local(alone[ref_name])}
            if name.startswith("gate."):  # the experts' gradients are the same with or without the leak
                wrong["unrouted slots"] = unrouted_slots(leak[ref_name], "the rank's last local expert")
            results.append(compare(f"{prefix}: {name} grad (global {ref_name})", got, q.grad, tol,
                                   asserted=asserted, alternatives=wrong))
        with torch.no_grad():
            for p in list(local.parameters()) + list(holder.parameters()):
                if p.grad is not None:
                    p -= LR * p.grad
                p.grad = None
        for name, p in local.named_parameters():
            ref_name = layout.global_name(name, "experts.", r)
            results.append(compare(f"{prefix}: {name} after SGD", p, single_params[ref_name], tol, asserted=asserted))
        # Next step from identical weights: each step judged on its own, not on accumulated rounding.
        with torch.no_grad():
            for name, p in local.named_parameters():
                ref_name = layout.global_name(name, "experts.", r)
                p.copy_(single_params[ref_name])
    return results


register(
    Check(
        name="moe-expert-parallel",
        order=90,
        seed_source="004 chapter 6.4.1 (fastmoe FMoETransformerMLP)",
        description="fastmoe-style MoE, experts spread over ranks (all-to-all) vs one process: "
        "outputs, input/gate/expert grads",
        catches="an all-to-all MoE that misroutes tokens or grads, or whose sync leaves gate/expert grads "
        "per-rank/mis-scaled",
        rank_fn=_rank,
        impl_keys=("moe", "moe-sync"),
    )
)

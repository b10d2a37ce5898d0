"""A fairscale row, on every rank: `MOELayer(Top2Gate, this rank's experts)` over the ranks against the reference,
plain math on one process (the package's __init__ has the whole story), STEPS SGD steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moebench.libraries.spec import Row
from moebench.parity.compare import SEED_ALLCLOSE_DEFAULT, STRICT, compare, of_terms, pick
from moebench.parity.diagnose import mispaired_scores, no_backward_exchange, rank_local
from moebench.parity.diagnosis import EXPERTS, INPUT_GRAD, OUTPUT, REPLICATED, ROUTER
from moebench.parity.layout import ExpertLayout
from moebench.parity.registry import SkipCheck

D_MODEL = 8
D_HIDDEN = 16
TOKENS_PER_EXPERT = 4  # tokens per rank = 4 x E: top2gating needs S % E == 0; capacity 2S/E = 8 slots
STEPS = 3
LR = 0.5
TOKEN_SCALE = 4.0  # |randn(8)| ~ 2.8: a steered token's top-1 is the expert it points at
EXPERT_PREFIX = "experts."
"""MOELayer names its experts "experts.<local slot>.<rest>"."""


class FFN(nn.Module):
    """One expert: fc1 -> GELU -> fc2 (what a fairscale user passes in `experts`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_MODEL, D_HIDDEN)
        self.fc2 = nn.Linear(D_HIDDEN, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def sync_gradients(layer: nn.Module, world_size: int, group=None) -> None:
    """Average what fairscale does not mark `expert` over the ranks; divide what it marks by W."""
    import torch.distributed as dist

    for p in layer.parameters():
        if p.grad is None:
            continue
        if getattr(p, "expert", False):
            p.grad.div_(world_size)
        else:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(world_size)


def _gumbel(shape: tuple, seed: int) -> torch.Tensor:
    """The Gumbel noise top2gating draws for its second expert, from the same seed."""
    torch.manual_seed(seed)
    return torch.distributions.gumbel.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample(shape)


def noise_seed(seed: int, step: int, rank: int) -> int:
    return seed * 10_000 + step * 100 + rank


def reference(params: dict, x: torch.Tensor, noise: torch.Tensor, experts: int,
              detached: frozenset[int] = frozenset(), swapped: bool = False) -> torch.Tensor:
    """GShard top-2 on ONE rank's tokens x[S, d] as plain math (capacity 2S/E per expert).

    Outputs of the experts in `detached` keep their values but pass no gradient back. `swapped`:
    where a token keeps both slots, each expert gets the OTHER one's score (the mis-pairing a
    reordering bug makes; for the diagnosis only)."""
    s = x.shape[0]
    capacity = 2 * s // experts
    logits = F.linear(x, params["gate.wg.weight"])
    gates = logits.softmax(dim=1)
    first = gates.argmax(dim=1)
    second = (logits + noise).scatter(1, first[:, None], float("-inf")).argmax(dim=1)
    # Slot of a token in its expert's queue: earlier tokens of the same expert; the second choices
    # queue behind every first choice of that expert.
    same1 = first[:, None] == first[None, :]
    same2 = second[:, None] == second[None, :]
    earlier = torch.ones(s, s, dtype=torch.bool).tril(-1)
    pos1 = (same1 & earlier).sum(1)
    pos2 = (same2 & earlier).sum(1) + torch.bincount(first, minlength=experts)[second]
    g1 = gates.gather(1, first[:, None])[:, 0] * (pos1 < capacity)
    g2 = gates.gather(1, second[:, None])[:, 0] * (pos2 < capacity)
    denom = (g1 + g2).clamp(min=torch.finfo(gates.dtype).eps)
    outs = []
    for e in range(experts):
        h = F.gelu(F.linear(x, params[f"experts.{e}.fc1.weight"], params[f"experts.{e}.fc1.bias"]))
        out = F.linear(h, params[f"experts.{e}.fc2.weight"], params[f"experts.{e}.fc2.bias"])
        outs.append(out.detach() if e in detached else out)
    every = torch.stack(outs, dim=1)  # (tokens, experts, d)
    rows = torch.arange(s)
    w1, w2 = g1 / denom, g2 / denom
    if swapped:
        both = (g1 > 0) & (g2 > 0)
        w1, w2 = torch.where(both, w2, w1), torch.where(both, w1, w2)
    return w1[:, None] * every[rows, first] + w2[:, None] * every[rows, second]


def layer_classes():
    """fairscale's (MOELayer, Top2Gate), or a skip when fairscale does not import here."""
    try:
        from fairscale.nn.moe import MOELayer, Top2Gate
    except ImportError as exc:
        raise SkipCheck(f"fairscale does not import: {exc}") from None
    return MOELayer, Top2Gate


def global_name(local: str, layout: ExpertLayout, rank: int) -> tuple[str, int | None]:
    """MOELayer's "experts.<slot>.rest" on `rank` -> ("experts.<global>.rest", global expert); others as is."""
    found = layout.split_name(local, EXPERT_PREFIX)
    if found is None:
        return local, None
    e = layout.global_expert(rank, found[0])
    return f"{EXPERT_PREFIX}{e}.{found[1]}", e


def param_group(name: str) -> str:
    return EXPERTS if name.startswith(EXPERT_PREFIX) else ROUTER if name.startswith("gate.") else REPLICATED


def run(ctx, row: Row, opts) -> list:
    """Every rank: fairscale's layer over the ranks vs the reference, STEPS SGD steps."""
    moe_layer_cls, gate_cls = layer_classes()
    per_rank = row.settings.experts_per_rank
    tol, asserted = pick(opts.tolerance, strict=STRICT, seed=SEED_ALLCLOSE_DEFAULT)
    r, w = ctx.rank, ctx.world_size
    experts = per_rank * w
    layout = ExpertLayout(experts, w)
    tokens = TOKENS_PER_EXPERT * experts
    torch.manual_seed(opts.seed)
    gate = gate_cls(D_MODEL, experts)
    everyone = [FFN() for _ in range(experts)]
    with torch.no_grad():  # equal-norm gate rows: a token c * row_e picks expert e first
        gate.wg.weight /= gate.wg.weight.norm(dim=1, keepdim=True)
    params = {f"gate.{n}": p.detach().clone().requires_grad_(True) for n, p in gate.named_parameters()}
    for e, ffn in enumerate(everyone):
        params.update({f"experts.{e}.{n}": p.detach().clone().requires_grad_(True) for n, p in ffn.named_parameters()})
    # The layer is built as a user builds it (fresh modules, then the weights), not by copying modules.
    layer_gate = gate_cls(D_MODEL, experts)
    layer_gate.load_state_dict(gate.state_dict())
    mine = nn.ModuleList(FFN() for _ in range(per_rank))
    for ffn, e in zip(mine, range(r * per_rank, (r + 1) * per_rank)):
        ffn.load_state_dict(everyone[e].state_dict())
    layer = moe_layer_cls(layer_gate, mine)
    results = []
    for step in range(STEPS):
        prefix = f"step {step + 1}: "
        g = torch.Generator().manual_seed(opts.seed * 1000 + step)
        x_all = torch.randn(w, tokens, D_MODEL, generator=g)
        weights = torch.randn(w, tokens, D_MODEL, generator=g)
        rows = params["gate.wg.weight"].detach()
        for e in range(experts):  # every rank sends every expert a slot: no zero-vs-zero expert gradient
            x_all[:, e] = TOKEN_SCALE * rows[e] / rows[e].norm()
        noise = [_gumbel((tokens, experts), noise_seed(opts.seed, step, s)) for s in range(w)]

        x = x_all[r].clone().requires_grad_(True)
        torch.manual_seed(noise_seed(opts.seed, step, r))  # top2gating draws its noise here
        y = layer(x.view(2, tokens // 2, D_MODEL)).reshape(tokens, D_MODEL)
        loss = (y * weights[r]).mean()
        loss.backward()
        sync_gradients(layer, w)

        big_x = x_all.clone().requires_grad_(True)
        y_ref = torch.stack([reference(params, big_x[s], noise[s], experts) for s in range(w)])
        losses = (y_ref * weights).mean(dim=(1, 2))
        losses.mean().backward()  # the one-process objective: the mean over every rank's tokens

        own = range(r * per_rank, (r + 1) * per_rank)
        every = frozenset(range(experts))
        wrong_input = no_backward_exchange(
            _input_grad(params, x_all[r], weights[r], noise[r], experts, every),
            _input_grad(params, x_all[r], weights[r], noise[r], experts, every - set(own)))
        alone = _rank_grads(params, x_all[r], weights[r], noise[r], experts)

        with torch.no_grad():
            mispaired = reference(params, x_all[r], noise[r], experts, swapped=True)
        # The output first: a forward bug is named from it (a scalar loss only ever fits a scale).
        results.append(compare(prefix + "output", y.detach(), y_ref[r].detach(), tol, asserted=asserted,
                               alternatives={"scores mispaired": mispaired_scores(mispaired)}, group=OUTPUT))
        terms = float((y_ref[r].detach() * weights[r]).abs().mean())  # the loss: a mean of products of both signs
        results.append(compare(prefix + "loss", loss.detach(), losses[r].detach(), of_terms(tol, terms),
                               asserted=asserted, group=OUTPUT))
        results.append(compare(prefix + "input grad", x.grad, big_x.grad[r] * w, tol, asserted=asserted,
                               alternatives=wrong_input, group=INPUT_GRAD))
        for name, p in layer.named_parameters():
            ref_name, e = global_name(name, layout, r)
            label = name if e is None else f"{name} (expert {e})"
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            results.append(compare(f"{prefix}grad {label}", got, params[ref_name].grad, tol, asserted=asserted,
                                   world_size=w, alternatives={"rank-local": rank_local(alone[ref_name])},
                                   group=param_group(name)))
        with torch.no_grad():
            for p in list(layer.parameters()) + list(params.values()):
                if p.grad is not None:
                    p -= LR * p.grad
                p.grad = None
        for name, p in layer.named_parameters():
            ref_name, e = global_name(name, layout, r)
            label = name if e is None else f"{name} (expert {e})"
            results.append(compare(f"{prefix}{label} after SGD", p, params[ref_name], tol, asserted=asserted,
                                   group=param_group(name)))
        # The next step starts from the reference's weights: each step is judged on its own, so one
        # wrong gradient shows as that gradient, not as everything wrong from the next step on.
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(params[global_name(name, layout, r)[0]])
    return results


def _input_grad(params, x, weights, noise, experts, detached) -> torch.Tensor:
    """d(this rank's loss)/dx when the experts in `detached` pass no gradient back."""
    x = x.detach().clone().requires_grad_(True)
    loss = (reference(params, x, noise, experts, detached) * weights).mean()
    return torch.autograd.grad(loss, x)[0]


def _rank_grads(params, x, weights, noise, experts) -> dict:
    """Every parameter's gradient from this rank's tokens and loss alone (never all-reduced)."""
    names = list(params)
    loss = (reference(params, x.detach(), noise, experts) * weights).mean()
    grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
    return {n: torch.zeros_like(params[n]) if gr is None else gr for n, gr in zip(names, grads)}

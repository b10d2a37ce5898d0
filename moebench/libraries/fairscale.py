"""fairscale: `MOELayer` with `Top2Gate` and its `_AllToAll`, experts spread over the ranks, vs one
process with identical weights.

What runs on each of the W ranks is what fairscale's users write: `MOELayer(Top2Gate(d_model, E),
ModuleList(this rank's experts))` over the default group (gloo), each rank on its own tokens.
fairscale leaves gradient synchronisation to the user, and marks expert parameters `p.expert = True`
so a data-parallel wrapper can skip them; `sync_gradients` below is that wrapper: parameters not
marked are averaged over the ranks (DDP's convention), marked ones already hold the sum over every
rank's tokens (the backward all-to-all brought them) and are divided by W. W ranks then train like
one process on the global batch.

The reference is plain math on one process, written independently of fairscale: softmax gate, top-1
by argmax, top-2 by argmax over the logits plus the same Gumbel noise (drawn from the same seed),
GShard's capacity 2S/E with first-come slots and kept gates renormalised, every expert on every token,
the kept ones mixed. fairscale's capacity is PER RANK (S is the rank's token count; its queue order
is the rank's), so the reference gates each rank's tokens separately, exactly as that rank does, and
sums over ranks for the loss: the one-process model of W ranks, not of one rank holding the whole
batch (that would keep other tokens).

Compared on every rank, for STEPS plain SGD steps from identical weights: the loss, the output,
the input gradient, the gate's gradient, every expert's gradient by its GLOBAL expert index and
fairscale's own parameter name, and the weights after each step (each step then restarts from the
reference's weights, so a wrong gradient is named as itself, not as everything wrong after it).
The auxiliary loss `l_aux` is not part of the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moebench.libraries.base import InstalledLibrary, Row
from moebench.parity.compare import SEED_ALLCLOSE_DEFAULT, STRICT, compare, of_terms, pick
from moebench.parity.diagnose import mispaired_scores, no_backward_exchange, rank_local
from moebench.parity.registry import SkipCheck

D_MODEL = 8
D_HIDDEN = 16
TOKENS_PER_EXPERT = 4  # tokens per rank = 4 x E: top2gating needs S % E == 0; capacity 2S/E = 8 slots
STEPS = 3
LR = 0.5
TOKEN_SCALE = 4.0  # |randn(8)| ~ 2.8: a steered token's top-1 is the expert it points at
EXPERTS_PER_RANK = (1, 2)


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


def _noise_seed(seed: int, step: int, rank: int) -> int:
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


class Fairscale(InstalledLibrary):
    name = "fairscale"
    import_name = "fairscale"
    extra = "fairscale"
    dist_name = "fairscale"
    catches = ("a fairscale MOELayer whose all-to-all, gate or gradient sync leaves outputs or "
               "gate/expert gradients different from one process")

    def rows(self, world_size: int, *, resume: bool = False) -> list[Row]:
        rows = [Row(library=self.name, model="top2gate", backend="-", ep_mode=_ep_mode(n),
                    world_size=world_size, features=("loss-curve",)) for n in EXPERTS_PER_RANK]
        if resume:  # a state_dict round trip (fairscale_resume.py)
            from moebench.libraries.fairscale_resume import PER_RANK, resume_row

            rows.append(resume_row(world_size, _ep_mode(PER_RANK)))
        return rows

    def run_row(self, ctx, row: Row, opts) -> list:
        try:
            from fairscale.nn.moe import MOELayer, Top2Gate
        except ImportError as exc:
            raise SkipCheck(f"fairscale does not import: {exc}") from None
        if "resume" in row.features:
            from moebench.libraries import fairscale_resume

            return fairscale_resume.run(ctx, opts, MOELayer, Top2Gate)
        per_rank = next(n for n in EXPERTS_PER_RANK if _ep_mode(n) == row.ep_mode)
        return run(ctx, opts, per_rank, MOELayer, Top2Gate)

    def repro_script(self, row: Row, seed: int) -> str:
        """A standalone script reproducing the row over gloo vs one process (libraries/repro.py)."""
        from moebench.libraries.repro import fill

        per_rank = next(n for n in EXPERTS_PER_RANK if _ep_mode(n) == row.ep_mode)
        return fill("fairscale_moe", {"experts_per_rank": per_rank, "world_size": row.world_size, "seed": seed,
                                      "steps": STEPS}, key=row.key())


def _ep_mode(per_rank: int) -> str:
    """"a2a-E=W" (one expert per rank), "a2a-E=2W" (two): MOELayer's all-to-all over E experts."""
    return f"a2a-E={'' if per_rank == 1 else per_rank}W"


def _global_name(local: str, rank: int, per_rank: int) -> tuple[str, int | None]:
    """MOELayer's "experts.<i>.rest" on `rank` -> ("experts.<global>.rest", global index); others as is."""
    if not local.startswith("experts."):
        return local, None
    _, i, rest = local.split(".", 2)
    g = rank * per_rank + int(i)
    return f"experts.{g}.{rest}", g


def run(ctx, opts, per_rank: int, moe_layer_cls, gate_cls) -> list:
    """Every rank: fairscale's layer over the ranks vs the reference, STEPS SGD steps."""
    tol, asserted = pick(opts.tolerance, strict=STRICT, seed=SEED_ALLCLOSE_DEFAULT)
    r, w = ctx.rank, ctx.world_size
    experts = per_rank * w
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
        noise = [_gumbel((tokens, experts), _noise_seed(opts.seed, step, s)) for s in range(w)]

        x = x_all[r].clone().requires_grad_(True)
        torch.manual_seed(_noise_seed(opts.seed, step, r))  # top2gating draws its noise here
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
                               alternatives={"scores mispaired": mispaired_scores(mispaired)}))
        terms = float((y_ref[r].detach() * weights[r]).abs().mean())  # the loss: a mean of products of both signs
        results.append(compare(prefix + "loss", loss.detach(), losses[r].detach(), of_terms(tol, terms),
                               asserted=asserted))
        results.append(compare(prefix + "input grad", x.grad, big_x.grad[r] * w, tol, asserted=asserted,
                               alternatives=wrong_input))
        for name, p in layer.named_parameters():
            ref_name, e = _global_name(name, r, per_rank)
            label = name if e is None else f"{name} (expert {e})"
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            results.append(compare(f"{prefix}grad {label}", got, params[ref_name].grad, tol, asserted=asserted,
                                   world_size=w, alternatives={"rank-local": rank_local(alone[ref_name])}))
        with torch.no_grad():
            for p in list(layer.parameters()) + list(params.values()):
                if p.grad is not None:
                    p -= LR * p.grad
                p.grad = None
        for name, p in layer.named_parameters():
            ref_name, e = _global_name(name, r, per_rank)
            label = name if e is None else f"{name} (expert {e})"
            results.append(compare(f"{prefix}{label} after SGD", p, params[ref_name], tol, asserted=asserted))
        # The next step starts from the reference's weights: each step is judged on its own, so one
        # wrong gradient shows as that gradient, not as everything wrong from the next step on.
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(params[_global_name(name, r, per_rank)[0]])
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


ADAPTER = Fairscale()

"""Check 8 `experts` (seed 000, soft-moe-pytorch assert.py).

Distributed experts vs one process running every expert on the gathered input, over 2 steps
(SGD in between), for four layouts derived from the world size W:
  W > E            E = W - 1 experts (the seed's 9 ranks / 8 experts at W = 9): one rank owns
                   none whenever W >= 3 (at W = 2 both ranks share the one expert's batch)
  W < E            E = 2W
  W does not divide E = W + 1 (when W > 1)
  variable batch   rank r holds 1 + r % 3 samples
Compared: outputs, each rank's input gradient, every expert's parameter gradients (averaged over
ranks like DDP), the implementation's own is_distributed=False path, and parameters after each
SGD step (then the reference takes the distributed weights, so each step is judged on its own).

Sharding (W > 1): numbers alone cannot tell sharded experts from a rank that runs every expert
on its own samples and never communicates (each sample meets the expert of its slot either way).
So the check also counts, on each rank, the token slots each expert module ran on (a forward hook
on the modules it hands the implementation) and the collectives issued during forward and
backward, and asserts that no rank ran more than its share of the experts (ceil(E / W)), that
every expert ran exactly once per token slot over all ranks, and that every rank exchanged data.
An implementation that never calls the expert modules it was given (fused weights) cannot be
observed: the check says so, and then it checks numbers only.

Losses: strict mode weights each rank's outputs with fixed random numbers, so a gradient sent to
the wrong rank or the wrong expert cannot cancel out; seed mode uses the seed's `out.mean()` and
its assertions (outputs: allclose defaults; the first expert's first weight gradient: atol 1e-2),
and reports - without asserting - every other gradient the seed never compared.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from moebench.distributed.collectives import collectives_issued
from moebench.parity.compare import SEED_ALLCLOSE_DEFAULT, SEED_EXPERTS_GRAD, STRICT, assertion, compare, pick
from moebench.parity.experts import Experts
from moebench.parity.registry import Check, CheckOptions, impl_or_default, register

# The seed's sizes: small already, and the seed-mode verdict (vacuous or not) depends on them.
DIM = 8            # feature dim
TOKENS = 32        # tokens per expert slot
BATCH = 2          # samples per rank
STEPS = 2          # forward/backward/SGD rounds compared
LR = 0.5           # large on purpose: step 2 runs on visibly moved weights
SEED_ASSERTED_GRAD = "expert 0 0.weight"  # assert.py: t.experts[0][0].weight.grad, allclose(atol=1e-2)


def feed_forward(dim: int, mult: int = 4) -> nn.Module:
    """The seed's expert shape: Linear -> GELU -> Linear."""
    return nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))


def layouts(world_size: int) -> list[tuple[str, int, list[int]]]:
    """(label, experts, batch per rank) for every layout this world size can express."""
    w = world_size
    out = []
    if w >= 2:
        idle = w - (w // (w - 1)) * (w - 1)  # ranks left over when each expert gets W // E ranks
        out.append((f"ranks > experts: {w} ranks, {w - 1} experts, {idle} idle", w - 1, [BATCH] * w))
    out.append((f"ranks < experts: {w} ranks, {2 * w} experts", 2 * w, [BATCH] * w))
    if w >= 2:
        out.append((f"ranks do not divide experts: {w} ranks, {w + 1} experts", w + 1, [BATCH] * w))
    out.append((f"variable batch: {w} ranks, {max(1, w - 1)} experts", max(1, w - 1), [1 + r % 3 for r in range(w)]))
    return out


def _inputs(seed: int, case: int, step: int, batch_sizes: list[int], experts: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 10_000 + case * 100 + step)
    return [torch.randn(b, experts, TOKENS, DIM, generator=g) for b in batch_sizes]


def _loss_weights(seed: int, case: int, step: int, batch_sizes: list[int], experts: int, mode: str):
    if mode == "seed":  # out.mean(): every element weighted 1 / numel
        return [torch.full((b, experts, TOKENS, DIM), 1.0 / max(1, b * experts * TOKENS * DIM)) for b in batch_sizes]
    g = torch.Generator().manual_seed(seed * 10_000 + case * 100 + step + 77)
    return [
        torch.randn(b, experts, TOKENS, DIM, generator=g) / max(1, b * experts * TOKENS * DIM) for b in batch_sizes
    ]


def _average_grads(params: list[torch.Tensor], world_size: int) -> None:
    """DDP(find_unused_parameters=True) semantics: average over ranks, a missing grad counts as 0.
    One flat all-reduce instead of one per tensor (16 oversubscribed ranks pay per collective)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat)
    flat /= world_size
    for p, chunk in zip(params, flat.split([p.numel() for p in params])):
        p.grad = chunk.view_as(p).clone()


def _reference(experts: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Slot e through expert e: independent of any implementation under test."""
    return torch.stack([expert(x[:, e]) for e, expert in enumerate(experts)], dim=1)


def _count_slots(ran: list[int], expert: int):
    """A forward hook adding the token slots expert `expert` ran on (its input's vectors of DIM)."""
    def hook(module, args, output) -> None:
        if args and isinstance(args[0], torch.Tensor):
            ran[expert] += args[0].numel() // DIM
    return hook


def _sharding(prefix: str, ran: list[list[int]], exchanged: list[int | None], slots: int,
              asserted: bool) -> list:
    """Was the work sharded? `ran[s][e]`: token slots expert e ran on at rank s; `exchanged[s]`:
    collectives rank s issued in forward + backward; `slots`: token slots per expert over all ranks."""
    w, num_experts = len(ran), len(ran[0])
    if not any(any(counts) for counts in ran):
        return [assertion(f"{prefix}: sharding not observed", True, asserted=False,
                          note="the implementation never called the expert modules it was given: "
                               "numbers checked only")]
    share = -(-num_experts // w)
    over = {s: [e for e, n in enumerate(counts) if n] for s, counts in enumerate(ran)}
    over = {s: experts for s, experts in over.items() if len(experts) > share}
    ran_too_many = "; ".join(f"rank {s} ran experts {experts}" for s, experts in over.items())
    out = [assertion(f"{prefix}: experts sharded (each rank at most {share} of {num_experts})", not over,
                     asserted=asserted, note=f"{ran_too_many} - computed locally, not sharded" if over else "")]
    totals = [sum(counts[e] for counts in ran) for e in range(num_experts)]
    wrong = [f"expert {e}: {n}" for e, n in enumerate(totals) if n != slots]
    out.append(assertion(f"{prefix}: every expert ran once per token slot over all ranks", not wrong,
                         asserted=asserted, note=f"expected {slots} slots each; {', '.join(wrong)}" if wrong else ""))
    if any(n is None for n in exchanged):
        out.append(assertion(f"{prefix}: exchange not observed", True, asserted=False,
                             note="this torch does not count collectives"))
    else:
        silent = [s for s, n in enumerate(exchanged) if n == 0]
        out.append(assertion(f"{prefix}: every rank exchanged data", not silent, asserted=asserted,
                             note=f"ranks {silent} issued no collective in forward and backward" if silent else ""))
    return out


def _rank(ctx, opts: CheckOptions) -> list:
    impl, label = impl_or_default(opts, "experts", Experts)
    out_tol, out_asserted = pick(opts.tolerance, strict=STRICT, seed=SEED_ALLCLOSE_DEFAULT)
    grad_tol, grad_asserted = pick(opts.tolerance, strict=STRICT, seed=SEED_EXPERTS_GRAD)
    in_tol, in_asserted = pick(opts.tolerance, strict=STRICT, seed=None)
    r, w = ctx.rank, ctx.world_size
    results = []
    for case, (tag, num_experts, batch_sizes) in enumerate(layouts(w)):
        torch.manual_seed(opts.seed + case)
        experts = [feed_forward(DIM) for _ in range(num_experts)]
        ref_experts = copy.deepcopy(experts) if r == 0 else []
        ran = [0] * num_experts  # token slots each expert ran on here, this step
        for e, expert in enumerate(experts):
            expert.register_forward_hook(_count_slots(ran, e))
        net = impl(experts)
        params = [p for e in experts for p in e.parameters()]
        ref_params = [p for e in ref_experts for p in e.parameters()]
        names = [f"expert {e} {n}" for e, m in enumerate(experts) for n, _ in m.named_parameters()]
        offsets = [sum(batch_sizes[:s]) for s in range(w)]
        for step in range(STEPS):
            prefix = f"{tag}, step {step + 1}"
            xs = _inputs(opts.seed, case, step, batch_sizes, num_experts)
            weights = _loss_weights(opts.seed, case, step, batch_sizes, num_experts, opts.tolerance)
            x = xs[r].clone().requires_grad_(True)
            ran[:] = [0] * num_experts
            issued = collectives_issued()
            out = net(x)
            (out * weights[r]).sum().backward()
            after = collectives_issued()
            exchanged = None if issued is None or after is None else after - issued
            ran_here = list(ran)
            _average_grads(params, w)
            x_grad = x.grad if x.grad is not None else torch.zeros_like(x)
            # Only rank 0 builds the single-process reference (W copies of it would cost W times
            # the CPU on an oversubscribed machine); the others send it what they computed.
            sent = [None] * w if r == 0 else None
            torch.distributed.gather_object((out.detach(), x_grad, ran_here, exchanged), sent, dst=0)
            dist_grads = [p.grad.clone() for p in params] if r == 0 else []
            with torch.no_grad():
                for p in params:
                    p -= LR * p.grad
                    p.grad = None
            if r != 0:
                continue

            big_x = torch.cat(xs).requires_grad_(True)
            ref_out = _reference(ref_experts, big_x)
            # Rank-s loss terms summed over ranks, then / W: what DDP's averaged gradient descends.
            rows = [slice(offsets[s], offsets[s] + batch_sizes[s]) for s in range(w)]
            (sum((ref_out[rows[s]] * weights[s]).sum() for s in range(w)) / w).backward()
            if w > 1:  # what W > 1 must add to one process: the work split over ranks, and an exchange
                results += _sharding(prefix, [got[2] for got in sent], [got[3] for got in sent],
                                     sum(batch_sizes) * TOKENS, asserted=opts.tolerance == "strict")
            for s, (got_out, got_x_grad, _, _) in enumerate(sent):
                results.append(compare(f"{prefix}: rank {s} output", got_out, ref_out[rows[s]], out_tol,
                                       rank=s, asserted=out_asserted, note=f"impl {label}"))
                # Input gradients are not averaged: rank s holds d(sum of all losses)/d(its rows).
                results.append(compare(f"{prefix}: rank {s} input grad", got_x_grad, big_x.grad[rows[s]] * w,
                                       in_tol, rank=s, asserted=in_asserted))
            # After the all-reduce every rank holds the same parameter gradients: rank 0's speak for all.
            for name, g, q in zip(names, dist_grads, ref_params):
                # Seed mode asserts what assert.py asserts: experts[0][0].weight.grad only.
                asserted = grad_asserted and (opts.tolerance != "seed" or name == SEED_ASSERTED_GRAD)
                results.append(compare(f"{prefix}: {name} grad", g, q.grad, grad_tol, asserted=asserted))
            with torch.no_grad():  # the implementation's own single-process path, same weights
                single = impl(ref_experts)(big_x.detach(), is_distributed=False)
            results.append(compare(f"{prefix}: is_distributed=False output", single, ref_out.detach(), out_tol,
                                   asserted=out_asserted))
            with torch.no_grad():
                for q in ref_params:
                    q -= LR * q.grad
                    q.grad = None
            for name, p, q in zip(names, params, ref_params):
                results.append(compare(f"{prefix}: {name} after SGD", p, q, in_tol, asserted=in_asserted))
            # Next step starts from identical weights, so it is judged on its own, not on the
            # previous step's last-bit rounding (the seed's tolerance has no room for that).
            with torch.no_grad():
                for p, q in zip(params, ref_params):
                    q.copy_(p)
    return results


register(Check(
    name="experts", order=80, seed_source="000 soft-moe-pytorch assert.py",
    description="distributed experts vs one process (idle rank, W<E, W not dividing E, variable batch; 2 steps)",
    catches="experts that misroute slots or grads, never shard, or fail with an idle rank, W not dividing E, "
            "or ragged batches",
    rank_fn=_rank, impl_keys=("experts",),
))

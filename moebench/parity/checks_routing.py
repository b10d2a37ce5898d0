"""Check `routing-invariants`: capacity and drop accounting of the gates, compared exactly.

For fastmoe's gates (moebench.models.moe.gates: Naive, GShard, Switch, Noisy) and DeepSpeed's
TopKGate functions (deepspeed.moe.sharded_moe.top1gating / top2gating), on three load patterns
(random; skewed: most tokens prefer expert 0; adversarial: every token's first choice is expert 0):

- every slot is an expert index or -1 (dropped), and kept + dropped = tokens x k;
- no expert keeps more than its capacity, and an over-subscribed expert keeps exactly its capacity,
  the documented formula (fastmoe Switch: ceil(rate x N / num_expert);
  GShard (training rate): ceil(rate x N) x 2 // E_total; DeepSpeed top-1: max(ceil(N / E x cf),
  min_capacity), top-2: the same with 2 x cf);
- per expert, kept = min(routed, capacity): the kept counts are compared exactly;
- combine weights: fastmoe's k scores of a token sum to 1 (softmax over the k; Switch: the top-1
  softmax probability); DeepSpeed top-1: the kept token's weight is its softmax probability, top-2:
  the kept slots' weights sum to 1;
- dropped slots contribute exactly zero (DeepSpeed: a dropped token's combine row is all zero).
- Distributed: the Switch gate's capacity is shared by the ranks (limit_by_capacity): the slots
  kept on W ranks are exactly those one process keeps on the concatenated batch (masks exact).

--impl switch-gate=pkg.mod:Class replaces fastmoe's SwitchGate (same constructor and forward).
"""

from __future__ import annotations

import math

import torch

from moebench.parity.compare import EXACT, STRICT, assertion, compare, pick
from moebench.parity.registry import Check, CheckOptions, impl_or_default, register

D_MODEL = 8
NUM_EXPERT = 4  # experts per rank of the fastmoe gates (world_size 1 on the one-process checks)
TOKENS = 24
PATTERNS = ("random", "skewed", "adversarial")
RATE = (1.2, 2.4)  # fastmoe's capacity rates (train, eval)
DS_CAPACITY_FACTOR = 1.0
DS_MIN_CAPACITY = 2


def _tokens(seed: int, salt: int, n: int = TOKENS) -> torch.Tensor:
    return torch.randn(n, D_MODEL, generator=torch.Generator().manual_seed(seed * 10_000 + salt))


def _exact(name: str, actual: torch.Tensor, expected: torch.Tensor, note: str = ""):
    """Exact comparison; an all-zero expectation is checked as plain equality (never vacuous)."""
    if expected.numel() and bool((expected != 0).any()):
        return compare(name, actual, expected, EXACT, note=note)
    return assertion(name, actual.shape == expected.shape and bool(torch.equal(actual.double(), expected.double())),
                     note=note or f"got {actual.flatten().tolist()[:16]}")


def _steer(linear: torch.nn.Linear, pattern: str, tot: int) -> None:
    """Bias the gate's logits for a load pattern (random: left as drawn)."""
    with torch.no_grad():
        if pattern == "skewed":
            linear.bias.zero_()
            linear.bias[0] = 1.5
        elif pattern == "adversarial":
            linear.weight.mul_(1e-3)
            linear.bias.copy_(torch.linspace(0.0, -1.0, tot))
            linear.bias[0] = 50.0  # every token's first choice; its second is expert 1


def _fastmoe_invariants(tag: str, idx: torch.Tensor, score: torch.Tensor, tot: int, k: int,
                        capacity: int | None, routed: torch.Tensor, scores_sum: str) -> list:
    res = []
    valid = bool(((idx >= -1) & (idx < tot)).all())
    res.append(assertion(f"{tag}: every slot is an expert or -1", valid))
    kept, dropped = int((idx >= 0).sum()), int((idx == -1).sum())
    res.append(compare(f"{tag}: kept + dropped = tokens x k", torch.tensor([kept + dropped]),
                       torch.tensor([idx.shape[0] * k]), EXACT))
    counts = torch.bincount(idx[idx >= 0], minlength=tot)
    demand = torch.bincount(routed[routed >= 0], minlength=tot)
    cap = demand if capacity is None else demand.clamp(max=capacity)
    res.append(_exact(f"{tag}: kept per expert = min(routed, capacity {capacity})", counts, cap))
    if capacity is not None:
        res.append(assertion(f"{tag}: no expert keeps more than capacity {capacity}",
                             bool((counts <= capacity).all()), note=f"kept {counts.tolist()}"))
    kept_mask = idx >= 0
    res.append(assertion(f"{tag}: kept slots are slots the gate routed",
                         bool((idx[kept_mask] == routed[kept_mask]).all())))
    if scores_sum == "one":
        res.append(compare(f"{tag}: combine weights of a token's k slots sum to 1", score.sum(-1),
                           torch.ones(score.shape[0]), STRICT))
    return res


def _fastmoe_gate_checks(opts: CheckOptions, rank: int) -> list:
    from moebench.models.moe.gates import GShardGate, NaiveGate, NoisyGate, SwitchGate

    switch_cls, label = impl_or_default(opts, "switch-gate", SwitchGate)
    res = []
    for p, pattern in enumerate(PATTERNS):
        x = _tokens(opts.seed, 10 * p + rank)
        tot = NUM_EXPERT
        torch.manual_seed(opts.seed * 10_000 + 100 + p)
        gates = {
            "naive": (NaiveGate(D_MODEL, NUM_EXPERT, 1, top_k=2), 2, None),
            "noisy": (NoisyGate(D_MODEL, NUM_EXPERT, 1, top_k=2), 2, None),
            "gshard": (GShardGate(D_MODEL, NUM_EXPERT, 1, random_routing=False), 2,
                       math.ceil(RATE[0] * TOKENS) * 2 // tot),
            "switch": (switch_cls(D_MODEL, NUM_EXPERT, 1), 1, math.ceil(RATE[1] * TOKENS / NUM_EXPERT)),
        }
        for name, (gate, k, capacity) in gates.items():
            # Eval: no noise / jitter, the routing is a function of the logits. GShard has no noise
            # without random routing, so it runs in training mode, where its capacity is the smaller.
            gate.train(name == "gshard")
            if name == "noisy":
                with torch.no_grad():
                    gate.w_gate.copy_(torch.randn(D_MODEL, tot) * (1e-3 if pattern == "adversarial" else 1.0))
                    if pattern != "random":
                        x = x.clone()
                        x[:, 0] = 1.0
                        gate.w_gate[0, 0] = 50.0 if pattern == "adversarial" else 1.5
                logits = x @ gate.w_gate
            else:
                _steer(gate.gate, pattern, tot)
                logits = gate.gate(x)
            with torch.no_grad():
                idx, score = gate(x)
            routed = torch.topk(logits, k=k, dim=-1).indices
            tag = f"fastmoe {name} gate, {pattern} load" + (f" ({label})" if name == "switch" else "")
            res += _fastmoe_invariants(tag, idx, score, tot, k, capacity, routed,
                                       "one" if k > 1 else "top1")
            if name == "switch":
                probs = torch.softmax(logits, dim=-1).max(-1).values
                res.append(compare(f"{tag}: combine weight = the top-1 softmax probability", score.flatten(),
                                   probs, STRICT))
            if pattern == "adversarial" and capacity is not None:
                res.append(compare(f"{tag}: the over-subscribed expert keeps exactly capacity",
                                   torch.tensor([int((idx == 0).sum())]), torch.tensor([capacity]), EXACT,
                                   note="documented formula"))
    return res


def _deepspeed_checks(opts: CheckOptions, rank: int) -> list:
    try:
        from deepspeed.moe.sharded_moe import top1gating, top2gating
    except Exception:  # noqa: BLE001 - DeepSpeed is optional: its part is skipped, fastmoe's still runs
        return []
    res = []
    for p, pattern in enumerate(PATTERNS):
        g = torch.Generator().manual_seed(opts.seed * 10_000 + 500 + 10 * p + rank)
        logits = torch.randn(TOKENS, NUM_EXPERT, generator=g)
        if pattern == "skewed":
            logits[:, 0] += 1.5
        elif pattern == "adversarial":
            logits = logits * 1e-3
            logits[:, 0] += 50.0
            logits[:, 1] += 25.0
        for k in (1, 2):
            tag = f"deepspeed top{k}gating, {pattern} load"
            if k == 1:
                out = top1gating(logits.clone(), DS_CAPACITY_FACTOR, DS_MIN_CAPACITY, use_rts=False)
                cf = DS_CAPACITY_FACTOR
            else:
                out = top2gating(logits.clone(), DS_CAPACITY_FACTOR, DS_MIN_CAPACITY, top2_2nd_expert_sampling=False)
                cf = 2 * DS_CAPACITY_FACTOR
            combine, dispatch = out[1], out[2]
            capacity = max(math.ceil(TOKENS / NUM_EXPERT * cf), DS_MIN_CAPACITY)
            res.append(compare(f"{tag}: capacity = max(ceil(N / E x {cf:g}), min_capacity)",
                               torch.tensor([combine.shape[-1]]), torch.tensor([capacity]), EXACT))
            kept = dispatch.sum(dim=(0, 2))  # per expert
            order = torch.topk(logits, k=k, dim=-1).indices
            demand = torch.bincount(order.flatten(), minlength=NUM_EXPERT)
            res.append(_exact(f"{tag}: kept per expert = min(routed, capacity)", kept, demand.clamp(max=capacity)))
            res.append(assertion(f"{tag}: each capacity slot holds at most one token",
                                 bool((dispatch.sum(0) <= 1).all())))
            routed = torch.zeros(TOKENS, NUM_EXPERT, dtype=torch.bool).scatter_(1, order, True)
            res.append(assertion(f"{tag}: kept slots are routed slots", bool((dispatch.any(-1) <= routed).all())))
            slots = dispatch.sum(dim=(1, 2))
            res.append(compare(f"{tag}: kept + dropped = tokens x k",
                               torch.tensor([int(slots.sum()) + int((k - slots).sum())]),
                               torch.tensor([TOKENS * k]), EXACT))
            weight = combine.sum(dim=(1, 2))
            dropped = slots == 0
            res.append(_exact(f"{tag}: dropped tokens' combine weights are exactly zero",
                              combine[dropped].abs().sum().reshape(1), torch.zeros(1)))
            if k == 1:
                expected = torch.where(dropped, 0.0, torch.softmax(logits, -1).max(-1).values)
            else:
                expected = torch.where(dropped, 0.0, 1.0)
            res.append(compare(f"{tag}: combine weights of kept slots sum as documented", weight, expected, STRICT))
    return res


def _distributed_switch(ctx, opts: CheckOptions) -> list:
    """limit_by_capacity on W ranks keeps exactly what one process keeps on the whole batch."""
    from moebench.models.moe.gates import limit_by_capacity

    w, r = ctx.world_size, ctx.rank
    tot = NUM_EXPERT
    res = []
    for p, pattern in enumerate(PATTERNS):
        chosen = []
        for s in range(w):
            g = torch.Generator().manual_seed(opts.seed * 10_000 + 900 + 10 * p + s)
            if pattern == "adversarial":
                chosen.append(torch.zeros(TOKENS, 1, dtype=torch.long))
            elif pattern == "skewed":
                chosen.append(torch.where(torch.rand(TOKENS, 1, generator=g) < 0.7, 0,
                                          torch.randint(0, tot, (TOKENS, 1), generator=g)))
            else:
                chosen.append(torch.randint(0, tot, (TOKENS, 1), generator=g))
        capacity = math.ceil(RATE[0] * TOKENS / NUM_EXPERT)
        mine = limit_by_capacity(chosen[r].clone(), tot, capacity, w)
        whole = limit_by_capacity(torch.cat(chosen).clone(), tot, capacity, 1)
        res.append(_exact(f"switch capacity shared by {w} ranks, {pattern} load: kept mask = one process's",
                          (mine >= 0).float(), (whole[r * TOKENS:(r + 1) * TOKENS] >= 0).float()))
    return res


def _rank(ctx, opts: CheckOptions) -> list:
    pick(opts.tolerance, strict=STRICT, seed=STRICT)  # masks and counts are exact in both modes
    res = _fastmoe_gate_checks(opts, ctx.rank) + _deepspeed_checks(opts, ctx.rank) + _distributed_switch(ctx, opts)
    for c in res:
        c.rank = ctx.rank
    return res


register(Check(
    name="routing-invariants", order=110, seed_source="fastmoe gates, DeepSpeed TopKGate",
    description="gates: kept + dropped = tokens x k, capacity formula, kept <= capacity, combine weights, "
                "dropped slots zero; shared capacity on W ranks = one process (masks exact)",
    catches="a gate with wrong/overfilled capacity, miscounted drops, bad combine weights, "
            "or capacity mis-shared by ranks",
    rank_fn=_rank, impl_keys=("switch-gate",),
))

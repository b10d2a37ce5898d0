"""What DeepSpeed's gates decided over a run: demand, kept and dropped routes per expert and layer."""

from __future__ import annotations

import torch


class RoutingTotals:
    """Per-layer sums of the gate's decisions over many forwards (this rank's tokens)."""

    def __init__(self, experts_per_layer: tuple[int, ...]) -> None:
        self.exp_counts = [torch.zeros(e, dtype=torch.int64) for e in experts_per_layer]
        self.kept = [torch.zeros(e, dtype=torch.int64) for e in experts_per_layer]
        self.routes = torch.zeros(len(experts_per_layer), dtype=torch.int64)
        self.dropped = torch.zeros(len(experts_per_layer), dtype=torch.int64)
        self.tokens = torch.zeros(len(experts_per_layer), dtype=torch.int64)
        self.dropped_tokens = torch.zeros(len(experts_per_layer), dtype=torch.int64)
        self.capacity: list[set[int]] = [set() for _ in experts_per_layer]

    def add(self, layers) -> None:
        for i, layer in enumerate(layers):
            rec = layer.last
            self.exp_counts[i] += rec.exp_counts
            self.kept[i] += rec.kept_per_expert
            self.routes[i] += rec.routes
            self.dropped[i] += rec.dropped
            self.tokens[i] += rec.tokens
            self.dropped_tokens[i] += rec.dropped_tokens
            self.capacity[i].add(rec.capacity)

    def summary(self, world_size: int) -> dict:
        """Summed over ranks (a collective when world_size > 1: every rank must call it)."""
        counters = (*self.exp_counts, *self.kept, self.routes, self.dropped, self.tokens, self.dropped_tokens)
        flat = torch.cat(counters)
        if world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(flat)
        parts = list(torch.split(flat, [t.numel() for t in counters]))
        n = len(self.exp_counts)
        exp_counts, kept = parts[:n], parts[n:2 * n]
        routes, dropped, tokens, dropped_tokens = parts[2 * n:]
        per_layer = []
        for i in range(n):
            caps = sorted(self.capacity[i])
            per_layer.append({
                "layer": i, "experts": int(exp_counts[i].numel()),
                "capacity_per_expert": caps[0] if len(caps) == 1 else {"min": caps[0], "max": caps[-1]},
                "exp_counts": exp_counts[i].tolist(), "tokens_kept_per_expert": kept[i].tolist(),
                **drop_fractions(routes[i], dropped[i], tokens[i], dropped_tokens[i]),
            })
        # Every token passes every layer: the token count is per layer, routes and drops add up.
        # (the token-layer pairs give dropped_token_frac: the average of the layers' fractions).
        totals = drop_fractions(routes.sum(), dropped.sum(), tokens.sum(), dropped_tokens.sum())
        del totals["tokens"], totals["dropped_tokens"]
        return {**totals, "tokens_per_layer": int(tokens[0]), "per_layer": per_layer}


def drop_fractions(routes, dropped, tokens, dropped_tokens) -> dict:
    """Routes evicted at capacity, and tokens that lost ALL k of their routes (the same for k=1)."""
    routes, dropped, tokens, dropped_tokens = int(routes), int(dropped), int(tokens), int(dropped_tokens)
    return {"routes": routes, "dropped": dropped, "dropped_route_frac": dropped / routes if routes else 0.0,
            "tokens": tokens, "dropped_tokens": dropped_tokens,
            "dropped_token_frac": dropped_tokens / tokens if tokens else 0.0}

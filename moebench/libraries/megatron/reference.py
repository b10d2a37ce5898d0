"""The one-process mathematics a Megatron row is held to, written here from Megatron's documented definitions (the
router's score functions, top-k, group-limited top-k, capacity, the Switch aux loss, the ST-MoE z-loss, aux-loss-free
expert bias), never by calling megatron-core: the whole global batch on one process, in float32.

The objective of one step, for DP ranks d = 1..DP each holding N_d tokens:

    J = (1/DP) sum_d [ (1/N_d) sum_{x in d} <y(x), target(x)>  +  aux_d  +  z_d ]

- y(x) = sum_e p(x, e) expert_e(x) (+ the shared expert, times its sigmoid gate), expert = SwiGLU
  down(silu(gate x) * up x); p(x, e) the routing probability after top-k, scaling and capacity;
- routing runs per rank chunk (a DP rank's micro-batch, split along the sequence over its TP ranks), as each rank
  routes its own tokens: capacity = ceil(n_chunk k / E x factor) per chunk;
- aux_d = E coeff / (k T_d^2) sum_e P_e f_e over the DP rank's tokens (P_e: summed scores, f_e: top-k counts): one aux
  loss per micro-batch, whatever its split over TP ranks (Megatron reduces the counts over TP x CP);
- z_d = coeff_z x mean over the DP rank's tokens of logsumexp(logits)^2;
- the per-token loss (calculate_per_token_loss) is the same objective when every rank holds as many tokens: the
  main loss a sum over the global batch / the global token count, the aux and z terms 1/DP each (what Megatron states
  its per-token scaling aims at: "1/(num_micro_batches * dp_size)").
Then the gradient norm over every parameter (each expert once), the clip (coefficient max / (norm + 1e-6) when < 1),
torch's AdamW, and the expert-bias update: bias += rate x sign(mean count - count), counts over the global batch.

Imports only torch: `--repro` scripts paste it whole.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class Routing:
    probs: torch.Tensor
    """[tokens, E]: the weight of each token's expert output (0 where not routed or dropped)."""
    routed: torch.Tensor
    """[tokens, E] bool: the slots experts process (after capacity; with padding, the capacity mask)."""
    dropped: int
    """Top-k slots the capacity dropped."""
    aux_scores: torch.Tensor | None
    aux_counts: torch.Tensor | None


def _topk(scores: torch.Tensor, k: int, groups: int | None, group_topk: int | None):
    """Top-k over experts, limited to the `group_topk` best groups (a group's score: the sum of its top k/group_topk)
    when groups are given."""
    if not group_topk:
        return torch.topk(scores, k=k, dim=1)
    n, e = scores.shape
    group_scores = scores.view(n, groups, -1).topk(k // group_topk, dim=-1)[0].sum(dim=-1)
    chosen = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(n, groups, e // groups).reshape(n, -1)
    return torch.topk(scores.masked_fill(~expert_mask.bool(), float("-inf")), k=k, dim=-1)


def route(logits: torch.Tensor, s: dict, expert_bias: torch.Tensor | None) -> Routing:
    """One chunk's routing from its logits [tokens, E]."""
    n, num_experts = logits.shape
    k = s["topk"]
    if s["score"] == "softmax":
        if s["pre_softmax"]:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            top, idx = _topk(scores, k, s.get("groups"), s.get("group_topk"))
            weights = top
        else:
            top, idx = _topk(logits, k, s.get("groups"), s.get("group_topk"))
            weights = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
    else:
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, idx = _topk(scores + expert_bias, k, s.get("groups"), s.get("group_topk"))
            top = torch.gather(scores, 1, idx)
        else:
            top, idx = _topk(scores, k, s.get("groups"), s.get("group_topk"))
        weights = top / (top.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else top
    if s.get("scaling"):
        weights = weights * s["scaling"]
    probs = torch.zeros_like(logits).scatter(1, idx, weights)
    routed = torch.zeros_like(logits).int().scatter(1, idx, 1).bool()
    dropped = 0
    if s.get("capacity") is not None:
        capacity = math.ceil(n * k / num_experts * s["capacity"])
        if capacity > n:
            keep = torch.ones_like(probs).bool()
        else:  # each expert keeps its `capacity` most probable tokens
            _, kept = torch.topk(probs, k=capacity, dim=0, sorted=False)
            keep = torch.zeros_like(probs).scatter(0, kept, 1).bool()
        dropped = int((routed & ~keep).sum())
        routed = keep if s.get("pad") else routed & keep
        probs = probs * routed
    aux_scores = aux_counts = None
    if s.get("aux"):
        if s["score"] == "softmax":
            aux_scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            sig = torch.sigmoid(logits)
            aux_scores = sig / (sig.sum(dim=-1, keepdim=True) + 1e-20)
        top = torch.topk(aux_scores, k=k, dim=1)[1]
        aux_counts = torch.zeros_like(logits).int().scatter(1, top, 1).bool().sum(dim=0).float()
    return Routing(probs=probs, routed=routed, dropped=dropped, aux_scores=aux_scores, aux_counts=aux_counts)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


@dataclasses.dataclass
class StepResult:
    """The reference's step: what every rank's numbers are compared with."""

    output: torch.Tensor
    """[SEQ, DP x MICRO, HIDDEN]."""
    input_grad: torch.Tensor
    """dJ/dx, same shape."""
    loss: float
    """The main loss: the mean over the global batch of <output, target>."""
    main_terms: float
    """The mean |term| of that loss (its comparison's floor: a mean of terms of both signs)."""
    grads: dict[str, torch.Tensor]
    """dJ/d(unit), before the clip."""
    grad_norm: float
    clip_coeff: float
    values: dict[str, torch.Tensor]
    """Every unit after the step."""
    expert_bias: torch.Tensor | None
    dropped: int
    aux: float
    z: float


class Reference:
    """The model on one process: every unit a float32 leaf (the master), torch's AdamW over them, the expert bias a
    buffer; computed in `dtype` (float32: the truth; bfloat16: the same mathematics in bf16, the noise model's
    baseline, its masters and optimizer in float32 as Megatron's mixed-precision optimizer keeps them)."""

    def __init__(self, settings: dict, values: dict[str, torch.Tensor], *, seq: int, micro: int, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float, clip: float,
                 dtype: torch.dtype = torch.float32):
        self.s, self.dtype = settings, dtype
        self.seq, self.micro, self.clip = seq, micro, clip
        self.params = {name: v.detach().clone().float().requires_grad_(True) for name, v in values.items()}
        self.expert_bias = (torch.zeros(values["router"].shape[0]) if settings.get("expert_bias") is not None
                            else None)
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=lr, betas=betas, eps=eps,
                                           weight_decay=weight_decay)
        self.num_experts = values["router"].shape[0]

    def gradients(self, x: torch.Tensor, target: torch.Tensor, tp: int, dp: int, *, aux_factor: float = 1.0,
                  only: set[tuple[int, int]] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(dJ'/dx, {unit: dJ'/d unit}) at the current values, for a known-wrong variant J' of the objective: the aux
        and z terms x `aux_factor`, or only the terms of the rank chunks `only` ((DP rank, TP rank) pairs: the main
        loss of their tokens, the aux and z losses of their DP ranks). Nothing is stepped."""
        x = x.detach().clone().requires_grad_(True)
        params = {name: v.detach().clone().requires_grad_(True) for name, v in self.params.items()}
        _, objective, _ = self.forward(x, target, tp, dp, params=params, aux_factor=aux_factor, only=only)
        objective.backward()
        return x.grad.detach(), {n: (v.grad.detach() if v.grad is not None else torch.zeros_like(v))
                                 for n, v in params.items()}

    def forward(self, x: torch.Tensor, target: torch.Tensor, tp: int, dp: int, *, params: dict | None = None,
                aux_factor: float = 1.0, only: set[tuple[int, int]] | None = None) -> tuple[torch.Tensor, Any, dict]:
        """(output, objective J, what else) for the global batch x [SEQ, DP x MICRO, HIDDEN]."""
        s, p = self.s, (params if params is not None else self.params)
        p = {name: v.to(self.dtype) for name, v in p.items()}
        x = x.to(self.dtype)
        out = torch.zeros_like(x)
        objective = torch.zeros(())
        main_sum, terms, dropped, aux_total, z_total = torch.zeros(()), 0.0, 0, 0.0, 0.0
        counts = torch.zeros(self.num_experts)
        part = self.seq // tp
        for d in range(dp):
            cols = slice(d * self.micro, (d + 1) * self.micro)
            n_d = self.seq * self.micro
            scores_sum = torch.zeros(self.num_experts)
            aux_counts = torch.zeros(self.num_experts)
            lse_sq = torch.zeros(())
            main_d = torch.zeros(())
            for t in range(tp):
                rows = slice(t * part, (t + 1) * part)
                xc = x[rows, cols].reshape(-1, x.shape[-1])
                logits = xc @ p["router"].t()
                r = route(logits, s, self.expert_bias)
                y = torch.zeros_like(xc)
                for e in range(self.num_experts):
                    y = y + r.probs[:, e:e + 1] * swiglu(xc, p[f"expert{e}.gate"], p[f"expert{e}.up"],
                                                         p[f"expert{e}.down"])
                if s.get("shared"):
                    shared = swiglu(xc, p["shared.gate"], p["shared.up"], p["shared.down"])
                    if s.get("shared_gate"):
                        shared = shared * torch.sigmoid(xc @ p["shared.gate_weight"].t())
                    y = y + shared
                out[rows, cols] = y.reshape(part, self.micro, -1)
                term = (y.float() * target[rows, cols].reshape(-1, x.shape[-1])).sum(dim=-1)
                if only is None or (d, t) in only:
                    main_d = main_d + term.sum()
                terms += float(term.detach().abs().sum())
                counts += r.routed.sum(dim=0).float()
                dropped += r.dropped
                if r.aux_scores is not None:
                    scores_sum = scores_sum + r.aux_scores.sum(dim=0)
                    aux_counts += r.aux_counts
                lse_sq = lse_sq + torch.logsumexp(logits, dim=-1).square().float().sum()
            aux_d = torch.zeros(())
            if s.get("aux"):
                k = s["topk"]
                aux_d = (scores_sum * aux_counts).sum() * (self.num_experts * s["aux"] / (k * n_d * n_d))
            z_d = s["z"] * lse_sq / n_d if s.get("z") else torch.zeros(())
            if only is None or any(dd == d for dd, _ in only):
                objective = objective + (main_d / n_d + aux_factor * (aux_d + z_d)) / dp
            main_sum = main_sum + main_d
            aux_total += float(aux_d.detach()) / dp
            z_total += float(z_d.detach()) / dp
        n = self.seq * self.micro * dp
        return out, objective, dict(loss=float(main_sum.detach()) / n, terms=terms / n, counts=counts,
                                    dropped=dropped, aux=aux_total, z=z_total)

    def step(self, x: torch.Tensor, target: torch.Tensor, tp: int, dp: int) -> StepResult:
        x = x.detach().clone().requires_grad_(True)
        self.optimizer.zero_grad(set_to_none=True)
        out, objective, info = self.forward(x, target, tp, dp)
        objective.backward()
        grads = {name: (v.grad.detach().clone() if v.grad is not None else torch.zeros_like(v))
                 for name, v in self.params.items()}
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
        coeff = self.clip / (norm + 1.0e-6)
        if coeff < 1.0:
            for v in self.params.values():
                if v.grad is not None:
                    v.grad.mul_(coeff)
        self.optimizer.step()
        if self.expert_bias is not None:
            counts = info["counts"]
            self.expert_bias = self.expert_bias + torch.sign(counts.mean() - counts) * self.s["expert_bias"]
        return StepResult(output=out.detach().float(), input_grad=x.grad.detach().float(), loss=info["loss"],
                          main_terms=info["terms"], grads=grads, grad_norm=norm, clip_coeff=min(coeff, 1.0),
                          values={name: v.detach().clone() for name, v in self.params.items()},
                          expert_bias=None if self.expert_bias is None else self.expert_bias.clone(),
                          dropped=info["dropped"], aux=info["aux"], z=info["z"])

"""The reference backend against a brute-force per-token loop, fastmoe's layout, init and gates."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from moebench.models.moe import FMoEReference
from moebench.models.moe.gates import GShardGate, NaiveGate, NoisyGate, SwitchGate, prune_by_allowance

# float32: the sorted dispatch and the per-token loop add the same products in different orders.
OUTPUT_ATOL = 1e-5
GRAD_ATOL = 1e-5
# fastmoe's CUDA GEMMs (cuBLAS, possibly TF32) against plain matmuls on O(1) activations.
FMOE_ATOL = 1e-4
D_MODEL, D_HIDDEN, TOKENS = 16, 24, 40


def brute_force(layer: FMoEReference, x: torch.Tensor, topk_idx=None, topk_score=None) -> torch.Tensor:
    """y_n = sum_j score_nj * expert_{idx_nj}(x_n), one token and one slot at a time."""
    if topk_idx is None:
        logits = layer.gate.gate(x)
        vals, topk_idx = torch.topk(logits, layer.top_k, dim=-1)
        topk_score = F.softmax(vals, dim=-1)
    rows = []
    for n in range(x.shape[0]):
        y = torch.zeros(x.shape[1], dtype=x.dtype)
        for j in range(topk_idx.shape[1]):
            e = int(topk_idx[n, j])
            if e < 0:
                continue  # dropped slot
            expert = layer.experts[e]
            h = layer.experts[e].activation(x[n] @ expert.htoh4.weight[0].T + expert.htoh4.bias[0])
            y = y + topk_score[n, j] * (h @ expert.h4toh.weight[0].T + expert.h4toh.bias[0])
        rows.append(y)
    return torch.stack(rows)


def mismatches(layer: FMoEReference, *, seed: int = 0, routing=None) -> list[str]:
    """Names of everything (output, input grad, each parameter grad) that differs from brute force."""
    torch.manual_seed(seed)
    x = torch.randn(TOKENS, D_MODEL)
    probe = torch.randn(TOKENS, D_MODEL)  # a generic linear functional of y, so every grad path is hit
    reference = copy.deepcopy(layer)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    if routing is None:
        y1 = layer(x1.view(2, TOKENS // 2, D_MODEL)).reshape(TOKENS, D_MODEL)
        y2 = brute_force(reference, x2)
    else:
        y1 = layer.moe_forward(x1, *routing)
        y2 = brute_force(reference, x2, *routing)
    (y1 * probe).sum().backward()
    (y2 * probe).sum().backward()
    bad = []
    if not torch.allclose(y1, y2, atol=OUTPUT_ATOL, rtol=0):
        bad.append("output")
    if not torch.allclose(x1.grad, x2.grad, atol=GRAD_ATOL, rtol=0):
        bad.append("input grad")
    for (name, p1), (_, p2) in zip(layer.named_parameters(), reference.named_parameters()):
        g1 = p1.grad if p1.grad is not None else torch.zeros_like(p1)
        g2 = p2.grad if p2.grad is not None else torch.zeros_like(p2)
        if not torch.allclose(g1, g2, atol=GRAD_ATOL, rtol=0):
            bad.append(name)
    return bad


@pytest.mark.parametrize("experts", [4, 8])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_reference_equals_brute_force(experts, top_k):
    torch.manual_seed(experts * 10 + top_k)
    layer = FMoEReference(num_expert=experts, d_model=D_MODEL, d_hidden=D_HIDDEN, top_k=top_k)
    with torch.no_grad():  # fastmoe zero-inits biases; non-zero ones make the bias paths count
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    assert mismatches(layer) == []


def test_dropped_slots_contribute_zero():
    torch.manual_seed(1)
    layer = FMoEReference(num_expert=4, d_model=D_MODEL, d_hidden=D_HIDDEN, top_k=2)
    gen = torch.Generator().manual_seed(2)
    topk_idx = torch.randint(0, 4, (TOKENS, 2), generator=gen)
    topk_idx[::3, 1] = -1
    topk_idx[::7, 0] = -1
    topk_score = torch.rand(TOKENS, 2, generator=gen)
    assert mismatches(layer, routing=(topk_idx, topk_score)) == []
    x = torch.randn(3, D_MODEL)
    assert torch.equal(layer.moe_forward(x, torch.full((3, 2), -1), torch.ones(3, 2)), torch.zeros(3, D_MODEL))


class _WrongTokenForSlot(FMoEReference):
    """Broken on purpose: each slot is fed the next token's features (a slot/token pairing bug)."""

    def moe_forward(self, x, topk_idx, topk_score):
        return super().moe_forward(torch.roll(x, 1, dims=0), topk_idx, topk_score)


class _UnweightedSum(FMoEReference):
    """Broken on purpose: outputs averaged instead of weighted by the gate scores."""

    def moe_forward(self, x, topk_idx, topk_score):
        return super().moe_forward(x, topk_idx, torch.full_like(topk_score, 1.0 / topk_score.shape[1]))


@pytest.mark.parametrize("broken", [_WrongTokenForSlot, _UnweightedSum])
def test_brute_force_check_catches_a_broken_layer(broken):
    torch.manual_seed(3)
    layer = broken(num_expert=4, d_model=D_MODEL, d_hidden=D_HIDDEN, top_k=2)
    assert "output" in mismatches(layer)


def test_state_dict_is_fastmoes():
    layer = FMoEReference(num_expert=2, d_model=8, d_hidden=12, top_k=2)
    shapes = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    expected = {}
    for i in range(2):
        expected |= {f"experts.{i}.htoh4.weight": (1, 12, 8), f"experts.{i}.htoh4.bias": (1, 12),
                     f"experts.{i}.h4toh.weight": (1, 8, 12), f"experts.{i}.h4toh.bias": (1, 8)}
    expected |= {"gate.gate.weight": (2, 8), "gate.gate.bias": (2,)}
    assert shapes == expected and list(shapes) == list(expected)


def test_init_and_draw_order_are_fastmoes():
    d, h, e = 8, 12, 3
    torch.manual_seed(7)
    layer = FMoEReference(num_expert=e, d_model=d, d_hidden=h, top_k=2)
    torch.manual_seed(7)  # replay fastmoe's construction: every expert (htoh4, h4toh), then the gate
    for i in range(e):
        for name, (out_f, in_f) in (("htoh4", (h, d)), ("h4toh", (d, h))):
            w = torch.empty(1, out_f, in_f)
            torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            lin = getattr(layer.experts[i], name)
            assert torch.equal(lin.weight, w) and torch.equal(lin.bias, torch.zeros(1, out_f))
            assert lin.weight.abs().max() <= 1 / math.sqrt(in_f * out_f)
    gate = torch.nn.Linear(d, e)
    assert torch.equal(layer.gate.gate.weight, gate.weight) and torch.equal(layer.gate.gate.bias, gate.bias)


def test_prune_by_allowance_keeps_the_first_slots_per_expert():
    idx = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1]])
    pruned = prune_by_allowance(idx, torch.tensor([2, 1, 5]))
    assert pruned.tolist() == [[0, 1], [0, 2], [-1, -1], [-1, -1]]


@pytest.mark.parametrize("gate,k", [(NaiveGate, 3), (GShardGate, 2), (SwitchGate, 1), (NoisyGate, 2), (NoisyGate, 3)])
def test_every_gate_trains_with_its_aux_loss(gate, k):
    torch.manual_seed(4)
    layer = FMoEReference(num_expert=8, d_model=D_MODEL, d_hidden=D_HIDDEN, top_k=k, gate=gate, return_aux=True)
    x = torch.randn(2, 20, D_MODEL, requires_grad=True)
    y, aux = layer(x)
    assert y.shape == x.shape and aux.dim() == 0 and torch.isfinite(aux)
    (y.pow(2).mean() + aux).backward()
    gate_grads = [p.grad for p in layer.gate.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in gate_grads)
    if gate is not NaiveGate:  # a real balance loss, not fastmoe's dummy zero
        assert aux.item() > 0
    layer.eval()
    with torch.no_grad():
        assert torch.isfinite(layer(x)[1])


def test_noisy_gate_pairs_each_slot_with_its_own_token_for_k_above_one():
    torch.manual_seed(5)
    layer = FMoEReference(num_expert=6, d_model=D_MODEL, d_hidden=D_HIDDEN, top_k=3, gate=NoisyGate).eval()
    x = torch.randn(TOKENS, D_MODEL)
    idx, score = layer.gate(x)
    assert idx.shape == (TOKENS, 3) and score.shape == (TOKENS, 3)
    assert torch.allclose(layer.moe_forward(x, idx, score), brute_force(layer, x, idx, score), atol=OUTPUT_ATOL)


def test_noisy_gate_draws_its_noise_in_eval_too_as_fastmoe_does():
    # fastmoe scales the noise by `training` (0 in eval) but still calls randn_like, so an eval
    # pass advances the random stream by exactly one [tokens, experts] normal draw.
    torch.manual_seed(0)
    gate = NoisyGate(D_MODEL, 6, 1, top_k=2).eval()
    x = torch.randn(TOKENS, D_MODEL)
    torch.manual_seed(11)
    with torch.no_grad():
        idx, _ = gate(x)
    after_gate = torch.rand(3)
    torch.manual_seed(11)
    torch.randn(TOKENS, 6)  # fastmoe's draw
    assert torch.equal(torch.rand(3), after_gate)
    assert torch.equal(idx, torch.topk(x @ gate.w_gate, 2, dim=1).indices)  # eval logits stay noiseless


def test_capacity_gates_respect_capacity():
    torch.manual_seed(6)
    tokens, experts = 64, 4
    gshard = GShardGate(D_MODEL, experts, 1, random_routing=False)
    with torch.no_grad():
        gshard.gate.bias.copy_(torch.tensor([5.0, 4.0, 0.0, 0.0]))  # everyone wants experts 0 and 1
    idx, _ = gshard(torch.randn(tokens, D_MODEL))
    cap = math.ceil(1.2 * tokens) * 2 // experts
    counts = torch.bincount(idx[idx >= 0], minlength=experts)
    assert counts.max() == cap and (idx == -1).any()
    switch = SwitchGate(D_MODEL, experts, 1).eval()
    with torch.no_grad():
        switch.gate.bias.copy_(torch.tensor([5.0, 0.0, 0.0, 0.0]))
    idx, _ = switch(torch.randn(tokens, D_MODEL))
    assert torch.bincount(idx[idx >= 0], minlength=experts)[0] == math.ceil(2.4 * tokens / experts)


def test_fixed_k_gates_refuse_other_k():
    with pytest.raises(ValueError, match="exactly 1"):
        SwitchGate(D_MODEL, 4, 1, topk=2)
    with pytest.raises(ValueError, match="exactly 2"):
        GShardGate(D_MODEL, 4, 1, topk=1)


def _fmoe_reason():
    from moebench.models.moe import fmoe_adapter

    return fmoe_adapter.unusable_reason(device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(_fmoe_reason() is not None, reason=f"real fmoe unusable: {_fmoe_reason()}")
@pytest.mark.parametrize("top_k", [1, 2])
def test_reference_equals_real_fmoe_with_the_same_seed(top_k):
    from moebench.models.moe import build_moe_mlp

    torch.manual_seed(0)
    real = build_moe_mlp(backend="fmoe", experts=8, d_model=32, d_hidden=64, top_k=top_k, device="cuda").cuda()
    torch.manual_seed(0)
    ours = build_moe_mlp(backend="reference", experts=8, d_model=32, d_hidden=64, top_k=top_k).cuda()
    assert {k: v.shape for k, v in real.state_dict().items()} == {k: v.shape for k, v in ours.state_dict().items()}
    for (name, a), b in zip(real.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name  # same seed, same draw order, same weights
    x = torch.randn(4, 10, 32, device="cuda")
    assert torch.allclose(real(x)[0], ours(x)[0], atol=FMOE_ATOL)

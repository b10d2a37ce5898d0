"""The DeepSpeed adapter reads what the gate decided from either form of the gate's output.

DeepSpeed's TopKGate hands MOELayer sparse routes from 0.19.x on (7 items, evicted routes at index -1) and
a dense dispatch mask before (4 items: l_aux, combine_weights [s, e, c], dispatch_mask [s, e, c],
exp_counts). The pinned release's gate still computes the dense form when asked without
sparse_routes, so both forms here come from DeepSpeed's own gating code on a hand-routed batch.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from moebench.models.deepspeed_moe import DENSE_GATE_OUTPUT, SPARSE_GATE_OUTPUT, routing_record


def _hand_routed_layer(top_k: int):
    """2 experts; gate = the first two input features: tokens 0-5 prefer expert 0, tokens 6-7 expert 1."""
    from moebench.models.deepspeed_moe import DeepSpeedMoEMLP
    from moebench.variants.deepspeed.config import DeepSpeedMoEConfig

    moe = DeepSpeedMoEConfig(experts=(2,), d_hidden=8, top_k=top_k, capacity_factor=0.5, eval_capacity_factor=0.5,
                             min_capacity=0, noisy_gate_policy="none", use_residual=False, drop_tokens=True,
                             use_rts=False, ep_size=1)
    layer = DeepSpeedMoEMLP(moe, d_model=4, experts=2, top2_2nd_expert_sampling=False)
    with torch.no_grad():
        layer.gate_weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))
    x = torch.zeros(8, 4)
    x[:6, 0] = 1.0
    x[6:, 1] = 1.0
    x[:, 2] = torch.arange(1.0, 9.0)
    return layer, x


def _gate_output(layer, x, form: str) -> tuple:
    """The gate's own output in `form`, through its forward (so the adapter's hook sees it too)."""
    gate = layer.moe.deepspeed_moe.gate
    if form == "dense":
        out = gate(x, None)  # every release: without sparse_routes the gate returns the dense form
        assert len(out) == DENSE_GATE_OUTPUT and out[2].shape[:2] == (8, 2)
        return out
    if "sparse_routes" not in inspect.signature(gate.forward).parameters:
        pytest.skip("this DeepSpeed's gate has no sparse routes (before 0.19.x)")
    out = gate(x, None, sparse_routes=True)
    assert len(out) == SPARSE_GATE_OUTPUT
    if form == "tutel-lists":  # older releases' Tutel path: indices as one [s] tensor per k
        out = (*out[:3], list(out[3].unbind(0)), list(out[4].unbind(0)), list(out[5].unbind(0)), out[6])
    return out


# (top_k, capacity, routes, dropped, dropped_tokens, exp_counts, kept): the hand-made routings of
# tests/variants/test_run_deepspeed.py (top-1: expert 0 keeps 2 of its 6 tokens; top-2: tokens 4 and 5
# lose both routes).
EXPECTED = {1: (2, 8, 4, 4, [6, 2], [2, 2]), 2: (4, 16, 8, 2, [8, 8], [4, 4])}


@pytest.mark.parametrize("form", ["sparse", "dense", "tutel-lists"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_each_gate_form_gives_the_same_routing_record(form, top_k):
    layer, x = _hand_routed_layer(top_k)
    out = _gate_output(layer, x, form)
    rec = routing_record(out, top_k=top_k)
    capacity, routes, dropped, dropped_tokens, exp_counts, kept = EXPECTED[top_k]
    assert (rec.capacity, rec.routes, rec.dropped, rec.tokens, rec.dropped_tokens) == (
        capacity, routes, dropped, 8, dropped_tokens)
    assert rec.exp_counts.tolist() == exp_counts and rec.kept_per_expert.tolist() == kept
    if form != "tutel-lists":  # the forward hook read the same record from the gate's forward
        assert _plain(layer.last) == _plain(rec)


def _plain(rec) -> dict:
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in vars(rec).items()}


def test_an_unknown_gate_output_names_both_forms():
    with pytest.raises(TypeError, match=r"5 items.*sparse \(7\).*dense \(4\)"):
        routing_record((torch.zeros(()),) * 5, top_k=1)

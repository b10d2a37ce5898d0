"""gpu-check's layer comparison (moebench.gpucheck.layers): the reference against itself passes every
gate; each kind of broken implementation fails the check that must catch it, with its diagnosis.
The real fmoe against the reference runs on a CUDA GPU only (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from moebench.gpucheck import layers
from moebench.models.moe.layer import FMoEReference

SMALL = layers.Dims(experts=4, d_model=16, d_hidden=32, tokens=64)
"""Small enough for CPU; the same code runs at layers.Dims() on the GPU."""


def _cases(*gates: str):
    return tuple(c for c in layers.GATE_CASES if c.gate in gates)


def _failures(doc: dict) -> dict[str, dict]:
    return {g["gate"]: g["first_failure"] for g in doc["gates"] if g["status"] == "fail"}


def _wrapped(make):
    """A factory whose layers are the reference's, changed by `make(layer)`."""
    def factory(gate, top_k, dims):
        return make(layers.reference_factory(gate, top_k, dims))
    return factory


def test_the_reference_against_itself_passes_every_gate():
    doc = layers.compare_gates(layers.reference_factory, device="cpu", dims=SMALL)
    assert doc["status"] == "pass", _failures(doc)
    assert [g["gate"] for g in doc["gates"]] == ["naive", "gshard", "switch", "noisy"]
    for gate in doc["gates"]:
        names = [c["name"] for c in gate["comparisons"]]
        assert {"output", "input grad", "aux loss"} <= set(names)
        assert any(n.startswith("grad experts.") for n in names) and any(n.startswith("grad gate.") for n in names)
        assert any(n.startswith("weights: ") for n in names)
        assert gate["worst_ratio"] < 1e-3  # the same code: no difference at all, far inside the tolerance
    gshard = next(g for g in doc["gates"] if g["gate"] == "gshard")
    assert not next(c for c in gshard["comparisons"] if c["name"] == "aux loss")["asserted"]  # reported only


class _IgnoresScores(FMoEReference):
    def moe_forward(self, x, topk_idx, topk_score):
        return super().moe_forward(x, topk_idx, torch.ones_like(topk_score))


def test_an_output_that_ignores_the_gate_scores_fails():
    def factory(gate, top_k, dims):
        ref = layers.reference_factory(gate, top_k, dims)
        broken = _IgnoresScores(num_expert=dims.experts, d_model=dims.d_model, d_hidden=dims.d_hidden, top_k=top_k,
                                gate=type(ref.gate), return_aux=True)
        broken.load_state_dict(ref.state_dict())
        return broken

    doc = layers.compare_gates(factory, device="cpu", dims=SMALL, cases=_cases("naive"))
    assert _failures(doc)["naive"]["name"] == "output"


class _ScaleInputGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_an_input_gradient_scaled_by_two_fails_as_uniform_scale():
    class Broken(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.gate = inner.gate

        def forward(self, x):
            return self.inner(_ScaleInputGrad.apply(x))

        def state_dict(self, *a, **k):
            return self.inner.state_dict(*a, **k)

        def load_state_dict(self, *a, **k):
            return self.inner.load_state_dict(*a, **k)

        def named_parameters(self, *a, **k):
            return self.inner.named_parameters(*a, **k)

    doc = layers.compare_gates(_wrapped(Broken), device="cpu", dims=SMALL, cases=_cases("naive"))
    failure = _failures(doc)["naive"]
    assert failure["name"] == "input grad" and failure["diagnosis"] == "uniform-scale", failure
    naive = doc["gates"][0]
    assert next(c for c in naive["comparisons"] if c["name"] == "output")["passed"]


def test_a_parameter_gradient_that_never_arrives_fails_as_zero():
    def detach_expert(layer):
        layer.experts[1].htoh4.weight.register_hook(lambda g: torch.zeros_like(g))
        return layer

    doc = layers.compare_gates(_wrapped(detach_expert), device="cpu", dims=SMALL, cases=_cases("naive"))
    naive = doc["gates"][0]
    failed = [c["name"] for c in naive["comparisons"] if not c["passed"]]
    assert failed == ["grad experts.1.htoh4.weight"], failed
    assert naive["first_failure"]["diagnosis"] == "zero"


def test_weights_drawn_in_another_order_fail_and_the_rest_is_judged_on_equal_weights():
    def gate_first(gate, top_k, dims):
        torch.manual_seed(dims.seed + 99)  # another draw: the same seed no longer gives the same weights
        return layers.reference_factory(gate, top_k, dims)

    doc = layers.compare_gates(gate_first, device="cpu", dims=SMALL, cases=_cases("naive"))
    naive = doc["gates"][0]
    assert naive["first_failure"]["diagnosis"] == "weights-differ"
    computed = [c for c in naive["comparisons"] if not c["name"].startswith("weights: ")]
    assert all(c["passed"] for c in computed)  # the reference's weights were loaded: same computation


def test_renamed_parameters_fail_as_parameter_names():
    class Renamed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.moe = inner
            self.gate = inner.gate

        def forward(self, x):
            return self.moe(x)

    doc = layers.compare_gates(_wrapped(Renamed), device="cpu", dims=SMALL, cases=_cases("naive"))
    assert doc["gates"][0]["first_failure"]["diagnosis"] == "parameter-names"


def test_a_wrong_aux_loss_fails_where_it_is_judged():
    class DoubleAux(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.gate = inner.gate

        def forward(self, x):
            y, aux = self.inner(x)
            return y, aux * 2

        def state_dict(self, *a, **k):
            return self.inner.state_dict(*a, **k)

        def named_parameters(self, *a, **k):
            return self.inner.named_parameters(*a, **k)

    doc = layers.compare_gates(_wrapped(DoubleAux), device="cpu", dims=SMALL, cases=_cases("switch"))
    assert _failures(doc)["switch"]["name"] == "aux loss"


def test_a_candidate_that_raises_on_one_gate_fails_that_gate_only():
    def factory(gate, top_k, dims):
        if gate == "noisy":
            raise RuntimeError("no kernel for this gate")
        return layers.reference_factory(gate, top_k, dims)

    doc = layers.compare_gates(factory, device="cpu", dims=SMALL)
    assert doc["status"] == "fail"
    assert _failures(doc) == {"noisy": {"name": "forward/backward", "note": "", "diagnosis": "raised",
                                        "sentence": "RuntimeError: no kernel for this gate"}}


@pytest.mark.gpu
def test_real_fmoe_matches_the_reference_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the real fmoe is CUDA-only): run `make gpu-check` on one")
    pytest.importorskip("fmoe", reason="fastmoe is not built: FASTMOE_SRC= with make gpu-check builds it")
    torch.backends.cuda.matmul.allow_tf32 = False
    doc = layers.compare_gates(layers.fmoe_factory, device="cuda")
    assert doc["status"] == "pass", _failures(doc)

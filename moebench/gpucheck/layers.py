"""gpu-check's layer step: the real `fmoe` layer against moebench's reference layer, gate by gate.

    python -m moebench.gpucheck.layers [--device cuda] [--candidate fmoe|reference]

For each gate (naive, gshard, switch, noisy) both layers are built from the same seed, then:
- weights: the same seed must give bit-identical weights (same names, shapes, draw order); if they
  differ the reference's are loaded into the candidate so the rest still judges the computation;
- one forward and backward on the same input with the random stream reseeded before each (the
  gates' noise and jitter draw the same numbers): the output, the aux loss, the input gradient and
  every parameter's gradient, each judged by `LAYER_TOL` (moebench.parity.compare: a failure names
  its diagnosis, e.g. `zero`, `uniform-scale`, `shape`).
Where fastmoe and the reference differ on purpose (moebench/models/moe/gates.py), the case is set
so that both must agree: capacities made non-binding (fastmoe keeps the slots that win an atomic
race, the reference the first ones), GShard's random routing off (fastmoe takes its top-2 unsorted,
so its "second" expert is not always the second best), the noisy gate at k = 1 (fastmoe's pairs slot
i with token i for k > 1). GShard's aux loss is reported, not judged: fastmoe counts column 0 of an
unsorted top-2 as the top-1.

`compare_gates(make_candidate, ...)` takes any factory, so the CPU tests feed it the reference itself
(everything passes) and broken stand-ins (each check fails with its diagnosis).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Callable

import torch

from moebench.parity.compare import EXACT, Tolerance, assertion, compare

LAYER_TOL = Tolerance(
    rtol=1e-4, atol_fraction=1e-4,
    source="gpu-check layers: 1e-4 relative, atol 1e-4 x largest |expected|: fp32 with TF32 off; fmoe's cuBLAS "
           "GEMMs and the reference's F.linear sum in another order (~sqrt(4096) x 6e-8 = 4e-6 per element, "
           "more for weight gradients summed over 512 tokens): 25x margin, and 10^3 below a wrong expert or score")
"""Set before any GPU run (none has happened yet): the measured worst goes in docs/gpu.md."""
AUX_IN_LOSS = 1.0
"""Weight of the gate's aux loss in the loss whose gradients are compared (when the aux is judged), so
that the balance loss's gradient path into the gate is compared too."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dims:
    experts: int = 16
    d_model: int = 256
    d_hidden: int = 512
    tokens: int = 512
    seed: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateCase:
    gate: str
    top_k: int
    non_binding_capacity: bool = False
    random_routing: bool | None = None
    """GShard's random routing (None: the gate has none)."""
    judge_aux: bool = True
    note: str = ""


GATE_CASES = (
    GateCase(gate="naive", top_k=2, note="fastmoe's default, the chapter's gate"),
    GateCase(gate="gshard", top_k=2, non_binding_capacity=True, random_routing=False, judge_aux=False,
             note="capacity non-binding, random routing off; aux reported only (fastmoe's unsorted top-2)"),
    GateCase(gate="switch", top_k=1, non_binding_capacity=True, note="capacity non-binding; jitter from one seed"),
    GateCase(gate="noisy", top_k=1, note="k = 1 (fastmoe's noisy gate mispairs slots for k > 1); noise from one seed"),
)

Factory = Callable[[str, int, Dims], torch.nn.Module]
"""(gate, top_k, dims) -> an MoE MLP holding all dims.experts experts whose forward returns (y, aux)."""


def reference_factory(gate: str, top_k: int, dims: Dims) -> torch.nn.Module:
    from moebench.models.moe import build_moe_mlp

    return build_moe_mlp(backend="reference", experts=dims.experts, d_model=dims.d_model, d_hidden=dims.d_hidden,
                         top_k=top_k, gate=gate)


def fmoe_factory(gate: str, top_k: int, dims: Dims) -> torch.nn.Module:
    from moebench.models.moe import build_moe_mlp

    return build_moe_mlp(backend="fmoe", experts=dims.experts, d_model=dims.d_model, d_hidden=dims.d_hidden,
                         top_k=top_k, gate=gate, device="cuda")


def _prepare(layer: torch.nn.Module, case: GateCase, dims: Dims) -> None:
    gate = layer.gate
    if case.non_binding_capacity:
        rate = float(dims.experts)  # capacity >= every slot of the batch, for either formula
        gate.capacity = (rate, rate)
    if case.random_routing is not None:
        gate.random_routing = case.random_routing


def _forward_backward(layer, x, probe, case: GateCase, seed: int):
    torch.manual_seed(seed)  # every CUDA device too: the gates' noise draws the same numbers in both
    x = x.detach().clone().requires_grad_()
    y, aux = layer(x)
    loss = (y * probe).sum() + (AUX_IN_LOSS * aux.reshape(()) if case.judge_aux else 0.0)
    loss.backward()
    grads = {name: (None if p.grad is None else p.grad.detach()) for name, p in layer.named_parameters()}
    return y.detach(), aux.detach().reshape(()), x.grad, grads


def _weights(ref, cand) -> tuple[list, bool]:
    """Comparisons of the two state_dicts; and whether they are the same names (then they can be copied)."""
    rs, cs = ref.state_dict(), cand.state_dict()
    if sorted(rs) != sorted(cs):
        extra, missing = sorted(set(cs) - set(rs))[:3], sorted(set(rs) - set(cs))[:3]
        c = assertion("weights: parameter names", False,
                      note=f"candidate has {extra or 'nothing more'}, lacks {missing or 'nothing'}")
        c.diagnosis = {"name": "parameter-names", "sentence": "the state_dicts name other parameters "
                       "(a checkpoint would not move between the two)",
                       "details": {"extra": extra, "missing": missing}}
        return [c], False
    out = [compare(f"weights: {name}", cs[name], rs[name], EXACT) for name in sorted(rs)]
    for c in out:
        if not c.passed:
            c.diagnosis = {"name": "weights-differ", "sentence": "the same seed gives other weights (another draw "
                           "order or initialisation)", "details": dict(c.diagnosis or {})}
    return out, True


def run_case(case: GateCase, make_candidate: Factory, device: str, dims: Dims,
             make_reference: Factory = reference_factory) -> dict:
    """One gate: every comparison, and the gate's status and first diagnosis."""
    torch.manual_seed(dims.seed)
    ref = make_reference(case.gate, case.top_k, dims)
    torch.manual_seed(dims.seed)
    cand = make_candidate(case.gate, case.top_k, dims)
    comparisons, same_names = _weights(ref, cand)
    if same_names and not all(c.passed for c in comparisons):
        cand.load_state_dict(ref.state_dict())  # judge the computation on equal weights
    ref, cand = ref.to(device).train(), cand.to(device).train()
    for layer in (ref, cand):
        _prepare(layer, case, dims)
    g = torch.Generator().manual_seed(dims.seed + 1)
    x = torch.randn(dims.tokens, dims.d_model, generator=g).to(device)
    probe = torch.randn(dims.tokens, dims.d_model, generator=g).to(device)
    y_r, aux_r, gx_r, grads_r = _forward_backward(ref, x, probe, case, dims.seed + 2)
    y_c, aux_c, gx_c, grads_c = _forward_backward(cand, x, probe, case, dims.seed + 2)
    comparisons.append(compare("output", y_c, y_r, LAYER_TOL))
    comparisons.append(compare("aux loss", aux_c, aux_r, LAYER_TOL, asserted=case.judge_aux,
                               note="" if case.judge_aux else "reported only: " + case.note))
    comparisons.append(compare("input grad", gx_c, gx_r, LAYER_TOL))
    for name, expected in grads_r.items():
        actual = grads_c.get(name)
        if expected is None:
            continue
        if actual is None:
            c = assertion(f"grad {name}", False, note="the candidate's parameter got no gradient")
            c.diagnosis = {"name": "no-gradient", "sentence": "no gradient reached it (detached)", "details": {}}
            comparisons.append(c)
        else:
            comparisons.append(compare(f"grad {name}", actual, expected, LAYER_TOL))
    failed = [c for c in comparisons if c.asserted and not c.passed]
    first = failed[0] if failed else None
    return {"gate": case.gate, "top_k": case.top_k, "note": case.note, "status": "fail" if failed else "pass",
            "comparisons_total": len(comparisons), "comparisons_failed": len(failed),
            "worst_ratio": max((c.ratio() for c in comparisons if c.asserted), default=0.0),
            "first_failure": None if first is None else {"name": first.name, "note": first.note,
                                                         "diagnosis": (first.diagnosis or {}).get("name", "failed"),
                                                         "sentence": (first.diagnosis or {}).get("sentence", "")},
            "comparisons": [c.to_dict() for c in comparisons]}


def compare_gates(make_candidate: Factory, *, device: str = "cuda", dims: Dims = Dims(),
                  cases: tuple[GateCase, ...] = GATE_CASES) -> dict:
    """Every gate case; a case that raises is a failure with the error (the others still run)."""
    gates = []
    for case in cases:
        try:
            gates.append(run_case(case, make_candidate, device, dims))
        except Exception as exc:  # noqa: BLE001 - a candidate that crashes on one gate is that gate's finding
            gates.append({"gate": case.gate, "top_k": case.top_k, "note": case.note, "status": "fail",
                          "comparisons_total": 0, "comparisons_failed": 0, "worst_ratio": None,
                          "first_failure": {"name": "forward/backward", "note": "", "diagnosis": "raised",
                                            "sentence": f"{type(exc).__name__}: {exc}"[:300]},
                          "comparisons": []})
    return {"status": "pass" if all(g["status"] == "pass" for g in gates) else "fail", "device": device,
            "dims": dataclasses.asdict(dims), "tolerance": dataclasses.asdict(LAYER_TOL), "gates": gates}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moebench.gpucheck.layers")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--candidate", choices=("fmoe", "reference"), default="fmoe")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs on both sides (LAYER_TOL assumes it)
        torch.backends.cudnn.allow_tf32 = False
    factory = fmoe_factory if args.candidate == "fmoe" else reference_factory
    doc = compare_gates(factory, device=args.device)
    print(json.dumps(doc, default=str))
    return 0 if doc["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())

"""A user row on every rank (user_rows.py defines the rows; user_step.py takes Automodel's trainer step and its
one-process reference): the model built, stepped both ways, and compared.

The model: Automodel's class for the config's model_type (Qwen3MoeForCausalLM, DeepseekV3ForCausalLM) from the small
config with the user's routing keys and `model.moe_overrides`, the recipe's expert backend (on CPU: te / gmm resolve
to torch_mm in Automodel's own BackendConfig) and the torch dispatcher; the reference is a deep copy taken before
parallelizing. After each step: SGD on both, and `update_moe_gate_bias()` where the class has it (as the trainer
checks), the reference's from its own (global) expert load; torch's clip_grad_norm_ on the reference.

Compared (strict float32): the model's MoEConfig as recorded, the output, every gradient before the clip (router,
each rank's block of experts by global index, the rest), the clip norm (after asserting that the clip binds), the
routing bias after every step (where it is updated), the loss curve and every weight after the steps. Known-wrong
references name a failure: each dense gradient as this rank's own, never reduced (`rank-local`), as the last
micro-batch's alone (`accum-boundary`), the routing bias from this rank's load alone; a router gradient exactly zero
is `router-detached`. The bf16 row: one step's gradients and loss in the recipe's bf16 (Automodel's default mixed
precision: bf16 parameters, float32 reduction) judged by the noise model against float32 on one process.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

from moebench.libraries.automodel import api
from moebench.libraries.automodel.user_rows import LR, RecipeSettings
from moebench.libraries.automodel.user_step import (
    bias_and_gate,
    clip_without_ep,
    micro_batches,
    parallel_step,
    parallelize,
    reference_step,
    route_every_expert,
    routes_of,
    scale_without_ep,
)
from moebench.libraries.spec import Row

DETACHED_WHERE = "in Automodel: GroupedExperts gathers them over the EP ranks with differentiable=False"
NORM_WHERE = "training.utils.clip_grad_norm: the norm was not reduced over the EP mesh"
BIAS_CAUSE = ("update_bias must sum the expert load over the data-parallel ranks: Automodel's apply_fsdp spreads the "
              "routing bias as a Replicate DTensor for that (NVIDIA-NeMo/Automodel#3348)")


def run(ctx, row: Row, opts) -> list:
    """A user row on this rank (float32 or bf16), eager (TORCH_COMPILE), Automodel's and transformers' chatter off
    the console."""
    import logging
    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    torch.compiler.set_stance("force_eager")  # this rank only: ranks are forked per row
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    logging.getLogger("nemo_automodel").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return (_run if row.settings.precision == "fp32" else _run_bf16)(ctx, row, opts)
    finally:
        hf_logging.set_verbosity(level)


def _ref_name(name: str) -> str:
    return name.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")


def _whole(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _known_wrong(deltas: dict, name: str, r: int, w: int, acc: int) -> dict[str, Any]:
    """The known-wrong references of a dense gradient, from the reference's per-(rank, micro-batch) gradients."""
    from moebench.parity.diagnose import rank_local
    from moebench.parity.diagnosis import ACCUM_BOUNDARY

    if not deltas or name not in deltas[0, 0]:
        return {}
    mine = sum(deltas[r, m][name] for m in range(acc)) * w
    out = {"this rank's own gradient": rank_local(mine)}
    if acc > 1:
        last = sum(deltas[rr, acc - 1][name] for rr in range(w))
        out["the last micro-batch alone"] = (
            last, "the last micro-batch's gradient alone", ACCUM_BOUNDARY,
            "the gradients of the earlier micro-batches were dropped at the accumulation boundary (zeroed, or never "
            "reduced before the last backward)")
    return out


def _check_moe(out: list, moe, s: RecipeSettings, r: int) -> None:
    """The built model's MoEConfig is the one the row records (what the user's setup resolved to)."""
    from moebench.parity.compare import assertion
    from moebench.parity.diagnosis import ROUTER

    gate = moe.gate
    got = {"num_experts": gate.n_experts, "top_k": gate.topk, "score_func": gate.score_func,
           "norm_topk_prob": bool(gate.norm_topk_prob), "n_expert_groups": gate.n_groups,
           "n_limited_groups": gate.topk_groups, "route_scale": float(gate.route_scale),
           "gate_bias_update_factor": float(gate.bias_update_factor), "aux_loss_coeff": float(gate.aux_loss_coeff)}
    want = {k: getattr(s, k) for k in got}
    wrong = {k: (got[k], want[k]) for k in got if got[k] != want[k]}
    out.append(assertion("the model's MoE routing is the setup's (experts, top-k, score, normalisation, groups, "
                         "scale, bias update, aux loss)", not wrong, rank=r, group=ROUTER,
                         note="; ".join(f"{k}: built {a!r}, setup {b!r}" for k, (a, b) in wrong.items())))


def _run(ctx, row: Row, opts) -> list:
    """A float32 user row on this rank (the module docstring)."""
    import torch

    from moebench.parity.compare import SEED_ALLCLOSE_DEFAULT, STRICT, assertion, compare, of_terms, pick
    from moebench.parity.diagnosis import EXPERTS, OUTPUT, ROUTER

    s: RecipeSettings = row.settings
    tol, asserted = pick(opts.tolerance, strict=STRICT, seed=SEED_ALLCLOSE_DEFAULT)
    r, w = ctx.rank, ctx.world_size
    model, moe = api.build_user(row.model, json.loads(s.routing), json.loads(s.moe_overrides), _backend(s),
                                opts.seed, torch.float32, q_lora_rank=s.q_lora_rank)
    route_every_expert(model, s, opts.seed, ctx.world_size)
    out: list = []
    _check_moe(out, moe, s, r)
    ref = copy.deepcopy(model)  # the same weights, on this process alone
    vocab = model.config.vocab_size
    _, moe_mesh = parallelize(model, s, w, fp32=True)
    ep_rank = moe_mesh["ep"].get_local_rank() if moe_mesh is not None else 0
    per = s.num_experts // s.ep_size
    mine = slice(ep_rank * per, (ep_rank + 1) * per)
    ref_params = dict(ref.named_parameters())
    params = {_ref_name(n): p for n, p in model.named_parameters()}
    order = sorted(params, key=lambda n: (_group(n) != ROUTER, _group(n) == EXPERTS, n))

    def cmp(name, actual, expected, group, **kw):
        c = compare(name, actual, expected, tol, rank=r, asserted=asserted, world_size=w, group=group, **kw)
        out.append(c)
        return c

    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, foreach=False)
    curve, ref_curve, moved = [], [], False
    for step in range(s.steps):
        batches = micro_batches(s, opts.seed, step, w, vocab)
        tokens = sum(t.numel() for _, t in batches)
        local, y = parallel_step(model, s, batches, r, w, tokens, vocab)
        with routes_of(ref) as routes:
            ref_loss, ref_outputs, deltas = reference_step(ref, s, batches, w, tokens, vocab, snapshot=step == 0)
        if step == 0:  # the premise: an expert no token reaches compares zero with zero inside its rank's block
            fewest = min(routes)
            out.append(assertion(f"every expert gets tokens at step 1 (the reference: {sum(routes)} routes over "
                                 f"{len(routes)} experts, the fewest {fewest})", fewest > 0, rank=r, group=EXPERTS,
                                 note="" if fewest else f"{routes.count(0)} expert(s) get none: give another --seed"))
        api.scale_grads(model, moe_mesh, w) if moe_mesh is not None else scale_without_ep(model, w)
        total = torch.tensor(local, dtype=torch.float64)
        torch.distributed.all_reduce(total)  # the global loss: the sum of the ranks' shares
        curve.append(float(total))
        ref_curve.append(ref_loss)
        if step == 0:
            output = cmp("output (logits, micro-batch 1)", y, ref_outputs[r], OUTPUT)
            _first_step(out, cmp, s, r, w, model, ref, params, ref_params, order, mine, deltas, moe_mesh,
                        output.passed)
        elif s.max_grad_norm > 0:
            api.clip_grad_norm(model, moe_mesh, s.max_grad_norm) if moe_mesh is not None else \
                clip_without_ep(model, s.max_grad_norm)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), s.max_grad_norm)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
        if s.update_bias:  # the trainer: `if hasattr(model, "update_moe_gate_bias")`, after the optimizer's step
            model.update_moe_gate_bias()
            ref.update_moe_gate_bias()
            bias, ref_bias = _whole(bias_and_gate(model)[0]), bias_and_gate(ref)[0].detach()
            moved = moved or bool(ref_bias.abs().sum() > 0)
            cmp(f"the routing bias (e_score_correction_bias) after step {step + 1}", bias, ref_bias, ROUTER,
                alternatives=_bias_alternatives(s, step, r))
    if s.update_bias:
        out.append(assertion(f"the routing bias moved in {s.steps} steps (the row checks a state that changes)",
                             moved, rank=r, group=ROUTER, note="" if moved else "it is still all zeros"))
    out.append(compare(f"loss curve ({s.steps} SGD steps)", torch.tensor(curve), torch.tensor(ref_curve),
                       of_terms(tol, max(abs(v) for v in ref_curve)), rank=r, asserted=asserted, world_size=w,
                       group=OUTPUT))
    for name in order:
        got, want = _whole(params[name]), ref_params[name].detach()
        if _group(name) == EXPERTS:
            cmp(f"{name}[experts {mine.start}-{mine.stop - 1}] after {s.steps} SGD steps", got[mine], want[mine],
                EXPERTS)
        else:
            cmp(f"{name} after {s.steps} SGD steps", got, want, _group(name))
    return out


def _backend(s: RecipeSettings) -> dict[str, Any]:
    return {"experts": s.experts, "dispatcher": "torch", "rms_norm": s.rms_norm,
            "fake_balanced_gate": s.fake_balanced_gate, "gate_precision": s.gate_precision}


def _group(name: str) -> str:
    from moebench.parity.diagnosis import EXPERTS, REPLICATED, ROUTER

    if ".experts." in f".{name}" and "shared_experts" not in name:
        return EXPERTS
    return ROUTER if ".gate." in f".{name}" else REPLICATED


def _bias_alternatives(s: RecipeSettings, step: int, r: int) -> dict[str, Any]:
    """Step 1's routing bias as an update from this rank's own expert load would give it (the bias starts at 0)."""
    loads = _BIAS_LOADS.get(r) if step == 0 else None
    if loads is None:
        return {}
    import torch

    from moebench.parity.diagnosis import RANK_LOCAL

    bias = torch.sign(loads.float().mean() - loads.float()) * s.gate_bias_update_factor
    return {"this rank's expert load only": (bias, "a bias updated from this rank's expert load only", RANK_LOCAL,
                                             BIAS_CAUSE)}


_BIAS_LOADS: dict[int, Any] = {}
"""This rank's own expert load of step 1 (set by _first_step where the gate keeps it)."""


def _first_step(out, cmp, s, r, w, model, ref, params, ref_params, order, mine, deltas, moe_mesh, output_ok) -> None:
    """Step 1's comparisons: every gradient before the clip (router first), then the clip's premise and norm."""
    import torch

    from moebench.parity.compare import assertion
    from moebench.parity.diagnose import per_rank_norm, router_detached
    from moebench.parity.diagnosis import EXPERTS, REPLICATED, ROUTER, VACUOUS_ROW, make

    _, gate = bias_and_gate(model)
    load = getattr(gate, "_cumulative_expert_load", None)
    _BIAS_LOADS[r] = load.detach().clone() if load is not None else None
    mine_sq = 0.0
    for name in order:
        p, group = params[name], _group(name)
        ref_grad = ref_params[name].grad
        grad = _whole(p.grad) if p.grad is not None else None
        if grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            mine_sq += float(local.double().square().sum())
        if group == EXPERTS:
            if grad is None:
                grad = torch.zeros_like(ref_params[name])
            cmp(f"grad {name}[experts {mine.start}-{mine.stop - 1}]", grad[mine], ref_grad[mine], EXPERTS)
            continue
        if ref_grad is None and grad is None:
            continue
        ref_grad = torch.zeros_like(ref_params[name]) if ref_grad is None else ref_grad
        c = cmp(f"grad {name}", torch.zeros_like(ref_grad) if grad is None else grad, ref_grad, group,
                alternatives=_known_wrong(deltas, name, r, w, s.grad_acc_steps),
                note="no gradient reached it (None)" if grad is None else "")
        if group == ROUTER and output_ok:
            router_detached(c, DETACHED_WHERE)
    if s.max_grad_norm <= 0:
        return
    ref_total = math.sqrt(sum(float(p.grad.double().square().sum()) for p in ref.parameters() if p.grad is not None))
    premise = assertion(f"the clip binds: the reference's norm {ref_total:.4g} > max_grad_norm {s.max_grad_norm:g} "
                        f"(loss x {s.loss_multiplier:g})", ref_total > s.max_grad_norm, rank=r, group=REPLICATED)
    if not premise.passed:
        premise.diagnosis = make(VACUOUS_ROW, "the row's premise fails: its clip does not bind")
    out.append(premise)
    norm = api.clip_grad_norm(model, moe_mesh, s.max_grad_norm) if moe_mesh is not None else \
        clip_without_ep(model, s.max_grad_norm)
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), s.max_grad_norm))
    cmp(f"clip norm (training.utils.clip_grad_norm, max_norm {s.max_grad_norm:g})", torch.tensor(norm),
        torch.tensor(ref_norm), REPLICATED,
        alternatives={"per-rank norm": per_rank_norm(torch.tensor(math.sqrt(mine_sq)), NORM_WHERE)})


def _run_bf16(ctx, row: Row, opts) -> list:
    """The bf16 user row: one step's micro-batches in the recipe's bf16 (Automodel builds the model in bf16; FSDP2's
    default mixed precision), its gradients after the trainer's scaling and its loss judged by the noise model
    against the float32 model on one process; the baseline: the same bf16 model on one process."""
    import torch
    import torch.distributed as dist

    from moebench.parity import noise
    from moebench.parity.compare import assertion
    from moebench.parity.diagnosis import EXPERTS, OUTPUT, REPLICATED, ROUTER, ROUTER_DETACHED, make

    s: RecipeSettings = row.settings
    r, w = ctx.rank, ctx.world_size
    routing, overrides = json.loads(s.routing), json.loads(s.moe_overrides)
    ref, _ = api.build_user(row.model, routing, overrides, _backend(s), opts.seed, torch.float32,
                            q_lora_rank=s.q_lora_rank)
    route_every_expert(ref, s, opts.seed, w)  # the float32 row's weights (loaded into the bf16 model below)
    par, _ = api.build_user(row.model, routing, overrides, _backend(s), opts.seed, torch.bfloat16,
                            q_lora_rank=s.q_lora_rank)
    par.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
    base = copy.deepcopy(par)
    vocab = ref.config.vocab_size
    _, moe_mesh = parallelize(par, s, w, fp32=False)
    batches = micro_batches(s, opts.seed, 0, w, vocab)
    tokens = sum(t.numel() for _, t in batches)
    local, _y = parallel_step(par, s, batches, r, w, tokens, vocab)
    api.scale_grads(par, moe_mesh, w) if moe_mesh is not None else scale_without_ep(par, w)
    ref_loss, _, _ = reference_step(ref, s, batches, w, tokens, vocab, snapshot=False)
    base_loss, _, _ = reference_step(base, s, batches, w, tokens, vocab, snapshot=False)
    ref_params, base_params = dict(ref.named_parameters()), dict(base.named_parameters())
    groups = {g: torch.zeros(3, dtype=torch.float64) for g in (EXPERTS, ROUTER, REPLICATED)}
    baseline = {g: torch.zeros(3, dtype=torch.float64) for g in groups}
    missing = []
    for name, p in par.named_parameters():
        name = _ref_name(name)
        g, ref_grad = _group(name), ref_params[name].grad
        if ref_grad is None:
            continue
        grad = _whole(p.grad).float() if p.grad is not None else None
        baseline[g] += noise.sums([(base_params[name].grad.float(), ref_grad)], 1 / w)
        if grad is None:
            missing.append(name)
            grad = torch.zeros_like(ref_grad)
        groups[g] += noise.sums([(grad, ref_grad)], 1 / w)  # every rank holds the whole: counted once over W
    sums = torch.stack(list(groups.values()))
    dist.all_reduce(sums)
    groups = dict(zip(groups, sums))
    total = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(total)
    loss_pair = noise.sums([(torch.tensor([float(total)]), torch.tensor([ref_loss]))])
    loss = noise.judge("step 1", "loss", loss_pair, noise.sums([(torch.tensor([base_loss]),
                                                                 torch.tensor([ref_loss]))]), rank=r, group=OUTPUT)
    out = [loss]
    for g in (ROUTER, EXPERTS, REPLICATED):
        gone = [n for n in missing if _group(n) == g]
        c = assertion(f"every {g} parameter has a gradient", not gone, rank=r, group=g,
                      note=f"missing (None): {', '.join(gone)}" if gone else "")
        if gone and g == ROUTER and loss.passed:
            c.diagnosis = make(ROUTER_DETACHED, "got no gradient (None) while the loss is right: "
                               "the routing weights reach the experts through a non-differentiable gather, so no "
                               f"gradient returns to the router ({DETACHED_WHERE})")
        out.append(c)
    for g, words in ((ROUTER, "router gradient"), (EXPERTS, "expert gradient"), (REPLICATED, "other gradient")):
        if float(baseline[g][2]) == 0:  # no such parameter (the reference's squared norm of the group)
            continue
        judged = noise.judge("step 1", words, groups[g], baseline[g], rank=r, group=g)  # each group on its own:
        if not judged.passed:  # the dense layers' gradients would drown a wrong expert share in one sum
            judged.diagnosis = _bf16_diagnosis(groups, baseline, judged, w)
        out.append(judged)
    return out


def _bf16_diagnosis(groups: dict, baseline: dict, judged, world_size: int) -> dict[str, Any]:
    """A bf16 gradient farther from float32 than the noise model allows: the groups scaled by one factor
    (`uniform-scale`, "summed instead of averaged" where the factor is W), else the distance (`bf16-noise`)."""
    from moebench.parity import noise
    from moebench.parity.diagnosis import BF16_NOISE, UNIFORM_SCALE, make

    present = {g: v for g, v in groups.items() if v[2] > 0}
    scaled, right = noise.scaled_groups(present, {g: baseline[g] for g in present})
    k = noise.common_factor(scaled)
    if k is not None and right == set(present) - set(scaled):
        integer = round(k) if round(k) >= 2 and abs(k - round(k)) <= noise.GROUP_FIT_RTOL * k else None
        why = f": summed instead of averaged over {world_size} ranks (the world size)" if integer == world_size else ""
        return make(UNIFORM_SCALE, f"bf16: {', '.join(sorted(scaled))} gradients scaled by {k:.3g}{why}",
                    integer=integer, scale=k, groups=sorted(scaled))
    return make(BF16_NOISE, f"{judged.name.split(': ', 1)[1]} ({judged.note})")

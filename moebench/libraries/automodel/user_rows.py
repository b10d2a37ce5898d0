"""The rows of a user's own Automodel setup (--recipe, --hf-config; user_setup.py reads them): the recipe's model,
shrunk, parallelized and trained as Automodel's trainer does it, against the same model on one process.

A row, on every rank:
- the model: Automodel's class for the config's model_type (Qwen3MoeForCausalLM, DeepseekV3ForCausalLM) from the
  small config with the user's routing keys and `model.moe_overrides`, the recipe's expert backend (on CPU: te / gmm
  resolve to torch_mm in Automodel's own BackendConfig) and the torch dispatcher; the reference is a deep copy taken
  before parallelizing;
- the layout: Automodel's own meshes from the recipe's `distributed:` section (`create_distributed_setup_from_config`,
  its ep_size fitted to the ranks: user_setup.fit_ep) and its own parallelizer (0.7:
  `distributed.model_parallelizer.parallelize_model(model, mesh_context)`; before: `moe.parallelizer.
  parallelize_model` with the mesh's axis names): apply_ep, activation checkpointing as the recipe asks, FSDP2 over
  the data-parallel ranks (which also spreads the gate's routing bias, so that its update sums every rank's load);
  float32 rows run FSDP's mixed precision in float32 (the row's `mp_policy`);
- a step as recipes/llm/train_ft.py takes it: the global label-token count over every micro-batch; per micro-batch
  each rank's loss is its tokens' cross-entropy sum / that count and `(loss * dp).backward()`, FSDP's sync held back
  until the last micro-batch (`prepare_for_grad_accumulation` / `prepare_for_final_backward`), the aux-loss backward
  scale 1 / micro-batches (`_set_moe_aux_loss_backward_scale`); then `scale_grads_and_clip_grad_norm` (scaling, then
  Automodel's `clip_grad_norm` with the EP mesh: two calls, so that the gradients are compared before the clip), SGD,
  and `update_moe_gate_bias()` where the class has it (as the trainer checks).

The reference: the same model on one process, through the same micro-batches, each rank's share of a micro-batch a
forward of its own (the aux loss is defined over the tokens one rank routes in one micro-batch: Automodel's Gate
computes it so, and its trainer averages it over the ranks and micro-batches, so the reference's backward scale is
1 / (micro-batches x W)); loss = the global cross-entropy sum / the global count; torch's clip_grad_norm_; the same
bias update from its own (global) expert load.

Compared (strict float32): the model's MoEConfig as recorded, the output, every gradient before the clip (router,
each rank's block of experts by global index, the rest), the clip norm (after asserting that the clip binds), the
routing bias after every step (where it is updated), the loss curve and every weight after the steps. Known-wrong
references name a failure: each dense gradient as this rank's own, never reduced (`rank-local`), as the last
micro-batch's alone (`accum-boundary`), the routing bias from this rank's load alone; a router gradient exactly zero
is `router-detached`. The bf16 row: one step's gradients and loss in the recipe's bf16 (Automodel's default mixed
precision: bf16 parameters, float32 reduction) judged by the noise model against float32 on one process.

Over 400 lines: a row is Automodel's trainer step and its one-process reference side by side (model, layout,
micro-batches, clip, bias update), which must be read together to see that they are the same mathematics.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
from typing import Any

from moebench.libraries.automodel import api
from moebench.libraries.automodel.user_setup import BINDING_NORM
from moebench.libraries.spec import BF16, Row, Settings

KIND = "recipe"
"""The kind of a user row in float32 (a bf16 row is spec.BF16)."""
STEPS = 3
LR = 0.1
SEQ_LEN = 8
ROUTES_PER_EXPERT = 16
"""Routes per expert a micro-batch gives on average (its sequences per rank grow with the experts / top-k): every
expert must get tokens at step 1 (asserted), or its gradient compares zero with zero inside its rank's block."""
MAX_SEQS = 64
"""Sequences per rank in one micro-batch at most (DeepSeek-V3's 256 experts, top-8, take 32 at W = 2)."""
MP_FP32 = "float32 (param, reduce, output): the float32 rows' reference"
MP_BF16 = "bfloat16 params, float32 reduce (FSDP2Config's default)"
PARALLELIZER = "Automodel's parallelize_model: apply_ep, activation checkpointing, apply_fsdp (FSDP2)"
DETACHED_WHERE = "in Automodel: GroupedExperts gathers them over the EP ranks with differentiable=False"
NORM_WHERE = "training.utils.clip_grad_norm: the norm was not reduced over the EP mesh"
BIAS_CAUSE = ("update_bias must sum the expert load over the data-parallel ranks: Automodel's apply_fsdp spreads the "
              "routing bias as a Replicate DTensor for that (NVIDIA-NeMo/Automodel#3348)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeSettings(Settings):
    """One user row's settings (its JSON fields): what the recipe and the config.json set, as the row runs them."""

    source: str
    """"recipe" (--recipe, with its config.json) or "hf-config" (--hf-config alone)."""
    routing: str
    """The config.json's routing keys (JSON), after the recipe's model-section overrides."""
    moe_overrides: str = "{}"
    """The recipe's model.moe_overrides (JSON): onto the MoEConfig Automodel's class maps from the config."""
    q_lora_rank: int | None = None
    num_experts: int
    top_k: int
    score_func: str
    norm_topk_prob: bool
    n_expert_groups: int
    n_limited_groups: int
    n_shared_experts: int
    route_scale: float
    gate_bias_update_factor: float
    aux_loss_coeff: float
    update_bias: bool
    """The class has update_moe_gate_bias (the trainer calls it after every step)."""
    experts: str
    rms_norm: str = "torch"
    fake_balanced_gate: bool = False
    gate_precision: str | None = None
    dispatcher: str = "torch"
    ep_size: int
    recipe_ep_size: int | None
    """distributed.ep_size as the recipe has it (None: --hf-config alone, EP over every rank)."""
    dp_replicate_size: int | None = None
    activation_checkpointing: str = "off"
    max_grad_norm: float
    loss_multiplier: float = 1.0
    """The loss (and the aux-loss scale) is multiplied by this, reference alike, so that max_grad_norm binds."""
    grad_acc_steps: int = 1
    recipe_grad_acc_steps: int = 1
    precision: str = "fp32"
    seqs_per_rank: int
    seq_len: int = SEQ_LEN
    steps: int = STEPS
    optimizer: str = "SGD"
    recipe_optimizer: str | None = None
    mp_policy: str = MP_FP32
    parallelizer: str = PARALLELIZER
    patch: str = ""
    torch_compile: str = api.TORCH_COMPILE


def user_rows(world_size: int, user: dict[str, Any]) -> list[Row]:
    """The rows of a user's setup at `world_size`: its float32 row, and its bf16 row when the recipe trains in
    bf16 (none below 2 ranks)."""
    from moebench.libraries.automodel.user_setup import MAX_ACCUM, fit_ep

    if world_size < 2:
        return []
    moe = user["moe"]
    experts = moe["n_routed_experts"]
    ep = fit_ep(user["ep_size"], world_size, experts)
    acc = min(user["grad_acc"], MAX_ACCUM)
    max_norm = float(user["max_norm"])
    ac = user["activation_checkpointing"]
    seqs = max(2, min(MAX_SEQS, math.ceil(ROUTES_PER_EXPERT * experts / (moe["n_activated_experts"] * SEQ_LEN *
                                                                          world_size))))
    base = RecipeSettings(
        source="recipe" if user.get("recipe") else "hf-config", routing=json.dumps(user["routing"], sort_keys=True),
        moe_overrides=json.dumps(user["moe_overrides"], sort_keys=True),
        q_lora_rank=user.get("q_lora_rank"), num_experts=experts, top_k=moe["n_activated_experts"],
        score_func=moe["score_func"], norm_topk_prob=bool(moe["norm_topk_prob"]),
        n_expert_groups=moe["n_expert_groups"], n_limited_groups=moe["n_limited_groups"],
        n_shared_experts=moe["n_shared_experts"], route_scale=float(moe["route_scale"]),
        gate_bias_update_factor=float(moe["gate_bias_update_factor"]), aux_loss_coeff=float(moe["aux_loss_coeff"]),
        update_bias=bool(user["update_bias"]) and moe["gate_bias_update_factor"] > 0,
        experts=user["backend"]["experts"], rms_norm=user["backend"]["rms_norm"],
        fake_balanced_gate=user["backend"]["fake_balanced_gate"], gate_precision=user["backend"]["gate_precision"],
        ep_size=ep, recipe_ep_size=user["ep_size"], dp_replicate_size=_replicate(user, world_size),
        activation_checkpointing=("selective" if ac == "selective" else "full" if ac else "off"),
        max_grad_norm=max_norm, loss_multiplier=max(1.0, max_norm / BINDING_NORM) if max_norm > 0 else 1.0,
        grad_acc_steps=acc, recipe_grad_acc_steps=user["grad_acc"], seqs_per_rank=seqs,
        recipe_optimizer=user.get("optimizer"), patch=api.QWEN3_PATCH if user["family"] == "qwen3_moe" else "")
    fitted = "" if user["ep_size"] in (None, ep) else (
        f"ep_size {user['ep_size']} verified at {ep}: the largest EP degree that fits {world_size} ranks")
    rows = [_row(user["family"], base, world_size, fitted)]
    if user["precision"] == "bf16":
        rows.append(_row(user["family"], dataclasses.replace(base, precision="bf16", mp_policy=MP_BF16, steps=1),
                         world_size, fitted))
    return rows


def _replicate(user: dict, world_size: int) -> int | None:
    """distributed.dp_replicate_size where it fits (HSDP: replicas x shards = W), else None (a note says so)."""
    r = user.get("dp_replicate_size")
    return r if r and 1 < r < world_size and world_size % r == 0 else None


def _row(family: str, s: RecipeSettings, world_size: int, note: str) -> Row:
    features = ["loss-curve"] if s.precision == "fp32" else ["bf16"]
    if s.max_grad_norm > 0 and s.precision == "fp32":
        features.append("clip")
    if s.grad_acc_steps > 1:
        features.append("grad-accum")
    if s.update_bias and s.precision == "fp32":
        features.append("bias-update")
    ep_mode = f"ep={s.ep_size}" + (f"+hsdp={s.dp_replicate_size}" if s.dp_replicate_size else "")
    variant = s.source if s.precision == "fp32" else f"{s.source}+bf16"
    return Row(library="automodel", model=family, backend=s.experts, ep_mode=ep_mode, world_size=world_size,
               kind=KIND if s.precision == "fp32" else BF16, settings=s, features=tuple(features), variant=variant,
               note=note)


# ------------------------------------------------------------------ on every rank


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


def _parallelize(model, s: RecipeSettings, world: int, fp32: bool):
    """(mesh context, moe mesh or None): the row's distributed section through Automodel's own parallelizer."""
    section = api.distributed_section(s.ep_size, s.activation_checkpointing, s.dp_replicate_size,
                                      "float32" if fp32 else None)
    return api.parallelize(model, section, world, fp32)


def _ref_name(name: str) -> str:
    return name.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")


def _whole(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _bias(model):
    from nemo_automodel.components.moe.layers import MoE

    gate = next(m for m in model.modules() if isinstance(m, MoE)).gate
    return getattr(gate, "e_score_correction_bias", None), gate


@contextlib.contextmanager
def _routes_of(model):
    """Counts, per expert, the routes the model's gate picks while the block runs ([count of expert 0, ...])."""
    import torch

    gate = _bias(model)[1]
    routes = [0] * gate.n_experts
    counted = []

    def hook(module, args, out):  # Automodel's Gate returns (weights, indices, aux_loss)
        counted.append(torch.bincount(out[1].detach().reshape(-1), minlength=len(routes)))

    handle = gate.register_forward_hook(hook)
    try:
        yield routes
    finally:
        handle.remove()
        total = sum(counted)
        routes[:] = [int(c) for c in total]


MAX_DRAWS = 16
"""Router draws a row tries before it gives up on a seed (measured, seeds 0-7 at W = 2 and 4: Qwen3-MoE's recipe
never redraws, DeepSeek-V3's config.json once, at seed 4)."""


def _route_every_expert(model, s: RecipeSettings, seed: int, world: int) -> None:
    """Redraws the router's rows (each at one norm, from a generator of the seed) until every expert gets tokens
    from step 1's global batch, read on this float32 model alone, never the library's parallel one; the same on
    every rank (the same seed and batch). If no draw routes them all, the row's premise assertion says so."""
    import torch

    gate = _bias(model)[1]
    batches = _batches(s, seed, 0, world, model.config.vocab_size)
    training = model.training
    model.eval()  # in training the gate adds each forward's load to what its bias update reads
    try:
        for draw in range(MAX_DRAWS):
            with torch.no_grad(), _routes_of(model) as routes:
                for inputs, _targets in batches:
                    model(inputs)
            if min(routes) > 0:
                return
            _redraw(gate, seed, draw)
    finally:
        model.train(training)


def _redraw(gate, seed: int, draw: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed * 7919 + draw + 1)
    with torch.no_grad():
        fresh = torch.randn(gate.weight.shape, generator=g)
        gate.weight.copy_(torch.nn.functional.normalize(fresh, dim=-1).to(gate.weight.dtype))


def _batches(s: RecipeSettings, seed: int, step: int, world: int, vocab: int):
    """The step's micro-batches [(inputs, targets)], each [W x seqs_per_rank, seq_len], rank-major."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + step)
    n = world * s.seqs_per_rank
    return [(torch.randint(vocab, (n, s.seq_len), generator=g), torch.randint(vocab, (n, s.seq_len), generator=g))
            for _ in range(s.grad_acc_steps)]


def _ce_sum(model, inputs, targets, vocab: int):
    import torch.nn.functional as F

    out = model(inputs)
    logits = getattr(out, "logits", out)
    return logits, F.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1), reduction="sum")


def aux_scale(value: float) -> None:
    """The trainer's MoEAuxLossAutoScaler.main_loss_backward_scale (base_recipe._set_moe_aux_loss_backward_scale)."""
    import torch
    from nemo_automodel.components.moe.megatron.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(value)


def _prepare(model, final: bool) -> None:
    from nemo_automodel.components.training import utils

    (utils.prepare_for_final_backward if final else utils.prepare_for_grad_accumulation)([model], pp_enabled=False)


def _parallel_step(model, s: RecipeSettings, batches, r: int, w: int, tokens: int, vocab: int):
    """Every micro-batch of one step on this rank, as train_ft runs them: (the summed local loss, the first
    micro-batch's output)."""
    rows = slice(r * s.seqs_per_rank, (r + 1) * s.seqs_per_rank)
    aux_scale(s.loss_multiplier / s.grad_acc_steps)
    _prepare(model, final=False)
    total, first = 0.0, None
    for m, (inputs, targets) in enumerate(batches):
        if m == len(batches) - 1:
            _prepare(model, final=True)
        logits, ce = _ce_sum(model, inputs[rows], targets[rows], vocab)
        loss = ce * s.loss_multiplier / tokens
        (loss * w).backward()  # train_ft: (local_loss * dp_group_size).backward()
        total += float(loss.detach())
        if first is None:
            first = logits.detach()
    return total, first


def _reference_step(ref, s: RecipeSettings, batches, w: int, tokens: int, vocab: int, snapshot: bool):
    """The same micro-batches on one process, each rank's share a forward of its own: (the loss, the first
    micro-batch's outputs by rank, and with `snapshot` {(rank, micro-batch): {name: its gradient}} for the
    known-wrong references)."""
    import torch

    aux_scale(s.loss_multiplier / (s.grad_acc_steps * w))
    total, outputs, deltas = 0.0, [], {}
    params = [(n, p) for n, p in ref.named_parameters() if ".experts." not in f".{n}"]
    for m, (inputs, targets) in enumerate(batches):
        for rr in range(w):
            rows = slice(rr * s.seqs_per_rank, (rr + 1) * s.seqs_per_rank)
            before = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in params} \
                if snapshot else None
            logits, ce = _ce_sum(ref, inputs[rows], targets[rows], vocab)
            loss = ce * s.loss_multiplier / tokens
            loss.backward()
            total += float(loss.detach())
            if m == 0:
                outputs.append(logits.detach())
            if snapshot:
                deltas[rr, m] = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) - before[n]
                                 for n, p in params}
    return total, outputs, deltas


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
    _route_every_expert(model, s, opts.seed, ctx.world_size)
    out: list = []
    _check_moe(out, moe, s, r)
    ref = copy.deepcopy(model)  # the same weights, on this process alone
    vocab = model.config.vocab_size
    _, moe_mesh = _parallelize(model, s, w, fp32=True)
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
        batches = _batches(s, opts.seed, step, w, vocab)
        tokens = sum(t.numel() for _, t in batches)
        local, y = _parallel_step(model, s, batches, r, w, tokens, vocab)
        with _routes_of(ref) as routes:
            ref_loss, ref_outputs, deltas = _reference_step(ref, s, batches, w, tokens, vocab, snapshot=step == 0)
        if step == 0:  # the premise: an expert no token reaches compares zero with zero inside its rank's block
            fewest = min(routes)
            out.append(assertion(f"every expert gets tokens at step 1 (the reference: {sum(routes)} routes over "
                                 f"{len(routes)} experts, the fewest {fewest})", fewest > 0, rank=r, group=EXPERTS,
                                 note="" if fewest else f"{routes.count(0)} expert(s) get none: give another --seed"))
        api.scale_grads(model, moe_mesh, w) if moe_mesh is not None else _scale_without_ep(model, w)
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
                _clip_without_ep(model, s.max_grad_norm)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), s.max_grad_norm)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
        if s.update_bias:  # the trainer: `if hasattr(model, "update_moe_gate_bias")`, after the optimizer's step
            model.update_moe_gate_bias()
            ref.update_moe_gate_bias()
            bias, ref_bias = _whole(_bias(model)[0]), _bias(ref)[0].detach()
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


def _scale_without_ep(model, w: int) -> None:
    """No EP mesh (the recipe's ep_size is 1): the trainer's call still runs, with no MoE mesh to scale by."""
    from nemo_automodel.components.training import utils

    fn = utils.scale_grads_and_clip_grad_norm
    fn(None, [model], **api.accepted(fn, moe_mesh=None, ep_axis_name=None, dp_group_size=w, pp_enabled=False,
                                     foreach=True))


def _clip_without_ep(model, max_norm: float) -> float:
    from nemo_automodel.components.training import utils

    fn = utils.clip_grad_norm
    return float(fn(max_norm, [model], **api.accepted(fn, moe_mesh=None, ep_axis_name=None, foreach=True)))


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

    _, gate = _bias(model)
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
        _clip_without_ep(model, s.max_grad_norm)
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
    _route_every_expert(ref, s, opts.seed, w)  # the float32 row's weights (loaded into the bf16 model below)
    par, _ = api.build_user(row.model, routing, overrides, _backend(s), opts.seed, torch.bfloat16,
                            q_lora_rank=s.q_lora_rank)
    par.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
    base = copy.deepcopy(par)
    vocab = ref.config.vocab_size
    _, moe_mesh = _parallelize(par, s, w, fp32=False)
    batches = _batches(s, opts.seed, 0, w, vocab)
    tokens = sum(t.numel() for _, t in batches)
    local, _y = _parallel_step(par, s, batches, r, w, tokens, vocab)
    api.scale_grads(par, moe_mesh, w) if moe_mesh is not None else _scale_without_ep(par, w)
    ref_loss, _, _ = _reference_step(ref, s, batches, w, tokens, vocab, snapshot=False)
    base_loss, _, _ = _reference_step(base, s, batches, w, tokens, vocab, snapshot=False)
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

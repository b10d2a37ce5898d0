"""Automodel's trainer step for a user row (user_rows.py) and its one-process reference, side by side: read together
they are the same mathematics.

On every rank:
- the layout: Automodel's own meshes from the recipe's `distributed:` section (`create_distributed_setup_from_config`,
  its ep_size fitted to the ranks: fit.fit_ep) and its own parallelizer (0.7:
  `distributed.model_parallelizer.parallelize_model(model, mesh_context)`; before: `moe.parallelizer.
  parallelize_model` with the mesh's axis names): apply_ep, activation checkpointing as the recipe asks, FSDP2 over
  the data-parallel ranks (which also spreads the gate's routing bias, so that its update sums every rank's load);
  float32 rows run FSDP's mixed precision in float32 (the row's `mp_policy`);
- a step as recipes/llm/train_ft.py takes it: the global label-token count over every micro-batch; per micro-batch
  each rank's loss is its tokens' cross-entropy sum / that count and `(loss * dp).backward()`, FSDP's sync held back
  until the last micro-batch (`prepare_for_grad_accumulation` / `prepare_for_final_backward`), the aux-loss backward
  scale 1 / micro-batches (`_set_moe_aux_loss_backward_scale`); then `scale_grads_and_clip_grad_norm` (scaling, then
  Automodel's `clip_grad_norm` with the EP mesh: two calls, so that the gradients are compared before the clip).

The reference: the same model on one process, through the same micro-batches, each rank's share of a micro-batch a
forward of its own (the aux loss is defined over the tokens one rank routes in one micro-batch: Automodel's Gate
computes it so, and its trainer averages it over the ranks and micro-batches, so the reference's backward scale is
1 / (micro-batches x W)); loss = the global cross-entropy sum / the global count.

Before the first step every expert's router row is redrawn until every expert gets tokens (route_every_expert).
"""

from __future__ import annotations

import contextlib

from moebench.libraries.automodel import api
from moebench.libraries.automodel.user_rows import RecipeSettings


def parallelize(model, s: RecipeSettings, world: int, fp32: bool):
    """(mesh context, moe mesh or None): the row's distributed section through Automodel's own parallelizer."""
    section = api.distributed_section(s.ep_size, s.activation_checkpointing, s.dp_replicate_size,
                                      "float32" if fp32 else None)
    return api.parallelize(model, section, world, fp32)


def bias_and_gate(model):
    from nemo_automodel.components.moe.layers import MoE

    gate = next(m for m in model.modules() if isinstance(m, MoE)).gate
    return getattr(gate, "e_score_correction_bias", None), gate


@contextlib.contextmanager
def routes_of(model):
    """Counts, per expert, the routes the model's gate picks while the block runs ([count of expert 0, ...])."""
    import torch

    gate = bias_and_gate(model)[1]
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


def route_every_expert(model, s: RecipeSettings, seed: int, world: int) -> None:
    """Redraws the router's rows (each at one norm, from a generator of the seed) until every expert gets tokens
    from step 1's global batch, read on this float32 model alone, never the library's parallel one; the same on
    every rank (the same seed and batch). If no draw routes them all, the row's premise assertion says so."""
    import torch

    gate = bias_and_gate(model)[1]
    batches = micro_batches(s, seed, 0, world, model.config.vocab_size)
    training = model.training
    model.eval()  # in training the gate adds each forward's load to what its bias update reads
    try:
        for draw in range(MAX_DRAWS):
            with torch.no_grad(), routes_of(model) as routes:
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


def micro_batches(s: RecipeSettings, seed: int, step: int, world: int, vocab: int):
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


def parallel_step(model, s: RecipeSettings, batches, r: int, w: int, tokens: int, vocab: int):
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


def reference_step(ref, s: RecipeSettings, batches, w: int, tokens: int, vocab: int, snapshot: bool):
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


def scale_without_ep(model, w: int) -> None:
    """No EP mesh (the recipe's ep_size is 1): the trainer's call still runs, with no MoE mesh to scale by."""
    from nemo_automodel.components.training import utils

    fn = utils.scale_grads_and_clip_grad_norm
    fn(None, [model], **api.accepted(fn, moe_mesh=None, ep_axis_name=None, dp_group_size=w, pp_enabled=False,
                                     foreach=True))


def clip_without_ep(model, max_norm: float) -> float:
    from nemo_automodel.components.training import utils

    fn = utils.clip_grad_norm
    return float(fn(max_norm, [model], **api.accepted(fn, moe_mesh=None, ep_axis_name=None, foreach=True)))

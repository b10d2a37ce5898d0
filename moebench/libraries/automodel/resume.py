"""An Automodel resume row, on every rank: its DeepSeek-V3 model (grouped top-k, a shared expert, and the routing bias
`e_score_correction_bias` its gate updates every step: `gate_bias_update_factor` > 0 in Automodel's DeepSeek-V3),
parallelized as its recipes do (`apply_ep` over every rank, then `apply_fsdp`, which also distributes the routing
bias over the data-parallel mesh: NVIDIA-NeMo/Automodel#3348), trained the way `recipes/llm/train_ft.py` steps
(`(loss * dp).backward()`, `scale_grads_and_clip_grad_norm`, the optimizer's step, `update_moe_gate_bias()`), saved and
loaded by its own `Checkpointer` (`save_model` / `save_optimizer` / `load_model` / `load_optimizer`: its model and
optimizer state wrappers over DCP).

1. Model A trains SAVE_STEPS steps; every rank must hold the same routing bias after every step. A's state (weights,
   Adam's exp_avg / exp_avg_sq, the routing bias) is kept as whole tensors.
2. The Checkpointer saves into a folder under moebench's temporary root; A trains on: the run that never stopped.
3. Model B, from another seed, parallelized alike, loads. Right after the load every expert slot of every rank is
   matched against every global expert's weights and moments, the dense parameters and the routing bias against
   their own (moebench.parity.restore): a slot holding another expert's state is named slot by slot.
4. B trains on CONTINUE_STEPS steps on the same batches, bit for bit with A at every step.
"""

from __future__ import annotations

from typing import Any

from moebench.libraries.automodel import api
from moebench.libraries.spec import Row

SAVE_STEPS = 2
CONTINUE_STEPS = 2
LR = 1e-2
FRESH_SEED_OFFSET = 7919
BIAS = "e_score_correction_bias"


def _make(row: Row, seed: int, world: int, ep_size: int):
    """(model, optimizer, EP mesh or None) of one side: built, then parallelized by Automodel's own parallelizer from
    a recipe's `distributed:` section (fsdp2, `ep_size`, float32 mixed precision; ep_size 1: no EP, the load of
    `resume-to-noep`, where FSDP shards the experts' dim over the ranks), as its recipes do: apply_ep, apply_fsdp."""
    import torch

    model, _ = api.build(row.model, row.backend, seed)
    _, moe_mesh = api.parallelize(model, api.distributed_section(ep_size), world, fp32=True)
    return model, torch.optim.Adam(model.parameters(), lr=LR, foreach=False), moe_mesh


def _checkpointer(folder: str, rank: int, mesh):
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    config = CheckpointingConfig(checkpoint_dir=folder, model_save_format="torch_save", save_consolidated=False,
                                 model_repo_id=None, model_cache_dir=folder)
    return Checkpointer(config, dp_rank=rank, tp_rank=0, pp_rank=0, moe_mesh=mesh)


def _batch(seed: int, step: int, world: int):
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + step)
    n = world * api.SEQS_PER_RANK
    return (torch.randint(api.VOCAB, (n, api.SEQ_LEN), generator=g),
            torch.randint(api.VOCAB, (n, api.SEQ_LEN), generator=g))


def _train(side, step: int, seed: int, rank: int, world: int, grads: dict | None = None) -> None:
    """One training step as train_ft takes it, on this rank's sequences; `grads` (a dict) gets every parameter's
    whole gradient after the trainer's scaling, before the optimizer's step (a collective)."""
    import torch.nn.functional as F

    from moebench.libraries.automodel.user_step import aux_scale

    model, optimizer, mesh = side
    inputs, targets = _batch(seed, step, world)
    aux_scale(1.0)  # the trainer's, at one micro-batch a step (the one-process run sets its own)
    mine = slice(rank * api.SEQS_PER_RANK, (rank + 1) * api.SEQS_PER_RANK)
    out = model(inputs[mine])
    logits = getattr(out, "logits", out)
    loss = F.cross_entropy(logits.reshape(-1, api.VOCAB).float(), targets[mine].reshape(-1),
                           reduction="sum") / targets.numel()
    (loss * world).backward()  # train_ft: (local_loss * dp_group_size).backward(); FSDP averages over dp
    api.scale_grads(model, mesh, world)
    if grads is not None:
        grads.update({n: _whole(p.grad) for n, p in model.named_parameters() if p.grad is not None})
    optimizer.step()
    optimizer.zero_grad()
    if hasattr(model, "update_moe_gate_bias"):
        model.update_moe_gate_bias()


def _one_process_step(row: Row, state: dict, seed: int, step: int, world: int) -> dict[str, Any]:
    """One step's gradients on one process from the uninterrupted run's weights and routing bias before it (`state`,
    whole tensors): the model with nothing parallelized, each rank's sequences a forward and backward of their own
    (Automodel's gate computes its aux loss and expert load per forward; the trainer averages the aux loss over the
    ranks), loss = the cross-entropy sum / the global token count; then update_moe_gate_bias() from the load of every
    rank's tokens. -> {"grads": {name: gradient}, "bias": {BIAS: the bias after the update}}. Gradients, not weights
    after Adam: Adam's first steps turn a float32 rounding difference of a near-zero gradient into up to lr."""
    import torch
    import torch.nn.functional as F

    from moebench.libraries.automodel.user_step import aux_scale

    model, _ = api.build(row.model, row.backend, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state["weights"][name])
        if BIAS in state["bias"]:
            _bias(model).copy_(state["bias"][BIAS])
    inputs, targets = _batch(seed, step, world)
    aux_scale(1 / world)
    for r in range(world):
        mine = slice(r * api.SEQS_PER_RANK, (r + 1) * api.SEQS_PER_RANK)
        out = model(inputs[mine])
        logits = getattr(out, "logits", out)
        (F.cross_entropy(logits.reshape(-1, api.VOCAB).float(), targets[mine].reshape(-1), reduction="sum")
         / targets.numel()).backward()
    grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for n, p in model.named_parameters()}
    if hasattr(model, "update_moe_gate_bias"):
        model.update_moe_gate_bias()
    bias = _bias(model)
    return {"grads": grads, "bias": {} if bias is None else {BIAS: bias.detach().clone()}}


def _whole(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _bias(model):
    from nemo_automodel.components.moe.layers import MoE

    gate = next(m for m in model.modules() if isinstance(m, MoE)).gate
    return getattr(gate, BIAS, None)


def _state(side) -> dict[str, dict[str, Any]]:
    """{"weights": {name: whole}, "exp_avg": ..., "exp_avg_sq": ..., "bias": {BIAS: whole}} (a collective)."""
    model, optimizer, _ = side
    out: dict[str, dict[str, Any]] = {"weights": {}, "exp_avg": {}, "exp_avg_sq": {}, "bias": {}}
    for name, p in model.named_parameters():
        out["weights"][name] = _whole(p)
        for key in ("exp_avg", "exp_avg_sq"):
            if key in optimizer.state.get(p, {}):
                out[key][name] = _whole(optimizer.state[p][key])
    bias = _bias(model)
    if bias is not None:
        out["bias"][BIAS] = _whole(bias)
    return out


def _expert_names(model) -> set[str]:
    from torch.distributed.tensor import DTensor, Shard

    return {n for n, p in model.named_parameters() if ".experts." in n and isinstance(p, DTensor)
            and any(isinstance(pl, Shard) and pl.dim == 0 for pl in p.placements)}


def _findings(side, saved: dict, fresh: dict, rank: int, world: int) -> list:
    """(comparison name, Finding) for every slot this rank holds: each expert's weights and moments matched against
    every global expert's at the save; the dense parameters and the routing bias against their own."""
    from moebench.parity import restore
    from moebench.parity.layout import ExpertLayout

    quantities = {"weights": restore.WEIGHTS, "exp_avg": restore.EXP_AVG, "exp_avg_sq": restore.EXP_AVG_SQ}
    now = _state(side)
    experts = _expert_names(side[0])
    held = ExpertLayout(api.NUM_EXPERTS, world).experts_of(rank)
    out = []
    for key, quantity in quantities.items():
        for name, got in now[key].items():
            if name in experts:
                want = {e: saved[key][name][e] for e in range(api.NUM_EXPERTS)}
                for slot, e in enumerate(held):
                    f = restore.identify(restore.Slot(rank=rank, local=slot, unit=e), quantity, got[e], want,
                                         fresh=fresh[key][name][e] if key == "weights" else None)
                    out.append((f"after the load: {name} [expert {e}] {key}", f))
            elif name in saved[key]:
                before = fresh[key].get(name) if key == "weights" else None
                f = restore.identify(restore.Slot(rank=rank, local=None, unit=name), quantity, got,
                                     {name: saved[key][name]}, fresh=before)
                out.append((f"after the load: {name} {key}", f))
    if BIAS in saved["bias"]:
        f = restore.identify(restore.Slot(rank=rank, local=None, unit=BIAS), restore.WEIGHTS, now["bias"][BIAS],
                             {BIAS: saved["bias"][BIAS]}, fresh=fresh["bias"].get(BIAS))
        out.append(("after the load: the routing bias", f))
    return out


def _biases_agree(side, rank: int, tag: str):
    """Every rank holds the same routing bias (its update must be the same on every rank before any save)."""
    import torch
    import torch.distributed as dist

    from moebench.parity.compare import assertion
    from moebench.parity.diagnosis import ROUTER

    bias = _bias(side[0])
    mine = None if bias is None else _whole(bias)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differ = [r for r, b in enumerate(every) if b is None or not torch.equal(b, every[0])]
    return assertion(f"{tag}: every rank holds the same routing bias", not differ and every[0] is not None,
                     rank=rank, group=ROUTER,
                     note=(f"ranks {differ} hold another bias than rank 0's" if differ
                           else "" if every[0] is not None else "the gate has no routing bias"))


def run(ctx, row: Row, opts) -> list:
    """The row on this rank, eager, with Automodel's and transformers' deprecation chatter off the console."""
    import logging
    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    torch.compiler.set_stance("force_eager")
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    for name in ("nemo_automodel", "torch.distributed.checkpoint"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run(ctx, row, opts)
    finally:
        hf_logging.set_verbosity(level)


def _run(ctx, row: Row, opts) -> list:
    import torch

    from moebench.libraries.resume import refusal, restore_comparisons, shared_dir
    from moebench.parity.compare import EXACT, assertion, compare
    from moebench.parity.diagnosis import EXPERTS, REPLICATED, ROUTER

    r, w = ctx.rank, ctx.world_size
    out: list = []
    to_noep = getattr(row.settings, "load_ep_mode", "apply_ep+fsdp") == "fsdp"
    save_ep, load_ep = getattr(row.settings, "save_ep", 0) or w, 1 if to_noep else w
    against: list = []  # the uninterrupted run against one process: kept aside, after the resume's comparisons
    a = _make(row, opts.seed, w, save_ep)
    for step in range(SAVE_STEPS):
        against += _step_against_one_process(row, a, step, opts.seed, r, w)
        out.append(_biases_agree(a, r, f"step {step + 1}"))
    saved = _state(a)
    moved = BIAS in saved["bias"] and bool(saved["bias"][BIAS].abs().sum() > 0)
    out.append(assertion(f"the routing bias moved in {SAVE_STEPS} steps (the row checks a state that changes)", moved,
                         rank=r, group=ROUTER, note="" if moved else "it is still all zeros: nothing to restore"))
    with shared_dir("automodel-resume") as folder:
        path = str(folder / f"step_{SAVE_STEPS}")
        _checkpointer(str(folder), r, a[2]).save_model(a[0], path)
        _checkpointer(str(folder), r, a[2]).save_optimizer(a[1], a[0], path)
        torch.distributed.barrier()
        b = _make(row, opts.seed + FRESH_SEED_OFFSET, w, load_ep)
        fresh = _state(b)
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: every rank's errors

        try:
            checkpointer = _checkpointer(str(folder), r, b[2])
            checkpointer.load_model(b[0], f"{path}/model")
            checkpointer.load_optimizer(b[1], b[0], path)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the load refused is the row's verdict
            from moebench.parity.registry import Refused

            raise Refused(f"Checkpointer.load refused it: {refusal(exc)}") from None
    out += restore_comparisons(_findings(b, saved, fresh, r, w), r)
    if load_ep != save_ep:
        return out + against  # another layout: what it restored is what is asked of it
    experts = _expert_names(a[0])
    for step in range(SAVE_STEPS, SAVE_STEPS + CONTINUE_STEPS):
        against += _step_against_one_process(row, a, step, opts.seed, r, w)
        _train(b, step, opts.seed, r, w)
        kept, resumed = _state(a), _state(b)
        for name, t in resumed["weights"].items():
            group = EXPERTS if name in experts else ROUTER if ".gate." in name else REPLICATED
            out.append(compare(f"step {step + 1} (resumed): {name} vs the run that never stopped", t,
                               kept["weights"][name], EXACT, rank=r, group=group))
        if BIAS in kept["bias"]:
            out.append(compare(f"step {step + 1} (resumed): the routing bias vs the run that never stopped",
                               resumed["bias"][BIAS], kept["bias"][BIAS], EXACT, rank=r, group=ROUTER))
    return out + against


def _step_against_one_process(row: Row, a, step: int, seed: int, rank: int, world: int) -> list:
    """One step of the uninterrupted run, its gradients (after the trainer's scaling) and its routing bias after the
    update against one process from the same weights and bias (_one_process_step), strictly."""
    from moebench.parity.compare import STRICT, compare
    from moebench.parity.diagnosis import EXPERTS, REPLICATED, ROUTER

    before, grads = _state(a), {}
    one = _one_process_step(row, before, seed, step, world)
    _train(a, step, seed, rank, world, grads=grads)
    experts, out = _expert_names(a[0]), []
    for name, g in grads.items():
        group = EXPERTS if name in experts else ROUTER if ".gate." in name else REPLICATED
        out.append(compare(f"step {step + 1} (uninterrupted): grad {name} vs one process", g, one["grads"][name],
                           STRICT, rank=rank, group=group))
    if BIAS in one["bias"]:
        out.append(compare(f"step {step + 1} (uninterrupted): the routing bias after the update vs one process",
                           _whole(_bias(a[0])), one["bias"][BIAS], STRICT, rank=rank, group=ROUTER))
    return out

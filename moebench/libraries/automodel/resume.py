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


def _make(row: Row, seed: int, world: int, ep: bool = True):
    """(model, optimizer, EP mesh or None) of one side: built, `apply_ep` (unless `ep` is off: the load of
    `resume-to-noep`), `apply_fsdp` (float32 throughout; without EP, FSDP shards the experts' dim over the ranks)."""
    import torch
    from nemo_automodel.components.moe.parallelizer import apply_fsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model, _ = api.build(row.model, row.backend, seed)
    mesh = api.ep_mesh(world)
    if ep:
        api.apply_ep(model, mesh)
    apply_fsdp(model, mesh["ep"], ep_enabled=ep, ep_shard_enabled=False,
               mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
    return model, torch.optim.Adam(model.parameters(), lr=LR, foreach=False), mesh if ep else None


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


def _train(side, step: int, seed: int, rank: int, world: int) -> None:
    """One training step as train_ft takes it, on this rank's sequences."""
    import torch.nn.functional as F

    model, optimizer, mesh = side
    inputs, targets = _batch(seed, step, world)
    mine = slice(rank * api.SEQS_PER_RANK, (rank + 1) * api.SEQS_PER_RANK)
    out = model(inputs[mine])
    logits = getattr(out, "logits", out)
    loss = F.cross_entropy(logits.reshape(-1, api.VOCAB).float(), targets[mine].reshape(-1),
                           reduction="sum") / targets.numel()
    (loss * world).backward()  # train_ft: (local_loss * dp_group_size).backward(); FSDP averages over dp
    api.scale_grads(model, mesh, world)
    optimizer.step()
    optimizer.zero_grad()
    if hasattr(model, "update_moe_gate_bias"):
        model.update_moe_gate_bias()


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
    a = _make(row, opts.seed, w)
    for step in range(SAVE_STEPS):
        _train(a, step, opts.seed, r, w)
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
        to_noep = getattr(row.settings, "load_ep_mode", "apply_ep+fsdp") == "fsdp"
        b = _make(row, opts.seed + FRESH_SEED_OFFSET, w, ep=not to_noep)
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
    if to_noep:
        return out  # another layout: what it restored is what is asked of it
    experts = _expert_names(a[0])
    for step in range(SAVE_STEPS, SAVE_STEPS + CONTINUE_STEPS):
        _train(a, step, opts.seed, r, w)
        _train(b, step, opts.seed, r, w)
        kept, resumed = _state(a), _state(b)
        for name, t in resumed["weights"].items():
            group = EXPERTS if name in experts else ROUTER if ".gate." in name else REPLICATED
            out.append(compare(f"step {step + 1} (resumed): {name} vs the run that never stopped", t,
                               kept["weights"][name], EXACT, rank=r, group=group))
        if BIAS in kept["bias"]:
            out.append(compare(f"step {step + 1} (resumed): the routing bias vs the run that never stopped",
                               resumed["bias"][BIAS], kept["bias"][BIAS], EXACT, rank=r, group=ROUTER))
    return out

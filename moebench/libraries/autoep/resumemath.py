"""What an AutoEP resume row does with DeepSpeed, in one place for the tool and its standalone script: the engine
config (AdamW as torch's optimizer, no JIT op), the training steps, DeepSpeed's own save / convert / load calls as
its users make them, and what an engine holds after them, per GLOBAL expert and per parameter: module weights, the
fp32 master (ZeRO 1/2: read from the optimizer's flat fp32 partitions; ZeRO 3: from its fp32 partitions), AdamW's
exp_avg / exp_avg_sq / step, and the routing bias (DeepSeek-V3's `e_score_correction_bias`, a buffer).

Stdlib and torch at import (DeepSpeed is imported where it is used): `--repro` pastes this file into the script
(libraries/repro), below shape.py and rowmath.py, so the script and the tool read the same state the same way.
"""

import argparse
import contextlib
import io
import os

import torch

from moebench.libraries.autoep.rowmath import MLP, SEQS, batch, experts_held, loss_of  # noqa: F401 # @PASTED@

ADAMW_LR = 1e-3
"""AdamW's learning rate (DeepSpeed's own resume rows use the same): small enough that two AdamW steps keep the
tiny model's routing near where it started, large enough that every step moves every trained element."""
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.0
"""AdamW's other settings, written out (engine and one-process reference alike); the names differ from rowmath's
(its SGD's LR, its engine_config): a script pastes both."""
TAG = "resume"
"""The checkpoint's tag (the universal copy is TAG + "_universal", DeepSpeed's converter's own naming)."""
BIAS = "e_score_correction_bias"
"""The routing bias DeepSeek-V3 keeps as a buffer of its router, added to the scores that choose the experts."""
WEIGHTS, FP32_MASTER, EXP_AVG, EXP_AVG_SQ, STEP = "weights", "fp32 master", "exp_avg", "exp_avg_sq", "step"
"""The quantities a slot holds (moebench/parity/restore.py's names)."""


def resume_config(zero_stage: int, autoep_size: int, world: int, *, universal: bool = False,
                  expert_parallel: bool = True) -> dict:
    """A resume row's DeepSpeed config: AutoEP at `autoep_size` (or off), the ZeRO stage, AdamW as torch's own
    optimizer (`torch_adam`: DeepSpeed's FusedAdam would build a C++ op, ~90 s cold, a compiler needed), and
    `checkpoint.load_universal` for a load from a universal checkpoint."""
    config = {
        "train_batch_size": SEQS * world, "train_micro_batch_size_per_gpu": SEQS, "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0, "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "AdamW", "params": {"lr": ADAMW_LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
        "checkpoint": {"load_universal": universal}, "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    if expert_parallel:
        config["expert_parallel"] = {"enabled": True, "autoep_size": autoep_size}
    return config


def initialize(model, config: dict):
    """deepspeed.initialize as a user calls it with a config-built optimizer."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine, seed: int, steps, rank: int) -> list:
    """Train `steps` (optimizer steps, by index); each step's loss on this rank."""
    losses = []
    for step in steps:
        loss = loss_of(engine, batch(seed, step, 0, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().double().clone())
    return losses


def forget_expert_groups() -> None:
    """Empty DeepSpeed's registry of expert-parallel groups (deepspeed.utils.groups), as the fresh processes of a
    resumed job have it: the engine that saved ran in this process too, and DeepSpeed resolves the universal load's
    expert rank (and the ZeRO 0 optimizer file it reads) from the LARGEST expert group registered, not the
    engine's own."""
    from deepspeed.utils import groups

    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        registry = getattr(groups, name, None)
        if isinstance(registry, dict):
            registry.clear()


def convert_universal(folder: str) -> None:
    """DeepSpeed's own converter on the checkpoint (`python -m deepspeed.checkpoint.ds_to_universal --input_folder
    FOLDER/TAG --output_folder FOLDER/TAG_universal`, its defaults); it writes FOLDER/latest_universal itself."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=os.path.join(folder, TAG),
                              output_folder=os.path.join(folder, f"{TAG}_universal"), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)  # its banner and progress bars are not the caller's output
    latest = os.path.join(folder, "latest_universal")
    if not os.path.isfile(latest):  # releases before the converter wrote it
        with open(latest, "w") as f:
            f.write(f"{TAG}_universal")


def load(engine, folder: str, universal: bool) -> None:
    """`load_checkpoint` as a user resumes: the tag of the regular checkpoint, or DeepSpeed's latest_universal."""
    engine.load_checkpoint(folder, tag=None if universal else TAG)


# ------------------------------------------------------------------ what an engine holds, per unit


def _zero12(engine, named: list, keys: tuple) -> dict:
    """ZeRO 1/2: {name: {key: tensor}} for the fp32 master (FP32_MASTER) and AdamW state, read from the flat fp32
    partitions the optimizer steps (its own storage: a stale link cannot hide a wrong load), every rank's fragments
    summed over the parameter's group (one collective per group and key); the step, the group's largest (-1: none)."""
    import torch.distributed as dist

    opt = engine.optimizer
    by_group: dict = {}
    for name, p in named:
        by_group.setdefault(id(p._dp_group), (p._dp_group, []))[1].append((name, p))
    out = {name: {} for name, _ in named}
    for group, params in by_group.values():
        for key in keys:
            sources = []
            for _, p in params:
                m = getattr(p, "_hp_mapping", None)
                flat = None if m is None else opt.single_partition_of_fp32_groups[m.param_group_index]
                state = {} if flat is None else opt.optimizer.state.get(flat, {})
                sources.append((m, flat if key == FP32_MASTER else state.get(key)))
            if key == STEP:
                value = torch.tensor([-1.0 if src is None else float(torch.as_tensor(src).max())
                                      for _, src in sources], dtype=torch.float64)
                dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
                for (name, _), v in zip(params, value):
                    out[name][key] = v.reshape(1).clone()
                continue
            buf = torch.zeros(sum(p.numel() for _, p in params), dtype=torch.float32)
            offset = 0
            for (_, p), (m, src) in zip(params, sources):
                if src is not None:
                    lp, hp = m.lp_fragment_address, m.hp_fragment_address
                    buf.narrow(0, offset + lp.start, lp.numel).copy_(
                        src.detach().reshape(-1).narrow(0, hp.start, hp.numel))
                offset += p.numel()
            dist.all_reduce(buf, group=group)
            offset = 0
            for name, p in params:
                out[name][key] = buf.narrow(0, offset, p.numel()).clone().view_as(p)
                offset += p.numel()
    return out


def _zero3(engine, p, key):
    """ZeRO 3: AdamW state `key` of p from the fp32 partitions the optimizer steps (DeepSpeed's
    safe_get_full_optimizer_state gathers them; zeros where the optimizer holds none yet, as a fresh AdamW), or the
    step of the sub-group holding p (-1: none). A collective over p's partition group, on every rank alike."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_optimizer_state

    opt = engine.optimizer
    group = opt.grad_position[opt.get_param_id(p)][0]
    state = opt.optimizer.state.get(opt.fp32_partitioned_groups_flat[group], {})
    if key == STEP:
        value = torch.tensor([float(torch.as_tensor(state[STEP]).max()) if STEP in state else -1.0],
                             dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value
    if key not in state:
        return torch.zeros(p.ds_shape, dtype=torch.float32)
    return safe_get_full_optimizer_state(p, key).detach().float().clone().view(p.ds_shape)


def param_state(engine, stage: int, keys: tuple = (FP32_MASTER, EXP_AVG, EXP_AVG_SQ, STEP)) -> dict:
    """{parameter name: {quantity: tensor}}: the module weights and the optimizer quantities `keys` (parameter shape;
    step as one float, -1 where the optimizer holds none; an fp32 master only at ZeRO 1-3)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    named = list(engine.module.named_parameters())
    out = {}
    gathered = deepspeed.zero.GatheredParameters([p for _, p in named]) if stage == 3 else contextlib.nullcontext()
    with gathered:
        for name, p in named:
            out[name] = {WEIGHTS: p.detach().float().clone()}
    keys = tuple(k for k in keys if stage > 0 or k != FP32_MASTER)
    if not keys:
        return out
    if stage in (1, 2):
        for name, state in _zero12(engine, named, keys).items():
            out[name].update(state)
        return out
    for name, p in named:
        s = out[name]
        if stage == 0:
            st = engine.optimizer.state.get(p, {})
            for key in keys:
                s[key] = (torch.tensor([float(st[STEP]) if STEP in st else -1.0], dtype=torch.float64) if key == STEP
                          else st.get(key, torch.zeros_like(p)).detach().float().clone())
        else:
            for key in keys:
                s[key] = (safe_get_full_fp32_param(p).detach().float().clone().view(s[WEIGHTS].shape)
                          if key == FP32_MASTER else _zero3(engine, p, key))
    return out


def shared_step_tensors(engine) -> int:
    """How many of the optimizer's state entries hold a step tensor another entry holds too (0 on a correct load:
    torch's Adam / AdamW increment `state["step"]` in place, once per entry)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = [st["step"] for st in getattr(inner, "state", {}).values()
             if isinstance(st, dict) and torch.is_tensor(st.get("step"))]
    return len(steps) - len({id(t) for t in steps})


def expert_param(name: str) -> bool:
    """AutoEP's grouped experts (w1, w2, w3: [local experts, ...])."""
    return name.startswith(MLP + "experts.w") and name[len(MLP + "experts.w"):] in ("1", "2", "3")


def unit_state(engine, stage: int, keys: tuple = (FP32_MASTER, EXP_AVG, EXP_AVG_SQ, STEP)) -> dict:
    """{unit: {quantity: flat tensor}}: a unit is a GLOBAL expert (int: its w1, w2, w3 slices concatenated, from the
    local slot AutoEP's placement gives it) or a parameter's name (every other parameter)."""
    held = experts_held(engine.module.get_submodule(MLP[:-1])) if _autoep(engine) else None
    grouped = {}
    for name, quantities in sorted(param_state(engine, stage, keys).items()):
        if held is not None and expert_param(name):
            for slot, expert in enumerate(held):
                part = grouped.setdefault(expert, {})
                for q, t in quantities.items():
                    # a state tensor of another shape (a load from another layout) holds what it holds
                    part.setdefault(q, []).append(t if q == STEP else t[slot].reshape(-1) if slot < len(t)
                                                  else torch.zeros(0))
        else:
            grouped[name] = {q: [t.reshape(-1)] for q, t in quantities.items()}
    return {u: {q: (torch.stack(ts).max().reshape(1) if q == STEP else torch.cat(ts)) for q, ts in qs.items()}
            for u, qs in grouped.items()}


def _autoep(engine) -> bool:
    try:
        engine.module.get_submodule(MLP + "experts")
    except AttributeError:
        return False
    return any(expert_param(n) for n, _ in engine.module.named_parameters())


def slots(engine) -> dict:
    """Global expert -> the local slot holding it on this rank (AutoEP's declared placement)."""
    if not _autoep(engine):
        return {}
    return {e: j for j, e in enumerate(experts_held(engine.module.get_submodule(MLP[:-1])))}


def routing_bias(module):
    """(the routing bias's name in `module`, its value), or (None, None) where it holds none: DeepSeek-V3's
    `e_score_correction_bias`, wherever it lives (a buffer of the model's gate; of AutoEP's router)."""
    for name, t in list(module.named_buffers()) + list(module.named_parameters()):
        if name.rsplit(".", 1)[-1] == BIAS:
            return name, t.detach().float().clone()
    return None, None


# ------------------------------------------------------------------ the one-process reference


def reference_run(model, seed: int, world: int, steps: int) -> dict:
    """The same model on one process: at each step every rank's slice through the Hugging Face model, the loss
    their mean (each slice's own mean over its tokens, as each rank's loss; DeepSpeed averages the ranks'
    gradients), one torch AdamW step with the engine's settings. {"losses": [per step], "params": [per step:
    {name: float64 tensor}], "bias": [per step: the routing bias or None]} (the model's own names)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    out = {"losses": [], "params": [], "bias": []}
    for step in range(steps):
        optimizer.zero_grad()
        loss = sum(loss_of(model, batch(seed, step, 0, r)) for r in range(world)) / world
        loss.backward()
        optimizer.step()
        out["losses"].append(float(loss.detach()))
        out["params"].append({n: p.detach().double().clone() for n, p in model.named_parameters()})
        out["bias"].append(routing_bias(model)[1])
    return out

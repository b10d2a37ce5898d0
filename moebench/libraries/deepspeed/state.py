"""What a DeepSpeed engine holds, read for the resume rows: per parameter its module weights, fp32 master (ZeRO 1/2:
from the optimizer's flat fp32 partitions) and Adam's exp_avg / exp_avg_sq / step; then per unit (a global expert,
or a dense parameter by name), as parity/restore.py identifies them."""

from __future__ import annotations

from typing import Any

import torch

from moebench.libraries.deepspeed.names import local_slot
from moebench.parity.layout import ExpertLayout


def _zero_full(engine, p, key: str | None) -> torch.Tensor:
    """ZeRO 1/2: parameter `p`'s fp32 master (key None) or its optimizer state `key`, read from the flat
    fp32 partition the optimizer actually steps (what DeepSpeed's safe_get_full_* assemble, but from
    the partitions themselves, so a stale link cannot hide a wrong load); all-reduced over p's group."""
    import torch.distributed as dist

    opt = engine.optimizer
    buf = torch.zeros(p.numel(), dtype=torch.float32)
    m = getattr(p, "_hp_mapping", None)
    if m is not None:
        flat = opt.single_partition_of_fp32_groups[m.param_group_index]
        src = flat if key is None else opt.optimizer.state.get(flat, {}).get(key)
        if src is not None:
            lp, hp = m.lp_fragment_address, m.hp_fragment_address
            buf.narrow(0, lp.start, lp.numel).copy_(src.detach().reshape(-1).narrow(0, hp.start, hp.numel))
    dist.all_reduce(buf, group=p._dp_group)
    return buf.view_as(p)


def step_of(value: Any) -> torch.Tensor:
    """Adam's step as [its value, how many elements hold it]: a scalar on every correct path. An elastic load of
    DeepSpeed 0.19.0 restores it as a tensor of several elements (merged from the ranks' states): that shows as
    a wrong step here, not as a crash of the reader. Absent: [0, 1] (Adam's initial state)."""
    if value is None:
        return torch.tensor([0.0, 1.0], dtype=torch.float64)
    flat = torch.as_tensor(value).detach().reshape(-1).double()
    return torch.tensor([float(flat.max()) if flat.numel() else 0.0, float(flat.numel())], dtype=torch.float64)


def _zero_step(engine, p) -> torch.Tensor:
    """ZeRO 1/2: the Adam step of the partition(s) holding `p` (`_step_of`; max over its group)."""
    import torch.distributed as dist

    opt = engine.optimizer
    value = None
    m = getattr(p, "_hp_mapping", None)
    if m is not None:
        flat = opt.single_partition_of_fp32_groups[m.param_group_index]
        value = opt.optimizer.state.get(flat, {}).get("step")
    step = step_of(value)
    dist.all_reduce(step, op=dist.ReduceOp.MAX, group=p._dp_group)  # every rank the same shape: never a hang
    return step


def state_of(engine, stage: int) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter name: {quantity: tensor}}: the module weights, the fp32 master (ZeRO 1/2) and Adam's
    exp_avg / exp_avg_sq / step (zeros where the optimizer holds none yet: Adam's initial state)."""
    from moebench.parity import restore

    out: dict[str, dict[str, torch.Tensor]] = {}
    opt = engine.optimizer
    for name, p in engine.module.named_parameters():
        s = {restore.WEIGHTS: p.detach().clone().float()}
        if stage == 0:
            st = opt.state.get(p, {}) if hasattr(opt, "state") else {}
            s[restore.EXP_AVG] = st.get("exp_avg", torch.zeros_like(p)).detach().clone().float()
            s[restore.EXP_AVG_SQ] = st.get("exp_avg_sq", torch.zeros_like(p)).detach().clone().float()
            s[restore.STEP] = step_of(st.get("step"))
        else:
            s[restore.FP32_MASTER] = _zero_full(engine, p, None)
            s[restore.EXP_AVG] = _zero_full(engine, p, "exp_avg")
            s[restore.EXP_AVG_SQ] = _zero_full(engine, p, "exp_avg_sq")
            s[restore.STEP] = _zero_step(engine, p)
        out[name] = s
    return out


def by_unit(state: dict[str, dict[str, torch.Tensor]], layout: ExpertLayout, ep_rank: int
            ) -> dict[int | str, dict[str, torch.Tensor]]:
    """Per unit (global expert index, or dense parameter name): each quantity as one flat tensor (an
    expert's parameters concatenated in name order; steps: the largest)."""
    grouped: dict[int | str, list[dict[str, torch.Tensor]]] = {}
    for name in sorted(state):
        j = local_slot(name)
        unit: int | str = name if j is None else layout.global_expert(ep_rank, j)
        grouped.setdefault(unit, []).append(state[name])
    out: dict[int | str, dict[str, torch.Tensor]] = {}
    for unit, parts in grouped.items():
        out[unit] = {q: (torch.stack([p[q].max() for p in parts]).max().reshape(1) if q == "step"
                         else torch.cat([p[q].reshape(-1) for p in parts])) for q in parts[0]}
    return out


def gather_units(units: dict[int | str, dict[str, torch.Tensor]]) -> dict[int | str, dict[str, torch.Tensor]]:
    """Every rank's units merged (replicas of an expert hold the same state in the reference)."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, units)
    merged: dict[int | str, dict[str, torch.Tensor]] = {}
    for part in everyone:
        for unit, state in part.items():
            merged.setdefault(unit, state)
    return merged

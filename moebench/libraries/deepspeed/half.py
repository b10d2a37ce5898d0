"""Half precision on the DeepSpeed engine rows: the noise-model judgement of a bf16 row's reduced gradient and
applied update (moebench.parity.noise), the float32 master weights it reads, and whether this accelerator runs it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moebench.libraries.deepspeed.names import group

GRADIENT = "reduced gradient"
UPDATE = "applied update (fp32 masters)"
"""What a bf16 row's noise model judges: the reduced gradient DeepSpeed reports (`safe_get_full_grad`) and the
update its optimizer applied to the float32 master weights (`safe_get_full_fp32_param`, after - before)."""


def noise_judgement(tag: str, tensors: dict, gname: dict, ref_step, base_step, s,
                 world: int, what: str = GRADIENT):
    """The bf16 judgement (moebench.parity.noise): whole-model relative L2 distance of the reduced gradient
    (or the applied update) from float32, this engine's (every parameter once: replicated ones weighted 1/W,
    experts ep/W, summed over ranks) against the one-process bf16 baseline's."""
    from moebench.parity import noise

    ref = ref_step.grad if what == GRADIENT else ref_step.update
    base = base_step.grad if what == GRADIENT else base_step.update
    run = sum((noise.sums([(t, ref[gname[n]])], (s.ep_size if group(gname[n]) == "experts" else 1) / world)
               for n, t in tensors.items()), torch.zeros(3, dtype=torch.float64))
    dist.all_reduce(run)
    return noise.judge(tag, what, run, noise.sums((base[n], e) for n, e in ref.items()))


def fp32_masters(names: dict) -> dict[str, torch.Tensor] | None:
    """Each parameter's float32 master weight (bf16 optimizers keep one); None where this release cannot say."""
    try:
        from deepspeed.utils import safe_get_full_fp32_param
    except ImportError:
        return None
    out = {}
    for n, p in names.items():
        master = safe_get_full_fp32_param(p)
        if master is None:
            return None
        out[n] = master.detach().double().clone()
    return out


def supported_or_skip(s) -> None:
    """bf16 needs DeepSpeed's CPU accelerator to declare bf16 support."""
    from deepspeed.accelerator import get_accelerator

    from moebench.parity.registry import SkipCheck

    if not get_accelerator().is_bf16_supported():
        raise SkipCheck(f"DeepSpeed's {get_accelerator().device_name()} accelerator does not support bf16 here")

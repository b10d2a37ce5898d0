"""Faults injected into DeepSpeed's OWN objects (never its installed files), one per mechanism the engine
rows must name: `FAULTS[name](set_attr)` patches the current process with
`set_attr(obj, "attr", value)` (pytest's monkeypatch.setattr in-process; plain setattr through
tests/faults/inject/sitecustomize.py in a subprocess). Ranks forked afterwards inherit the patch.

- expert-grad-wrong-group: at ZeRO 1 and 2, each expert gradient enters the reduction bucket scaled by
  dp / edp, so after DeepSpeed divides the bucket by dp it is divided by the expert-data-parallel size
  instead (x ep_size; invisible at ep_size = 1, where edp = dp);
- local-global-norm: the global gradient norm used for clipping is each rank's own (ZeRO 1/2: its own
  partition, never summed over the data-parallel group; ZeRO 0: its own parameters, never averaged);
- accum-boundary-skip: at ZeRO 0, at a gradient accumulation boundary (grad_accum > 1), the engine's
  gradient reduction is skipped: every rank steps on its own micro-steps' gradients. (At ZeRO 1/2 the
  ZeRO optimizer builds its partitions in that reduction: skipping it there makes DeepSpeed itself
  raise KeyError in scaled_global_norm, a crash rather than a wrong number, so the fault stays at 0.)
- copy-back-wrong-param: at ZeRO 1 and 2, after the step's partitions are copied back into the
  module's parameters, two parameters of the same shape hold each other's updated values.
"""

from __future__ import annotations

from typing import Callable

import torch


def _zero_optimizer():
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer


def expert_grad_wrong_group(set_attr: Callable) -> None:
    import deepspeed.comm as dist
    from deepspeed.moe.utils import is_moe_param

    cls = _zero_optimizer()
    original = cls.reduce_independent_p_g_buckets_and_remove_grads

    def reduce(self, param, i):
        if is_moe_param(param):
            grad = self.get_gradient_for_reduction(param)
            if grad is not None:
                edp = dist.get_world_size(group=self.expert_dp_process_group[param.group_name])
                grad.mul_(dist.get_world_size(group=self.dp_process_group) / edp)
        return original(self, param, i)

    set_attr(cls, "reduce_independent_p_g_buckets_and_remove_grads", reduce)


def local_global_norm(set_attr: Callable) -> None:
    import deepspeed.runtime.engine as engine_module

    def local_norm(self, gradients, params, norm_type=2):
        norms = [torch.linalg.vector_norm(g.data.float(), ord=2) for g in gradients
                 if not getattr(g, "_zero_padding", False)]
        return torch.stack(norms).pow(2).sum().sqrt() if norms else torch.tensor(0.0)

    def local_clip(parameters, max_norm, norm_type=2, mpu=None):
        parameters = [p for p in parameters if p.grad is not None]
        total = torch.stack([p.grad.detach().float().norm(2) for p in parameters]).pow(2).sum().sqrt()
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for p in parameters:
            p.grad.data.mul_(coef)
        return total

    set_attr(_zero_optimizer(), "get_grad_norm_direct", local_norm)
    set_attr(engine_module, "clip_grad_norm_", local_clip)


def accum_boundary_skip(set_attr: Callable) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine.allreduce_gradients

    def allreduce_gradients(self, *args, **kwargs):
        if self.zero_optimization_stage() == 0 and self.gradient_accumulation_steps() > 1 \
                and self.is_gradient_accumulation_boundary():
            return None
        return original(self, *args, **kwargs)

    set_attr(DeepSpeedEngine, "allreduce_gradients", allreduce_gradients)


def copy_back_wrong_param(set_attr: Callable) -> None:
    cls = _zero_optimizer()
    original = cls.step

    def step(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        with torch.no_grad():
            for group in self.bit16_groups:
                seen: dict = {}
                for p in group:
                    other = seen.get(tuple(p.shape))
                    if other is not None:
                        held = p.data.clone()
                        p.data.copy_(other.data)
                        other.data.copy_(held)
                        return result
                    seen[tuple(p.shape)] = p
        return result

    set_attr(cls, "step", step)


FAULTS: dict[str, Callable[[Callable], None]] = {
    "expert-grad-wrong-group": expert_grad_wrong_group,
    "local-global-norm": local_global_norm,
    "accum-boundary-skip": accum_boundary_skip,
    "copy-back-wrong-param": copy_back_wrong_param,
}

"""Half-precision faults injected into DeepSpeed's OWN objects (never its installed files), as ds_faults.py does:
`FAULTS[name](set_attr)` patches this process; ranks forked (or spawned, through tests/faults/inject) inherit it.
Each hits ZeRO 1 and 2, where DeepSpeed 0.19.8 is right, so a row that passes unbroken must fail named:

- clip-norm-without-experts: the ZeRO optimizer's global gradient norm (what it clips by) leaves out the expert
  parameter groups (what DeepSpeed's ZeRO 0 half-precision optimizer does by itself: PR #8613);
- loss-scale-never-applied: the engine's backward never multiplies the loss by the fp16 loss scale, while the step
  still divides by it (what ZeRO 0 does by itself: PR #8393);
- loss-scale-twice: the loss multiplied by the loss scale twice.

And one upstream fix applied in-process, to see what it leaves:
- pr8393-applied: PR #8393's change (the ZeRO 0 fp16 backward multiplies the loss by the loss scale); with it the
  ZeRO 0 fp16 clip rows show the clip norm without the expert gradients (PR #8613).
"""

from __future__ import annotations

from typing import Callable


def _zero_optimizer():
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer


def clip_norm_without_experts(set_attr: Callable) -> None:
    from deepspeed.moe.utils import is_moe_param

    cls = _zero_optimizer()
    original = cls.get_grad_norm_direct

    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        norm = original(self, gradients, params, norm_type)
        if params and all(is_moe_param(p) for p in params):
            return norm * 0  # the expert groups' share of the global norm left out (their collectives still run)
        return norm

    set_attr(cls, "get_grad_norm_direct", get_grad_norm_direct)


def loss_scale_never_applied(set_attr: Callable) -> None:
    set_attr(_zero_optimizer(), "scale_if_loss", lambda self, value: value)


def loss_scale_twice(set_attr: Callable) -> None:
    cls = _zero_optimizer()
    original = cls.scale_if_loss
    set_attr(cls, "scale_if_loss", lambda self, value: original(self, original(self, value)))


def pr8393_applied(set_attr: Callable) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine.backward

    def backward(self, loss, *args, **kwargs):
        if self.fp16_enabled() and not self.zero_optimization():  # ZeRO 0's fp16 optimizer divides by this scale
            loss = loss * self.optimizer.loss_scale_config.cur_scale
        return original(self, loss, *args, **kwargs)

    set_attr(DeepSpeedEngine, "backward", backward)


FAULTS: dict[str, Callable[[Callable], None]] = {
    "clip-norm-without-experts": clip_norm_without_experts,
    "loss-scale-never-applied": loss_scale_never_applied,
    "loss-scale-twice": loss_scale_twice,
    "pr8393-applied": pr8393_applied,
}

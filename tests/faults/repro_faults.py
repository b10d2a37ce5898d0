"""Faults for the --repro tests, each patching the library's own objects: FAULTS[name](set_attr).

- expert-grad-x2: DeepSpeed's ZeRO 1/2 optimizer doubles the expert groups' gradients right after its
  reduction (the partition it will step on), as a reduction scaled by the wrong group size would;
- rank-sleeps: rank 1 of a DeepSpeed engine never returns from its first optimizer step (a hang);
- fairscale-backward-local: fairscale's `_AllToAll.backward` keeps each rank's own gradient (no exchange back);
- transformers-expert-grad-x-world: transformers' all_to_all + FSDP2 expert gradients summed over the ranks
  instead of averaged (the divide factor of the experts' FSDP unit reset to 1).
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import torch


def _expert_grad_x2(set_attr: Callable) -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue

    @functools.wraps(original)
    def epilogue(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.is_gradient_accumulation_boundary():
            for i, is_moe in enumerate(self.is_moe_param_group):
                grads = self.averaged_gradients.get(i) if is_moe else None
                for grad in grads or ():
                    grad.mul_(2.0)
        return out

    set_attr(DeepSpeedZeroOptimizer, "independent_gradient_partition_epilogue", epilogue)


def _rank_sleeps(set_attr: Callable) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine.step

    @functools.wraps(original)
    def step(self, *args, **kwargs):
        if torch.distributed.get_rank() == 1:
            time.sleep(10**6)
        return original(self, *args, **kwargs)

    set_attr(DeepSpeedEngine, "step", step)


FAULTS: dict[str, Callable[[Callable], None]] = {
    "expert-grad-x2": _expert_grad_x2,
    "rank-sleeps": _rank_sleeps,
}


def _fairscale_backward_local(set_attr: Callable) -> None:
    from fairscale.nn.moe.moe_layer import _AllToAll

    def backward(ctx, *grad_output):
        return (None, grad_output[0].contiguous())  # each rank keeps its own gradient: no exchange back

    set_attr(_AllToAll, "backward", staticmethod(backward))


FAULTS["fairscale-backward-local"] = _fairscale_backward_local


def _transformers_expert_grad_x_world(set_attr: Callable) -> None:
    """Expert gradients summed over the data-parallel ranks instead of averaged (all_to_all + FSDP2): the
    divide factor transformers sets on the experts' FSDP unit is reset to 1."""
    import transformers.distributed.mixin as mixin

    original = mixin.apply_fully_sharded_data_parallelism

    def without_divide_factor(model, mesh_manager, fsdp_plan, ep_plan):
        model = original(model, mesh_manager, fsdp_plan, ep_plan)
        for name, module in model.named_modules():
            if ep_plan.get(name) == "ep_dispatch_experts":
                module.set_gradient_divide_factor(1.0)
        return model

    set_attr(mixin, "apply_fully_sharded_data_parallelism", without_divide_factor)


FAULTS["transformers-expert-grad-x-world"] = _transformers_expert_grad_x_world


def swap_in_saved(set_attr: Callable, wrapper: str, key_end: str) -> None:
    """What Automodel's `wrapper` (ModelState / OptimizerState) hands DCP, with each rank's local slots 0 and 1 of
    every tensor whose key ends with `key_end` swapped (a copy: the live state is untouched): a checkpoint whose
    experts (or their moments) are in the wrong slots. Also used by tests/libraries/test_automodel_resume.py."""
    from nemo_automodel.components.checkpoint import stateful_wrappers
    from torch.distributed.tensor import DTensor

    owner = getattr(stateful_wrappers, wrapper)
    original = owner.state_dict

    def swapped(self):
        sd = original(self)

        def walk(d):
            for key, t in list(d.items()):
                if isinstance(t, dict):
                    walk(t)
                elif str(key).endswith(key_end) and isinstance(t, DTensor) and t.dim() == 3:
                    local = t.to_local()
                    moved = local.clone()
                    moved[[0, 1]] = local[[1, 0]]
                    d[key] = DTensor.from_local(moved, t.device_mesh, t.placements)
        walk(sd)
        return sd

    set_attr(owner, "state_dict", swapped)


FAULTS["automodel-experts-swapped-in-checkpoint"] = functools.partial(swap_in_saved, wrapper="ModelState",
                                                                     key_end="experts.gate_and_up_projs")

"""Checkpoint bugs injected into DeepSpeed's own save / load code (never its files).

`FAULTS[name](set_attr)` patches DeepSpeed's classes in this process (forked ranks inherit it; a
subprocess gets it through tests/faults/inject/sitecustomize.py). Each is a bug class seen in the wild:
- "swap-masters": on rank 0, local expert slots 0 and 1 exchange their fp32 masters as the ZeRO 1/2
  optimizer state is loaded (an index map off by one slot);
- "wrong-group-state": every rank's experts get the ZeRO optimizer state (masters, Adam moments) the NEXT
  rank loaded, i.e. that of another rank of the wrong expert group (DeepSpeed's elastic path with the D + E layout
  does this by itself: docs/libraries/deepspeed.md);
- "one-rank-experts": at the save every rank writes rank 0's experts under its own experts' names
  (KempnerForge #202);
- "skip-experts": the load leaves every expert's module weights at the fresh initialisation.
"""

from __future__ import annotations

from typing import Callable

EXPERTS = ".deepspeed_experts."


def _swap_masters(set_attr) -> None:
    import torch.distributed as dist
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer._load_legacy_checkpoint

    def load(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if dist.get_rank() == 0:
            for i, group in enumerate(self.optimizer.param_groups):
                if not self.is_moe_group(group):
                    continue
                params = self.bit16_groups[i]
                half = len(params) // 2  # local slot 0's parameters, then slot 1's (the rows' ep = W)
                for a, b in zip(params[:half], params[half:]):
                    fa, fb = a._hp_mapping.hp_fragment, b._hp_mapping.hp_fragment
                    saved = fa.detach().clone()
                    fa.data.copy_(fb.data)
                    fb.data.copy_(saved)
        return out

    set_attr(DeepSpeedZeroOptimizer, "_load_legacy_checkpoint", load)


def _wrong_group_state(set_attr) -> None:
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer._load_legacy_checkpoint

    def load(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        world, rank = dist.get_world_size(), dist.get_rank()
        for i, group in enumerate(self.optimizer.param_groups):
            if not self.is_moe_group(group):
                continue
            flat = self.single_partition_of_fp32_groups[i]
            state = self.optimizer.state[flat]
            for t in [flat.data] + [state[k] for k in ("exp_avg", "exp_avg_sq") if k in state]:
                parts = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(parts, t.contiguous())
                t.copy_(parts[(rank + 1) % world])  # the next rank's expert state: another expert group's
        return out

    set_attr(DeepSpeedZeroOptimizer, "_load_legacy_checkpoint", load)


def _one_rank_experts(set_attr) -> None:
    import torch.distributed as dist
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._save_moe_checkpoint

    def save(self, *args, **kwargs):
        experts = [p for name, p in self.module.named_parameters() if EXPERTS in name]
        kept = [p.detach().clone() for p in experts]
        for p in experts:  # every rank now holds rank 0's experts, and saves them under its own names
            dist.broadcast(p.data, src=0)
        try:
            return original(self, *args, **kwargs)
        finally:
            for p, k in zip(experts, kept):
                p.data.copy_(k)

    set_attr(DeepSpeedEngine, "_save_moe_checkpoint", save)


def _skip_experts(set_attr) -> None:
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine.load_moe_state_dict

    def load_moe_state_dict(*args, **kwargs):
        out = original(*args, **kwargs)
        state_dict, model = kwargs.get("state_dict", args[2] if len(args) > 2 else None), kwargs.get("model")
        fresh = model.state_dict()
        for key in list(state_dict):
            if EXPERTS in key:
                state_dict[key] = fresh[key].clone()  # the experts are never restored
        return out

    set_attr(DeepSpeedEngine, "load_moe_state_dict", staticmethod(load_moe_state_dict))


FAULTS: dict[str, Callable[[Callable], None]] = {
    "swap-masters": _swap_masters,
    "wrong-group-state": _wrong_group_state,
    "one-rank-experts": _one_rank_experts,
    "skip-experts": _skip_experts,
}

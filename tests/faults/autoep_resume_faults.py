"""Checkpoint bugs injected into DeepSpeed's own AutoEP objects (never its files), for the AutoEP resume rows.

`FAULTS[name](set_attr)` patches DeepSpeed's classes in this process (forked ranks inherit it; a --repro script gets
it through tests/faults/inject/sitecustomize.py). Each is a bug class seen in the wild:
- "swap-slots": on rank 0, AutoEP's local expert slots 0 and 1 exchange their weights as the per-expert files are
  stacked back (an index map off by one slot; ZeRO 0, where the module weights are what the optimizer steps);
- "moment-from-another-expert": on rank 0, slot 0 gets slot 1's AdamW exp_avg (and slot 1 slot 0's) as the ZeRO 1/2
  optimizer state is loaded: the weights and fp32 masters right, a moment another expert's;
- "bias-from-another-rank": the router updates DeepSeek-V3's routing bias from its own rank's token counts, with no
  all-reduce (auxiliary-loss-free balancing done rank-locally): the ranks' biases drift apart, the checkpoint keeps
  rank 0's and every rank resumes with it;
- "stale-lr": every restored slot right, but the load leaves the optimizer's learning rate at twice the saved one
  (a scheduler state restored from another run): invisible to the slot matcher, seen by the continued run.
"""

from __future__ import annotations

from typing import Callable

EXPERT_WEIGHTS = ("experts.w1", "experts.w2", "experts.w3")


def _swap_slots(set_attr) -> None:
    import torch.distributed as dist
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine.load_moe_state_dict

    def load_moe_state_dict(*args, **kwargs):
        out = original(*args, **kwargs)
        state_dict = kwargs.get("state_dict", args[2] if len(args) > 2 else None)
        if dist.get_rank() == 0:
            for key in [k for k in state_dict if k.endswith(EXPERT_WEIGHTS)]:
                stacked = state_dict[key].clone()
                stacked[[0, 1]] = stacked[[1, 0]]  # slots 0 and 1 exchanged
                state_dict[key] = stacked
        return out

    set_attr(DeepSpeedEngine, "load_moe_state_dict", staticmethod(load_moe_state_dict))


def _moment_from_another_expert(set_attr) -> None:
    import torch.distributed as dist
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer._load_legacy_checkpoint

    def load(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if dist.get_rank() == 0:
            for params in self.bit16_groups:
                for p in params:
                    m = getattr(p, "_hp_mapping", None)
                    if m is None or getattr(p, "allreduce", True) or m.lp_fragment_address.numel != p.numel():
                        continue  # an expert parameter held whole in this rank's partition (ep = W)
                    flat = self.single_partition_of_fp32_groups[m.param_group_index]
                    exp_avg = self.optimizer.state[flat]["exp_avg"]
                    fragment = exp_avg.narrow(0, m.hp_fragment_address.start, p.numel()).view(p.shape)
                    fragment[[0, 1]] = fragment[[1, 0]].clone()
        return out

    set_attr(DeepSpeedZeroOptimizer, "_load_legacy_checkpoint", load)


RATE = 1e-2
"""The rank-local bias update's step (DeepSeek-V3's bias update speed is of this order)."""


def _bias_from_another_rank(set_attr) -> None:
    import torch
    from deepspeed.moe.ep_router import TokenChoiceTopKRouter

    original = TokenChoiceTopKRouter.forward

    def forward(self, x, *args, **kwargs):
        out = original(self, x, *args, **kwargs)
        bias = getattr(self, "e_score_correction_bias", None)
        if self.training and bias is not None and torch.is_grad_enabled():
            counts = out[2].float()
            with torch.no_grad():  # this rank's counts only: no all-reduce before the update
                bias.add_(RATE * torch.sign(counts.mean() - counts))
        return out

    set_attr(TokenChoiceTopKRouter, "forward", forward)


def _stale_lr(set_attr) -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer._load_legacy_checkpoint

    def load(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        for group in self.optimizer.param_groups:
            group["lr"] = 2 * group["lr"]
        return out

    set_attr(DeepSpeedZeroOptimizer, "_load_legacy_checkpoint", load)


FAULTS: dict[str, Callable[[Callable], None]] = {
    "swap-slots": _swap_slots,
    "moment-from-another-expert": _moment_from_another_expert,
    "bias-from-another-rank": _bias_from_another_rank,
    "stale-lr": _stale_lr,
}

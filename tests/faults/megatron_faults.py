"""Faults injected into megatron-core's OWN objects (never its installed files), one per mechanism the Megatron rows
must name: `FAULTS[name](set_attr)` patches the current process with `set_attr(obj, "attr", value)` (pytest's
monkeypatch.setattr); ranks forked afterwards inherit the patch. Each is a known-wrong variant of a mechanism
Megatron's tracker fixed or could break:

- aux-loss-tp-factor: every aux and z loss handed to MoEAuxLossAutoScaler is divided by the TP size (the per-token
  loss's missing TP factor of NVIDIA/Megatron-LM#5047, made to show without the per-token loss);
- expert-grads-x-ep: after DDP's gradient reduction the expert buffers hold ep_size x their gradients (the
  Megatron-FSDP v2 bug of NVIDIA/Megatron-LM#5956: an AVG over expert-DP of gradients that already sum over EP);
- norm-without-experts: the optimizer's gradient norm leaves out every expert parameter;
- norm-tp-rank-0-experts: expert parameters lose their `tensor_model_parallel` mark before the optimizer is built, so
  its duplicate filter counts them on TP rank 0 only (how Transformer Engine's expert linears were marked before
  NVIDIA/Megatron-LM#5916);
- expert-dp-skipped: DDP's expert buckets are never reduced (neither scaled nor all-reduced over expert-DP).
"""

from __future__ import annotations

from typing import Callable


def aux_loss_tp_factor(set_attr: Callable) -> None:
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    original = MoEAuxLossAutoScaler.apply

    def apply(activation, aux_loss):
        return original(activation, aux_loss / parallel_state.get_tensor_model_parallel_world_size())

    set_attr(MoEAuxLossAutoScaler, "apply", apply)


def expert_grads_x_ep(set_attr: Callable) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel

    original = DistributedDataParallel.finish_grad_sync

    def finish_grad_sync(self, *args, **kwargs):
        original(self, *args, **kwargs)
        ep = parallel_state.get_expert_model_parallel_world_size()
        for buffer in self.expert_parallel_buffers:
            buffer.grad_data.mul_(ep)

    set_attr(DistributedDataParallel, "finish_grad_sync", finish_grad_sync)


def norm_without_experts(set_attr: Callable) -> None:
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    original = MegatronOptimizer.get_main_grads_for_grad_norm

    def get_main_grads_for_grad_norm(self):
        experts = {id(p.grad) for p in self.get_parameters() if not getattr(p, "allreduce", True)
                   and p.grad is not None}
        return [g for g in original(self) if id(g) not in experts]

    set_attr(MegatronOptimizer, "get_main_grads_for_grad_norm", get_main_grads_for_grad_norm)


def norm_tp_rank_0_experts(set_attr: Callable) -> None:
    import megatron.core.optimizer as optimizer

    original = optimizer.get_megatron_optimizer

    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        for chunk in model_chunks:
            for param in chunk.parameters():
                if not getattr(param, "allreduce", True):
                    param.tensor_model_parallel = False
        return original(config, model_chunks, *args, **kwargs)

    set_attr(optimizer, "get_megatron_optimizer", get_megatron_optimizer)


def expert_dp_skipped(set_attr: Callable) -> None:
    from megatron.core.distributed import DistributedDataParallel

    original = DistributedDataParallel.finish_grad_sync

    def finish_grad_sync(self, *args, **kwargs):
        held = self.expert_parallel_bucket_groups
        self.expert_parallel_bucket_groups = []
        try:
            original(self, *args, **kwargs)
        finally:
            self.expert_parallel_bucket_groups = held

    set_attr(DistributedDataParallel, "finish_grad_sync", finish_grad_sync)


FAULTS = {
    "aux-loss-tp-factor": aux_loss_tp_factor,
    "expert-grads-x-ep": expert_grads_x_ep,
    "norm-without-experts": norm_without_experts,
    "norm-tp-rank-0-experts": norm_tp_rank_0_experts,
    "expert-dp-skipped": expert_dp_skipped,
}

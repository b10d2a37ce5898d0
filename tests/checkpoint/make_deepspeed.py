"""Real DeepSpeed checkpoints of moebench's tiny MoE net, saved by two gloo ranks at ep_size 2 (a script:
`python make_deepspeed.py OUT`). torch's Adam is handed to the engine, so no op is compiled.

- regular/     ZeRO 0: `save_checkpoint` (mp_rank_00_model_states.pt, one file per global expert,
               expp_rank_<r>_mp_rank_00_optim_states.pt);
- zero1/       ZeRO 1 at ep_size 1 (ds_to_universal 0.19 cannot merge native MoE experts saved at ep_size > 1):
               `save_checkpoint`, then DeepSpeed's own `ds_to_universal` into zero1/universal;
- buffer/      as zero1/, with a persistent buffer (a routing bias) on the MoE layer: the universal load
               restores parameters from zero/ only, so the buffer would come back as its initial value.
"""

from __future__ import annotations

import argparse
import os

EXPERTS = 4
TAG = "step2"


def _engine(stage: int, buffer: bool, ep: int):
    import deepspeed
    import torch
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups

    from moebench.models.deepspeed_moe import TinyMoENet
    from moebench.variants.deepspeed.config import DeepSpeedMoEConfig

    if f"ep_size_{ep}" not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep)
    moe = DeepSpeedMoEConfig(experts=(EXPERTS,), d_hidden=16, capacity_factor=1.0, eval_capacity_factor=1.0,
                             min_capacity=0, noisy_gate_policy="none", drop_tokens=False, use_rts=False,
                             ep_size=ep, top_k=1, use_residual=False)
    model = TinyMoENet(moe, EXPERTS, 0, groups._get_expert_parallel_rank(f"ep_size_{ep}"), d_model=8)
    if buffer:
        model.moe.moe.deepspeed_moe.gate.register_buffer("e_score_correction_bias",
                                                            torch.arange(EXPERTS, dtype=torch.float32))
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "parameters"})
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(params, lr=1e-3), config=config)
    return engine


def _train(engine, rank: int) -> None:
    import torch

    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 4, 8, generator=g), torch.randn(4, 4, 8, generator=g)
        pred, aux = engine(x)
        engine.backward(torch.nn.functional.mse_loss(pred, y) + 0.01 * aux)
        engine.step()


def _universal(folder: str) -> None:
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=os.path.join(folder, TAG), output_folder=os.path.join(folder, "universal"),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=False)
    ds_to_universal.main(args)
    with open(os.path.join(folder, "latest_universal"), "w") as f:
        f.write("universal")


def _rank(rank: int, out: str, store: str) -> None:
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    for name, stage, buffer, ep in (("regular", 0, False, 2), ("zero1", 1, False, 1), ("buffer", 1, True, 1)):
        engine = _engine(stage, buffer, ep)
        _train(engine, rank)
        if stage:
            setattr(engine.module, "universal_checkpoint_info", {})
        engine.save_checkpoint(os.path.join(out, name), tag=TAG)
        dist.barrier()
        if stage and rank == 0:
            _universal(os.path.join(out, name))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import two_ranks

    two_ranks.main(_rank)

"""DeepSpeed ZeRO-3: a universal-checkpoint load gives every parameter group one shared AdamW `step` tensor.

Two parameter groups (no MoE), ZeRO stage 3, torch.optim.AdamW, one process on CPU (gloo). Train 3 steps, save,
convert with ds_to_universal, load the universal checkpoint into a fresh engine, take 1 more step, and compare
with the run that never stopped. Exit 1 (printing what differs) when the resumed run differs, 0 when it does not.
Run: DS_ACCELERATOR=cpu python deepspeed-zero3-universal-shared-step.py [--one-group]
"""
import argparse
import os
import sys
import tempfile

os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.checkpoint import ds_to_universal  # noqa: E402

GROUPS = [dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-3, weight_decay=0.0)]  # two groups, as a user's decay split
ONE_GROUP = "--one-group" in sys.argv  # instead: one param group, split by ZeRO-3 into sub-groups of 80 elements


def engine(seed, universal):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    groups = [dict(params=list(model[i].parameters()), **hyper) for i, hyper in zip((0, 2), GROUPS)]
    if ONE_GROUP:
        groups = [dict(params=list(model.parameters()), **GROUPS[0])]
    zero = {"stage": 3, **({"sub_group_size": 80} if ONE_GROUP else {})}
    config = {"train_batch_size": 4, "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "checkpoint": {"load_universal": universal}, "steps_per_print": 10**9}
    setattr(model, "universal_checkpoint_info", {})
    return deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups), config=config)[0]


def train(e, steps):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        e.backward(torch.nn.functional.mse_loss(e(x), y))
        e.step()


def seen(e):
    """Per ZeRO-3 sub-group (a param group here, or a part of one): (AdamW step, lr, weight_decay, this rank's fp32
    partition after the step)."""
    opt, out = e.optimizer, []
    for i, p in enumerate(opt.fp32_partitioned_groups_flat):
        g = opt.optimizer.param_groups[opt.sub_group_to_group_id[i]]
        out.append((int(opt.optimizer.state[p]["step"]), g["lr"], g["weight_decay"], p.detach().clone()))
    return out


def main():
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of DeepSpeed's shm comm op
    folder = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    a = engine(0, universal=False)
    train(a, range(3))
    a.save_checkpoint(folder, tag="step3")
    ds_to_universal.main(argparse.Namespace(
        input_folder=f"{folder}/step3", output_folder=f"{folder}/step3_universal", num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False))
    with open(f"{folder}/latest_universal", "w") as f:
        f.write("step3_universal")
    b = engine(1, universal=True)  # another seed: whatever the load misses stays visibly fresh
    b.load_checkpoint(folder)
    train(a, [3])  # the run that never stopped
    train(b, [3])  # the resumed run
    bugs = []
    for i, (want, got) in enumerate(zip(seen(a), seen(b))):
        for what, w, g in zip(("AdamW step", "lr", "weight_decay"), want, got):
            if w != g:
                bugs.append(f"group {i}: {what} {g} after the resume, {w} uninterrupted")
        if not torch.allclose(got[3], want[3], rtol=1e-6, atol=1e-7):
            bugs.append(f"group {i}: parameters differ from the uninterrupted run by up to "
                        f"{(got[3] - want[3]).abs().max().item():.3g}")
    print("\n".join(["BUG: a ZeRO-3 universal-checkpoint resume differs from the uninterrupted run:", *bugs])
          if bugs else "OK: the resumed run matches the uninterrupted run")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())

"""DeepSpeed: loading a universal checkpoint never restores the model's buffers (BatchNorm's running statistics).

A model with BatchNorm1d, ZeRO stage 1 and 3, torch.optim.AdamW, one process on CPU (gloo). Train 3 steps, save,
convert with ds_to_universal, load the universal checkpoint into a fresh engine, and compare every buffer and the
model's eval-mode output with the saved model's. Exit 1 (printing what differs) when they differ, 0 when they do not.
Run: DS_ACCELERATOR=cpu python deepspeed-universal-load-drops-buffers.py
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


def engine(seed, stage, universal):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    config = {"train_batch_size": 4, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "checkpoint": {"load_universal": universal}, "steps_per_print": 10**9}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def check(stage, folder):
    a = engine(0, stage, universal=False)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g) * 3 + 1, torch.randn(4, 8, generator=g)
        a.backward(torch.nn.functional.mse_loss(a(x), y))
        a.step()
    a.save_checkpoint(folder, tag="step3", client_state={"universal_checkpoint_info": {}})
    ds_to_universal.main(argparse.Namespace(
        input_folder=f"{folder}/step3", output_folder=f"{folder}/step3_universal", num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False))
    with open(f"{folder}/latest_universal", "w") as f:
        f.write("step3_universal")
    b = engine(1, stage, universal=True)  # another seed: whatever the load misses stays visibly fresh
    b.load_checkpoint(folder)
    bugs = []
    want, got = dict(a.module.named_buffers()), dict(b.module.named_buffers())
    for name in want:
        if not torch.equal(got[name], want[name]):
            head = [[round(v, 4) for v in t.flatten()[:2].tolist()] for t in (got[name], want[name])]
            bugs.append(f"ZeRO {stage}: buffer {name} is {head[0]}... after the load, {head[1]}... saved")
    a.eval(), b.eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        diff = (b(x) - a(x)).abs().max().item()
    if diff > 0:
        bugs.append(f"ZeRO {stage}: the loaded model's eval output differs from the saved model's by up to {diff:.3g}")
    return bugs


def main():
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of DeepSpeed's shm comm op
    folder = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    bugs = check(1, f"{folder}/zero1") + check(3, f"{folder}/zero3")
    print("\n".join(["BUG: a universal-checkpoint load does not restore the model's buffers:", *bugs])
          if bugs else "OK: every buffer restored, the loaded model's eval output is the saved model's")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())

"""torchtitan's releases as measured here (CPU, gloo; 0.3.0 through its trainer's parallelize function, fully_shard
included; 0.2 through its EP step, its FSDP's reduction emulated in the rows).
docs/libraries/torchtitan.md has each row whole."""

from moebench.libraries.spec import SKIPPED, VERIFIED, Release

SLOW = "tests/libraries/test_torchtitan_releases.py"
COMPATIBILITY = (
    Release(versions="0.3.0", status=VERIFIED, pinned=True, measured_by="tests/libraries/test_torchtitan.py",
            result="passes through its trainer's parallelize (fully_shard) on partial_dtensor and full_dtensor; "
                   "its default spmd_types rows are refused: its fully_shard takes spmd_types' plain parameters "
                   "from torch 2.14 on (pytorch/pytorch#181519)",
            torch_floor="2.14", floor_for="its default spmd_types backend (its trainer's fully_shard)"),
    Release(versions="0.3.0", status=VERIFIED, torch="2.15.0", measured_by="tests/libraries/test_torchtitan.py",
            result="every row passes through its trainer's parallelize (fully_shard), spmd_types included",
            torch_floor="2.14", floor_for="its default spmd_types backend (its trainer's fully_shard)"),
    Release(versions="0.2.2", status=VERIFIED, measured_by=SLOW,
            result="its EP rows pass; its TP rows where torchdata, tensorboard and datasets import"),
    Release(versions="0.2.0", status=VERIFIED, measured_by=SLOW, result="its EP row passes"),
    Release(versions="0.1.0", status=SKIPPED, result="no MoE outside experiments/llama4"),
)

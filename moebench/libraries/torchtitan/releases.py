"""torchtitan's releases as measured here (torch 2.13 CPU, gloo; its FSDP's reduction emulated in the rows).
docs/libraries/torchtitan.md has each finding whole."""

from moebench.libraries.spec import SKIPPED, VERIFIED, Release

SLOW = "tests/libraries/test_torchtitan_releases.py"
COMPATIBILITY = (
    Release(versions="0.3.0", status=VERIFIED, pinned=True, measured_by="tests/libraries/test_torchtitan.py",
            result="passes, except its default spmd_types backend with tp > 1: grad-left-partial, and its resume "
                   "without fully_shard: permutation (both on rows that emulate FSDP)"),
    Release(versions="0.2.2", status=VERIFIED, measured_by=SLOW,
            result="its EP rows pass; its TP rows where torchdata, tensorboard and datasets import"),
    Release(versions="0.2.0", status=VERIFIED, measured_by=SLOW, result="its EP row passes"),
    Release(versions="0.1.0", status=SKIPPED, result="no MoE outside experiments/llama4"),
)

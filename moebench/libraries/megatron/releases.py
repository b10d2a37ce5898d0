"""Megatron-core's releases as measured here (torch 2.13 CPU, gloo, W = 2; in-rank stand-ins for its CUDA calls).
docs/libraries/megatron.md has each finding whole."""

from moebench.libraries.spec import VERIFIED, Release

SLOW = "tests/libraries/test_megatron_releases.py"
FINDINGS = ("3 rows fail: aux-loss-scale under TP with the per-token loss (NVIDIA/Megatron-LM#5047); "
            "expert-dp-unreduced with ETP != TP and EP = 1 (#5916)")
COMPATIBILITY = (
    Release(versions="0.19.2", status=VERIFIED, measured_by=SLOW,
            result="every row it has passes (Python >= 3.12: its wheel's code side-installed)"),
    Release(versions="0.16.1", status=VERIFIED, pinned=True, measured_by="tests/libraries/test_megatron.py",
            result=FINDINGS),
    Release(versions="0.13.1-0.16.0", status=VERIFIED, measured_by=SLOW, result=f"as 0.16.1: {FINDINGS}"),
    Release(versions="0.12.3", status=VERIFIED, measured_by=SLOW,
            result="raises where later releases compute wrong, and in its distributed optimizer"),
)

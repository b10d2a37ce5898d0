"""DeepSpeed's releases as measured here (torch 2.13 CPU, gloo): the engine rows at W = 2, and the resume rows.
docs/libraries/deepspeed.md has each finding whole."""

from moebench.libraries.spec import SKIPPED, VERIFIED, Release

OLD = "tests/libraries/test_deepspeed_old_releases.py"
COMPATIBILITY = (
    Release(versions="0.19.8", status=VERIFIED, pinned=True, measured_by="tests/libraries/test_ds_engine.py",
            result="at ZeRO 0: clipping by the wrong norm, global-norm (deepspeedai/DeepSpeed#8475); fp16 "
                   "loss-scale-never-applied (PR #8393); half-precision clip-norm-without-group (PR #8613); ZeRO 1/2 "
                   "right"),
    Release(versions="0.19.0-0.19.7", status=VERIFIED,
            result="global-norm as 0.19.8; 0.19.0's resumed Adam step raises (its step restored as two elements)"),
    Release(versions="0.18.7-0.18.9", status=VERIFIED, measured_by=OLD,
            result="ZeRO 1/2 steps raise on CPU (fixed by #7948 in 0.19.0); global-norm"),
    Release(versions="0.17.6-0.18.0", status=VERIFIED, measured_by=OLD,
            result="ZeRO 2 accumulation keeps the last micro-step: accum-boundary (#7718); bf16 ZeRO 0 gradients "
                   "x 65536: loss-scale (#7837); global-norm"),
    Release(versions="0.15.4-0.17.0", status=VERIFIED, measured_by=OLD,
            result="bf16 at ZeRO 0 raises in BF16_Optimizer's MoE norm; global-norm"),
    Release(versions="0.14.4-0.15.0", status=VERIFIED, measured_by=OLD,
            result="expert updates W x too large at ZeRO 1/2: reduced-grad-wrong (#6545, fixed by #6546); bf16 at "
                   "ZeRO 0 raises; global-norm"),
    Release(versions="0.14.3", status=SKIPPED,
            result="does not import on torch 2.13 (_get_socket_with_port was removed from torch)"),
    Release(versions="<= 0.14.0", status=SKIPPED, measured_by=OLD,
            result="does not import on a CPU (its CPU accelerator requires intel_extension_for_pytorch)"),
)

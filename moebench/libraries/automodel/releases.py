"""NeMo Automodel's releases as measured here (torch 2.13 CPU, gloo, W = 2; side-installed).
docs/libraries/automodel.md has each finding whole."""

from moebench.libraries.spec import SKIPPED, VERIFIED, Release

SLOW = "tests/libraries/test_automodel_releases.py"
COMPATIBILITY = (
    Release(versions="0.7.0", status=VERIFIED, pinned=True, measured_by="tests/libraries/test_automodel.py",
            result="every row passes, resume included"),
    Release(versions="0.7.0", status=SKIPPED, torch="2.15.0", measured_by="tests/libraries/test_automodel_resume.py",
            result="its resume and recipe rows skip: its FSDP patch reads FSDPParam.to_accumulated_grad_if_needed, "
                   "which torch 2.15 removed (they would raise in Automodel's own code); its apply_ep rows pass"),
    Release(versions="0.6.0", status=VERIFIED, measured_by=SLOW, result="every row passes, resume included"),
    Release(versions="0.5.0", status=VERIFIED, measured_by=SLOW,
            result="router-detached (its EP all-gather of the routing weights is not differentiable); its "
                   "checkpoint refused on load (the gate's optimizer state missing, NVIDIA-NeMo/Automodel#2088)"),
    Release(versions="0.4.0", status=VERIFIED, measured_by=SLOW,
            result="router-detached; the shared-experts rows skip (a CUDA stream)"),
    Release(versions="0.3.0", status=VERIFIED, measured_by=SLOW, result="gather-backward-unreduced"),
    Release(versions="<= 0.2.0", status=SKIPPED, result="does not build under transformers 5"),
)

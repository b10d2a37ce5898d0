"""DeepSpeed AutoEP's releases as measured here (torch 2.13 CPU, gloo), each with the transformers it ran with.
docs/libraries/autoep.md has each finding whole."""

from moebench.libraries.spec import SKIPPED, VERIFIED, Release

COMPATIBILITY = (
    Release(versions="0.19.8", status=VERIFIED, pinned=True, measured_by="tests/libraries/test_autoep.py",
            result="with transformers 5.23 through a named shim (as shipped: incompatible-release); global-norm at "
                   "ZeRO 0 with clipping (deepspeedai/DeepSpeed#8475); resume: a universal load leaves buffers "
                   "unrestored (not-restored)"),
    Release(versions="0.19.8 + transformers 5.22.2", status=VERIFIED,
            measured_by="tests/libraries/test_autoep_releases.py",
            result="AutoEP as shipped, no shim: global-norm and the refused client optimizer only"),
    Release(versions="0.19.5", status=VERIFIED, measured_by="tests/libraries/test_autoep_releases.py",
            result="as 0.19.8, and DeepSeek-V3's routing bias dropped (#8358, fixed by #8369 in 0.19.7); "
                   "accum-boundary (#8245)"),
    Release(versions="0.19.2-0.19.4", status=VERIFIED, measured_by="tests/libraries/test_autoep_resume_releases.py",
            result="as 0.19.5, and the universal converter refuses AutoEP's expert files (#8147, fixed by #8198 in "
                   "0.19.5)"),
    Release(versions="<= 0.19.1", status=SKIPPED, result="no AutoEP (deepspeed/module_inject/auto_ep.py arrived in "
                                                          "0.19.2)"),
)

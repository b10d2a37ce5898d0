"""transformers' releases as measured here (torch 2.13 CPU, gloo, W = 2; side installs of the wheels).
docs/libraries/transformers.md has each finding whole."""

from moebench.libraries.spec import REFUSED, VERIFIED, Release

SLOW = "tests/libraries/test_transformers_releases.py"
COMPATIBILITY = (
    Release(versions="5.23.0", status=VERIFIED, pinned=True,
            measured_by="tests/libraries/test_transformers_adapter.py", result="every row passes (W = 2 and 4)"),
    Release(versions="5.20-5.22", status=VERIFIED,
            result="5.22.0: the all_to_all+tp and all_reduce rows pass; all_to_all skips (no fsdp_plan)"),
    Release(versions="5.17-5.19", status=VERIFIED, measured_by=SLOW,
            result="5.17.0: batched_mm router gradient wrong (huggingface/transformers#48687); eager raises in "
                   "one_hot; all_to_all skips (no token dispatch)"),
    Release(versions="5.0-5.16", status=VERIFIED, measured_by=SLOW,
            result="5.16.0: router gradient rank-local, NaN in grouped_mm (huggingface/transformers#48205); "
                   "all_to_all skips"),
    Release(versions="4.x", status=REFUSED, result="no expert parallelism (no DistributedConfig)"),
)

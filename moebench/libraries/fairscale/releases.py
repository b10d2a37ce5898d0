"""fairscale's releases as measured here (torch 2.13 CPU, gloo)."""

from moebench.libraries.spec import VERIFIED, Release

COMPATIBILITY = (
    Release(versions="0.4.13", status=VERIFIED, pinned=True, measured_by="tests/libraries/test_fairscale.py",
            result="every row passes (its last release)"),
)

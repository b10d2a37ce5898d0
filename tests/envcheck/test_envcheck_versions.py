"""Version parsing and comparison against faked tool outputs (nvcc, NCCL int / tuple forms, nccl.h)."""

import pytest

from moebench.envcheck import versions
from moebench.envcheck.versions import FASTMOE_MIN_NCCL

NVCC_12_3 = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2023 NVIDIA Corporation
Built on Fri_Nov__3_17:16:49_PDT_2023
Cuda compilation tools, release 12.3, V12.3.103
Build cuda_12.3.r12.3/compiler.33492891_0
"""
NVCC_13_0 = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Aug_20_01:58:59_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.88
Build cuda_13.0.r13.0/compiler.36424714_0
"""
NVCC_10_2 = "Cuda compilation tools, release 10.2, V10.2.89\n"


@pytest.mark.parametrize("text, release, full", [
    (NVCC_12_3, (12, 3), "12.3.103"),
    (NVCC_13_0, (13, 0), "13.0.88"),
    (NVCC_10_2, (10, 2), "10.2.89"),
    ("Cuda compilation tools, release 11.8\n", (11, 8), "11.8"),
])
def test_nvcc_release_is_parsed(text, release, full):
    assert versions.parse_nvcc_release(text) == (release, full)


@pytest.mark.parametrize("text", ["", "command not found", "gcc (Debian 12.2.0) 12.2.0", "release twelve"])
def test_unrecognised_nvcc_output_gives_none(text):
    assert versions.parse_nvcc_release(text) is None


@pytest.mark.parametrize("raw, expected", [
    (21903, (2, 19, 3)),        # NCCL >= 2.9 code: X*10000 + Y*100 + Z
    (22105, (2, 21, 5)),
    (2708, (2, 7, 8)),          # old code (<= 2.8): X*1000 + Y*100 + Z
    (2705, (2, 7, 5)),
    ((2, 19, 3), (2, 19, 3)),   # newer torch returns a tuple
    ([2, 18], (2, 18, 0)),
    ("2.19.3", (2, 19, 3)),
    ("21903", (2, 19, 3)),
    (None, None),
])
def test_nccl_version_forms_are_normalised(raw, expected):
    assert versions.normalize_nccl_version(raw) == expected


def test_nccl_minimum_for_fastmoe_compares_as_tuples():
    assert versions.normalize_nccl_version(2705) >= FASTMOE_MIN_NCCL
    assert versions.normalize_nccl_version(2704) < FASTMOE_MIN_NCCL
    assert versions.normalize_nccl_version(2612) < FASTMOE_MIN_NCCL
    assert versions.normalize_nccl_version(21903) >= FASTMOE_MIN_NCCL
    # 2.10.x must not sort below 2.7.x (string comparison would).
    assert versions.normalize_nccl_version(21003) > versions.normalize_nccl_version(2708)


def test_negative_nccl_code_is_rejected():
    with pytest.raises(ValueError):
        versions.decode_nccl_code(-1)


def test_nccl_header_defines_are_parsed():
    header = (
        '#ifndef NCCL_H_\n#define NCCL_MAJOR 2\n#define NCCL_MINOR 19\n#define NCCL_PATCH 3\n#define NCCL_SUFFIX ""\n'
    )
    assert versions.parse_nccl_header(header) == (2, 19, 3)
    assert versions.parse_nccl_header("#define NCCL_MAJOR 2\n") is None
    assert versions.parse_nccl_header("") is None


@pytest.mark.parametrize("text, expected", [
    ("2.13.0+cpu", (2, 13, 0)), ("2.2.2+cu121", (2, 2, 2)), ("12.1", (12, 1)), ("0.19.8", (0, 19, 8)),
    ("v1.1.0", (1, 1, 0)), ("", None), (None, None), ("unknown", None),
])
def test_parse_version(text, expected):
    assert versions.parse_version(text) == expected

"""Version strings from tools and libraries, parsed into comparable tuples.

Pure functions: tests feed them faked tool outputs.
"""

from __future__ import annotations

import re
from typing import Any

Version = tuple[int, ...]

FASTMOE_MIN_NCCL: Version = (2, 7, 5)
"""fastmoe's distributed experts use NCCL point-to-point send/recv, added in NCCL 2.7 (its README: >= 2.7.5)."""

_NVCC_RELEASE = re.compile(r"release\s+(\d+)\.(\d+)(?:,\s*V(\d+(?:\.\d+)*))?")
_HEADER_DEFINE = re.compile(r"^\s*#\s*define\s+NCCL_(MAJOR|MINOR|PATCH)\s+(\d+)", re.MULTILINE)
_LEADING_NUMBERS = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


def parse_version(text: str | None) -> Version | None:
    """"2.13.0+cpu" -> (2, 13, 0); "12.1" -> (12, 1); None or no leading number -> None."""
    if not text:
        return None
    match = _LEADING_NUMBERS.match(str(text))
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


def fmt(version: Version | None) -> str:
    return ".".join(str(p) for p in version) if version else "?"


def major_minor(version: Version | None) -> Version | None:
    return tuple(version[:2]) if version and len(version) >= 2 else None


def parse_nvcc_release(output: str) -> tuple[Version, str] | None:
    """`nvcc --version` output -> ((major, minor), full version string), or None if unrecognised.

    "Cuda compilation tools, release 12.3, V12.3.107" -> ((12, 3), "12.3.107")
    """
    match = _NVCC_RELEASE.search(output or "")
    if not match:
        return None
    release = (int(match.group(1)), int(match.group(2)))
    return release, match.group(3) or f"{release[0]}.{release[1]}"


def decode_nccl_code(code: int) -> Version:
    """NCCL_VERSION_CODE -> (major, minor, patch).

    NCCL encodes X*1000 + Y*100 + Z up to 2.8 (2708 -> 2.7.8) and X*10000 + Y*100 + Z from 2.9 on
    (21903 -> 2.19.3), so the two forms are told apart by size.
    """
    if code < 0:
        raise ValueError(f"negative NCCL version code {code}")
    if code >= 10000:
        return (code // 10000, (code % 10000) // 100, code % 100)
    return (code // 1000, (code % 1000) // 100, code % 100)


def normalize_nccl_version(value: Any) -> Version | None:
    """What `torch.cuda.nccl.version()` returned (an int in old torch, a tuple in new) -> (major, minor, patch)."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        parts = tuple(int(p) for p in value[:3])
        return parts + (0,) * (3 - len(parts)) if parts else None
    if isinstance(value, int):
        return decode_nccl_code(value)
    text = str(value).strip()
    if text.isdigit():
        return decode_nccl_code(int(text))
    parsed = parse_version(text)
    return (parsed + (0, 0, 0))[:3] if parsed else None


def parse_nccl_header(text: str) -> Version | None:
    """nccl.h -> (major, minor, patch) from its NCCL_MAJOR / NCCL_MINOR / NCCL_PATCH defines."""
    fields = dict(_HEADER_DEFINE.findall(text or ""))
    if not {"MAJOR", "MINOR"} <= fields.keys():
        return None
    return (int(fields["MAJOR"]), int(fields["MINOR"]), int(fields.get("PATCH", 0)))

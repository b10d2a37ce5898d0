"""Communication: which torch.distributed backends exist, NCCL's version, and the nccl.h a build would use."""

from __future__ import annotations

import glob
import os
import sys

import torch
import torch.distributed as dist

from moebench.envcheck import versions
from moebench.envcheck.check import COMM, FAIL, OK, SKIP, WARN, Check


def torch_nccl_version() -> tuple[versions.Version | None, str]:
    """torch's NCCL as (major, minor, patch) and the raw value (int in old torch, tuple in new)."""
    try:
        raw = torch.cuda.nccl.version()
    except Exception as exc:  # noqa: BLE001 - a CPU build has no NCCL bindings at all
        return None, f"unavailable ({type(exc).__name__})"
    return versions.normalize_nccl_version(raw), repr(raw)


def _site_packages() -> list[str]:
    import site

    try:
        return list(site.getsitepackages())
    except AttributeError:  # an old virtualenv's site module
        return []


def nccl_header_candidates(environ=None) -> list[str]:
    """Where a fastmoe build looks for nccl.h: NCCL_HOME / NCCL_INCLUDE_DIR, CUDA_HOME, system, pip's nvidia-nccl."""
    environ = os.environ if environ is None else environ
    dirs = [environ.get("NCCL_INCLUDE_DIR")]
    dirs += [
        os.path.join(environ[v], "include")
        for v in ("NCCL_HOME", "NCCL_ROOT", "CUDA_HOME", "CUDA_PATH")
        if environ.get(v)
    ]
    dirs += ["/usr/local/cuda/include", "/usr/include", "/usr/local/include"]
    dirs += glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "nccl", "include"))
    # A venv made with --system-site-packages (make gpu-check) sees the machine's nvidia-nccl there.
    dirs += [os.path.join(p, "nvidia", "nccl", "include") for p in _site_packages()]
    seen, out = set(), []
    for d in dirs:
        if d and d not in seen:
            seen.add(d)
            out.append(os.path.join(d, "nccl.h"))
    return out


def find_nccl_header(environ=None) -> tuple[str | None, versions.Version | None]:
    for path in nccl_header_candidates(environ):
        if os.path.isfile(path):
            try:
                with open(path, errors="replace") as f:
                    return path, versions.parse_nccl_header(f.read(200_000))
            except OSError:
                continue
    return None, None


def nccl_version_check(version: versions.Version | None, raw: str, cuda_build: bool) -> Check:
    """Pure verdict on torch's NCCL against fastmoe's minimum for distributed experts."""
    base = dict(
        id="comm.nccl_version",
        section=COMM,
        title="NCCL version (torch)",
        required=f">= {versions.fmt(versions.FASTMOE_MIN_NCCL)} for fastmoe's distributed experts (P2P); "
        "the chapter used 2.19.3",
    )
    if version is None:
        return Check(**base, status=FAIL if cuda_build else SKIP,
                     found=f"no NCCL in this torch ({raw})" if cuda_build else "no NCCL (CPU build of torch)",
                     hint="install a CUDA torch wheel (they bundle NCCL)" if cuda_build else "",
                     data={"version": None, "raw": raw})
    new_enough = version >= versions.FASTMOE_MIN_NCCL
    return Check(
        **base,
        status=OK if new_enough else FAIL,
        found=f"{versions.fmt(version)} (torch reports {raw})",
        hint=""
        if new_enough
        else "upgrade torch (its wheel bundles NCCL), or build fastmoe with USE_NCCL=0 (no distributed experts)",
        data={"version": versions.fmt(version), "raw": raw},
    )


def nccl_header_check(path: str | None, header: versions.Version | None, torch_nccl: versions.Version | None,
                      cuda_build: bool) -> Check:
    """Pure verdict: fastmoe compiles against this nccl.h but runs with torch's NCCL; they must agree."""
    base = dict(
        id="comm.nccl_header",
        section=COMM,
        title="nccl.h for building fastmoe",
        required="fastmoe (USE_NCCL=1) compiles against nccl.h; its version must match torch's NCCL (fastmoe README)",
        data={"path": path, "version": versions.fmt(header) if header else None},
    )
    if path is None:
        return Check(
            **base,
            status=WARN if cuda_build else SKIP,
            found="no nccl.h found (NCCL_HOME, CUDA_HOME, /usr/include, pip nvidia-nccl)",
            hint="install the NCCL dev package of torch's NCCL version, or build fastmoe with USE_NCCL=0"
            if cuda_build
            else "",
        )
    if header is None:
        return Check(
            **base,
            status=WARN,
            found=f"{path}: no NCCL_MAJOR/NCCL_MINOR defines",
            hint="point NCCL_HOME at a real NCCL install",
        )
    if torch_nccl is None:
        return Check(**base, status=SKIP if not cuda_build else WARN,
                     found=f"{versions.fmt(header)} at {path}; torch has no NCCL to compare with")
    same = header[:2] == torch_nccl[:2]
    return Check(**base, status=OK if same else WARN,
                 found=f"{versions.fmt(header)} at {path} vs torch's {versions.fmt(torch_nccl)}",
                 hint="" if same else f"install NCCL {versions.fmt(torch_nccl)} headers and set NCCL_HOME to them")


def checks() -> list[Check]:
    out = []
    cuda_build = torch.version.cuda is not None
    gloo = dist.is_available() and dist.is_gloo_available()
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    bad_if = ifname is not None and sys.platform.startswith("linux") and not all(
        os.path.exists(f"/sys/class/net/{name}") for name in ifname.split(","))
    out.append(Check(
        id="comm.gloo", section=COMM, title="gloo backend",
        status=OK if gloo and not bad_if else FAIL,
        found=("available" if gloo else "not built into this torch")
        + (f"; GLOO_SOCKET_IFNAME={ifname} names no network interface" if bad_if else ""),
        required="gloo for every CPU multi-rank run (parity checks, CPU expert parallelism)",
        hint="unset GLOO_SOCKET_IFNAME or set it to an interface from `ip link`" if bad_if
        else "" if gloo else "install an official torch wheel (gloo is built in)",
        data={"available": gloo, "GLOO_SOCKET_IFNAME": ifname},
    ))
    nccl = dist.is_available() and dist.is_nccl_available()
    out.append(Check(
        id="comm.nccl", section=COMM, title="NCCL backend",
        status=OK if nccl else FAIL if cuda_build else SKIP,
        found="available" if nccl else "not built into this torch" + ("" if cuda_build else " (CPU build)"),
        required="NCCL for multi-GPU runs and fastmoe's distributed experts",
        hint="install a CUDA torch wheel (NCCL is bundled)" if cuda_build and not nccl else "",
        data={"available": nccl},
    ))
    mpi = dist.is_available() and dist.is_mpi_available()
    out.append(Check(id="comm.mpi", section=COMM, title="MPI backend", status=OK if mpi else SKIP,
                     found="available" if mpi else "not built into this torch (optional)",
                     required="optional; moebench uses gloo / NCCL", data={"available": mpi}))
    version, raw = torch_nccl_version()
    out.append(nccl_version_check(version, raw, cuda_build))
    path, header = find_nccl_header()
    out.append(nccl_header_check(path, header, version, cuda_build))
    return out

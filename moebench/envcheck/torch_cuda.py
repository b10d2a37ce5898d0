"""PyTorch and CUDA: torch build, GPUs and driver (via nvidia-smi, never by initialising CUDA), nvcc, cuDNN."""

from __future__ import annotations

import ctypes.util
import dataclasses
import os
import re
import shutil
from pathlib import Path

import torch

from moebench.envcheck import versions
from moebench.envcheck.check import FAIL, OK, SKIP, TORCH_CUDA, WARN, Check
from moebench.envcheck.tools import run_tool

MIN_TORCH = (2, 2)
"""pyproject's floor; the chapter used 2.2.2."""

_SMI_FIELDS = "index,name,compute_cap,memory.total,driver_version"
_SMI_CUDA = re.compile(r"CUDA Version:\s*(\d+\.\d+)")
_DRYRUN_HERE = re.compile(r"^#\$ _HERE_=(.+)$", re.MULTILINE)


@dataclasses.dataclass(kw_only=True)
class Smi:
    """What nvidia-smi said (present=False when there is no nvidia-smi)."""

    present: bool
    gpus: list[dict] = dataclasses.field(default_factory=list)
    driver: str | None = None
    driver_cuda: str | None = None
    """Highest CUDA version the driver supports (nvidia-smi's header)."""
    error: str = ""


def query_smi() -> Smi:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return Smi(present=False)
    run = run_tool([exe, f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits"])
    fields = _SMI_FIELDS.split(",")
    if not run.ok:  # drivers older than 510 do not know compute_cap
        fields = [f for f in fields if f != "compute_cap"]
        run = run_tool([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    if not run.ok:
        return Smi(present=True, error=run.error)
    gpus = [dict(zip(fields, (v.strip() for v in line.split(","))))
            for line in run.output.strip().splitlines() if line.strip()]
    header = run_tool([exe])
    match = _SMI_CUDA.search(header.output) if header.ok else None
    return Smi(present=True, gpus=gpus, driver=gpus[0].get("driver_version") if gpus else None,
               driver_cuda=match.group(1) if match else None)


@dataclasses.dataclass(kw_only=True)
class Nvcc:
    """Where nvcc is, what it says, and whether it can build anything for this torch."""

    path: str | None
    found_via: str = ""
    release: str | None = None
    """major.minor, e.g. "12.3"."""
    full_version: str | None = None
    run_error: str = ""
    torch_cuda_home: str | None = None
    """The CUDA_HOME torch.utils.cpp_extension would use (its own search order)."""
    headers_ok: bool = False
    """torch_cuda_home/include/cuda_runtime.h exists (else extension builds fail on missing files)."""
    toolkit_root: str | None = None
    """Where nvcc really lives (nvcc --dryrun's _HERE_/..), when torch_cuda_home is not it."""
    driver_library: str | None = None
    """libcuda (the driver) as found by the dynamic loader's search; None = nothing built can run."""


def _torch_cuda_home(environ) -> str | None:
    # Same order as torch.utils.cpp_extension._find_cuda_home (not imported: it logs and costs time).
    home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(nvcc))
    return "/usr/local/cuda" if os.path.exists("/usr/local/cuda") else None


def find_nvcc(environ=None) -> Nvcc:
    environ = os.environ if environ is None else environ
    home = _torch_cuda_home(environ)
    path, via = None, ""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(var) and os.path.exists(os.path.join(environ[var], "bin", "nvcc")):
            path, via = os.path.join(environ[var], "bin", "nvcc"), var
            break
    if path is None and shutil.which("nvcc"):
        path, via = shutil.which("nvcc"), "PATH"
    if path is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        path, via = "/usr/local/cuda/bin/nvcc", "/usr/local/cuda"
    info = Nvcc(path=path, found_via=via, torch_cuda_home=home,
                headers_ok=bool(home) and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")),
                driver_library=ctypes.util.find_library("cuda"))
    if path is None:
        return info
    run = run_tool([path, "--version"])
    parsed = versions.parse_nvcc_release(run.output) if run.ok else None
    if not run.ok:
        info.run_error = run.error
    elif parsed is None:
        info.run_error = "unrecognised `nvcc --version` output"
    else:
        info.release = versions.fmt(parsed[0])
        info.full_version = parsed[1]
        if not info.headers_ok:
            dry = run_tool([path, "--dryrun", "-c", "moebench_probe.cu", "-o", os.devnull])
            here = _DRYRUN_HERE.search(dry.output)
            if here:
                info.toolkit_root = str(Path(here.group(1).strip()).parent)
    return info


def nvcc_check(nvcc: Nvcc, torch_cuda: str | None, gpu_count: int) -> Check:
    """Pure: turn what was found into a verdict (tests feed faked Nvcc records)."""
    base = dict(
        id="cuda.nvcc",
        section=TORCH_CUDA,
        title="nvcc (CUDA toolkit)",
        required="only to build CUDA extensions (fastmoe, DeepSpeed GPU ops): release == torch.version.cuda major",
        data=dataclasses.asdict(nvcc),
    )
    if nvcc.path is None:
        status = WARN if torch_cuda else SKIP
        return Check(**base, status=status, found="not found (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda)",
                     hint="install the CUDA toolkit matching torch and set CUDA_HOME" if torch_cuda else "")
    where = f"{nvcc.path} (via {nvcc.found_via})"
    if nvcc.run_error:
        return Check(**base, status=WARN if not torch_cuda else FAIL,
                     found=f"{where} exists but does not work: {nvcc.run_error}",
                     hint="reinstall the CUDA toolkit, or remove the broken nvcc from PATH / CUDA_HOME")
    problems = []
    if nvcc.driver_library is None:
        problems.append("no CUDA driver (libcuda) on this machine, so nothing it builds can run")
    if not torch_cuda:
        problems.append("torch is a CPU build, so it cannot build torch CUDA extensions")
    elif versions.parse_version(nvcc.release)[:1] != versions.parse_version(torch_cuda)[:1]:
        problems.append(f"major version differs from torch's CUDA {torch_cuda} (extension builds refuse)")
    if not nvcc.headers_ok:
        real = f"; the toolkit is at {nvcc.toolkit_root}" if nvcc.toolkit_root else ""
        problems.append(f"torch would use CUDA_HOME={nvcc.torch_cuda_home}, which has no include/cuda_runtime.h{real}")
    found = f"release {nvcc.full_version} at {where}"
    if not problems:
        return Check(**base, status=OK, found=found)
    if not torch_cuda and nvcc.driver_library is None:  # a CPU-only machine: nothing here needs nvcc
        return Check(**base, status=SKIP, found=f"{found}; not needed on this CPU-only machine: torch is a CPU "
                                                 "build and there is no CUDA driver (libcuda)",
                     hint=f"only for GPU work: a CUDA driver and a CUDA {nvcc.release} torch wheel")
    hint = []
    if not torch_cuda:
        hint.append(f"for GPU work on this GPU machine install a CUDA {nvcc.release} torch wheel")
    elif nvcc.driver_library is None:
        hint.append("install the NVIDIA driver")
    if nvcc.toolkit_root and not nvcc.headers_ok:
        hint.append(f"export CUDA_HOME={nvcc.toolkit_root}")
    return Check(**base, status=WARN if not torch_cuda or gpu_count == 0 else FAIL,
                 found=f"{found}, but it cannot work here: " + "; ".join(problems), hint="; ".join(hint))


def checks() -> list[Check]:
    out = []
    tv = versions.parse_version(torch.__version__)
    recent = tv is not None and tv[:2] >= MIN_TORCH
    out.append(Check(
        id="torch.version", section=TORCH_CUDA, title="torch",
        status=OK if recent else FAIL, found=f"{torch.__version__} ({os.path.dirname(torch.__file__)})",
        required=">= 2.2 (moebench); the chapter used 2.2.2+cu121",
        hint="" if recent else "reinstall pinned: `make install TORCH_SPEC=torch==2.13.0`",
        data={"version": torch.__version__, "path": os.path.dirname(torch.__file__)},
    ))

    smi = query_smi()
    torch_cuda = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    smi_gpus = len(smi.gpus)
    if torch_cuda or hip:
        build = Check(id="torch.cuda_build", section=TORCH_CUDA, title="torch CUDA build", status=OK,
                      found=f"CUDA {torch_cuda}" if torch_cuda else f"ROCm/HIP {hip}",
                      required="a CUDA build to use GPUs (the chapter: cu121)")
    else:
        build = Check(
            id="torch.cuda_build",
            section=TORCH_CUDA,
            title="torch CUDA build",
            status=WARN if smi_gpus else SKIP,
            found="CPU-only build (torch.version.cuda is None)"
            + (f", but nvidia-smi sees {smi_gpus} GPU(s)" if smi_gpus else ""),
            required="a CUDA build only to use GPUs",
            hint=(
                "install a CUDA wheel: `make install TORCH_SPEC=torch==2.13.0 "
                "TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cu126'`"
            )
            if smi_gpus
            else "",
        )
    build.data = {"torch_cuda": torch_cuda, "hip": hip}
    out.append(build)

    available = bool(torch_cuda) and torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    gpu_text = "; ".join(
        f"{g.get('index', '?')}: {g.get('name', '?')}"
        + (f" sm_{g['compute_cap'].replace('.', '')}" if g.get("compute_cap") else "")
        + (
            f" {int(float(g['memory.total'])) / 1024:.0f} GiB"
            if g.get("memory.total", "").replace(".", "").isdigit()
            else ""
        )
        for g in smi.gpus
    )
    if available:
        devices = Check(
            id="cuda.devices",
            section=TORCH_CUDA,
            title="GPUs",
            status=OK,
            found=f"{count} visible to torch" + (f" ({gpu_text})" if gpu_text else " (names need nvidia-smi)"),
            required="2+ GPUs for NCCL multi-rank runs; 1 for single-GPU runs",
        )
    elif torch_cuda and smi_gpus:
        devices = Check(
            id="cuda.devices",
            section=TORCH_CUDA,
            title="GPUs",
            status=FAIL,
            found=f"nvidia-smi sees {smi_gpus} GPU(s) ({gpu_text}) but torch.cuda.is_available() is False",
            required="torch must see the GPUs it was built for",
            hint="check CUDA_VISIBLE_DEVICES and that the driver supports torch's CUDA (see the driver row)",
        )
    else:
        devices = Check(id="cuda.devices", section=TORCH_CUDA, title="GPUs", status=SKIP,
                        found="no CUDA GPU visible" + (f" (nvidia-smi: {gpu_text})" if gpu_text else ""),
                        required="GPUs only for CUDA runs; CPU runs use gloo")
    devices.data = {"torch_device_count": count, "nvidia_smi_gpus": smi.gpus}
    out.append(devices)

    if not smi.present:
        driver = Check(id="cuda.driver", section=TORCH_CUDA, title="NVIDIA driver", status=SKIP,
                       found="nvidia-smi not found (no NVIDIA driver)", required="only for GPUs")
    elif smi.error:
        driver = Check(
            id="cuda.driver",
            section=TORCH_CUDA,
            title="NVIDIA driver",
            status=WARN if not torch_cuda else FAIL,
            found=f"nvidia-smi failed: {smi.error}",
            required="a working driver for GPU runs",
            hint="reinstall / reload the NVIDIA driver (nvidia-smi must work)",
        )
    else:
        too_old = (torch_cuda and smi.driver_cuda
                   and versions.parse_version(smi.driver_cuda) < versions.parse_version(torch_cuda)[:2])
        driver = Check(
            id="cuda.driver", section=TORCH_CUDA, title="NVIDIA driver", status=FAIL if too_old else OK,
            found=f"{smi.driver}, supports CUDA <= {smi.driver_cuda or '?'}",
            required=f"must support torch's CUDA {torch_cuda}" if torch_cuda else "only for GPUs",
            hint=f"upgrade the driver, or install a torch wheel for CUDA <= {smi.driver_cuda}" if too_old else "")
    driver.data = {"present": smi.present, "driver": smi.driver, "driver_cuda": smi.driver_cuda, "error": smi.error}
    out.append(driver)

    out.append(nvcc_check(find_nvcc(), torch_cuda, count))

    cudnn = torch.backends.cudnn.version() if torch_cuda and torch.backends.cudnn.is_available() else None
    out.append(Check(
        id="cuda.cudnn", section=TORCH_CUDA, title="cuDNN",
        status=OK if cudnn else SKIP,
        found=f"{cudnn}" if cudnn else "not available (CPU build)" if not torch_cuda else "not available",
        required="bundled with CUDA torch wheels; moebench does not depend on it", data={"version": cudnn},
    ))
    return out

"""Platform: Python, OS, CPU, memory, /dev/shm, and the environment variables that steer a run."""

from __future__ import annotations

import os
import platform
import sys

import psutil

from moebench.envcheck.check import FAIL, OK, PLATFORM, SKIP, WARN, Check

GIB = 1024**3
MIN_PYTHON = (3, 10)
"""pyproject's requires-python."""
MIN_SHM_BYTES = 512 * 1024**2
"""DeepSpeed's shm comm op and NCCL's intra-node transport keep buffers in /dev/shm (Docker's default is 64 MB)."""
CHAPTER_MODEL_BYTES = 5 * GIB
"""The chapter's 273 M-parameter model trained with Adam: weights + grads + 2 moments = 16 B/param
= 4.4 GB, plus activations."""

ENV_EXACT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "TORCH_EXTENSIONS_DIR",
             "DS_ACCELERATOR", "USE_NCCL", "OMP_NUM_THREADS", "MOEBENCH_RESULTS")
ENV_PREFIXES = ("NCCL_", "FMOE_", "TORCH_DISTRIBUTED_")


def relevant_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ)
            if k in ENV_EXACT or any(k.startswith(p) for p in ENV_PREFIXES)}


def _cpu_model_and_flags() -> tuple[str, set[str]]:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def checks() -> list[Check]:
    out = []
    py = sys.version_info[:3]
    py_text = ".".join(map(str, py))
    out.append(Check(
        id="platform.python", section=PLATFORM, title="Python",
        status=OK if py[:2] >= MIN_PYTHON else FAIL,
        found=f"{py_text} ({sys.executable})",
        required=f">= {'.'.join(map(str, MIN_PYTHON))} (moebench); the chapter used 3.x with torch 2.2.2",
        hint="" if py[:2] >= MIN_PYTHON else "use Python 3.11: `make all PYTHON=python3.11`",
        data={"version": py_text, "executable": sys.executable},
    ))

    system = platform.system()
    os_text = f"{system} {platform.release()} ({platform.machine()})"
    linux = system == "Linux"
    out.append(Check(
        id="platform.os", section=PLATFORM, title="OS",
        status=OK if linux else WARN, found=os_text,
        required="Linux: local ranks are forked and die with their parent (prctl), NCCL is Linux-only",
        hint="" if linux else "run on Linux (or WSL2) for multi-rank commands",
        data={"system": system, "release": platform.release(), "machine": platform.machine()},
    ))

    model, flags = _cpu_model_and_flags()
    logical = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    out.append(Check(
        id="platform.cpu", section=PLATFORM, title="CPU",
        status=OK, found=f"{model}; {usable} usable core(s)" + (f" of {logical}" if usable != logical else ""),
        required="any; ranks beyond the core count are oversubscribed (slower, still correct)",
        data={"model": model, "cores_logical": logical, "cores_usable": usable},
    ))

    avx2, avx512 = "avx2" in flags, "avx512f" in flags
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - information only
        capability = "unknown"
    simd_known = bool(flags)
    simd = ", ".join(n for n, on in (("AVX2", avx2), ("AVX-512", avx512)) if on) or "neither AVX2 nor AVX-512"
    out.append(
        Check(
            id="platform.simd",
            section=PLATFORM,
            title="AVX2 / AVX-512",
            status=(OK if avx2 else WARN) if simd_known else SKIP,
            found=f"{simd}; torch kernels use {capability}"
            if simd_known
            else f"no CPU flags readable; torch kernels use {capability}",
            required="AVX2 for fast torch CPU kernels and DeepSpeed's CPU ops (cpu_adam); AVX-512 is faster still",
            hint="" if avx2 or not simd_known else "expect slow CPU runs; prefer a machine with AVX2",
            data={"avx2": avx2, "avx512": avx512, "torch_cpu_capability": capability},
        )
    )

    mem = psutil.virtual_memory()
    enough = mem.total >= CHAPTER_MODEL_BYTES
    out.append(
        Check(
            id="platform.memory",
            section=PLATFORM,
            title="Memory",
            status=OK if enough else WARN,
            found=f"{mem.total / GIB:.1f} GiB total, {mem.available / GIB:.1f} GiB available",
            required=f">= {CHAPTER_MODEL_BYTES / GIB:.0f} GiB for the chapter-size model "
            "(273 M params + Adam state = 4.4 GB)",
            hint="" if enough else "use the `quick` presets, or a machine with more memory for `--preset chapter`",
            data={"total_bytes": mem.total, "available_bytes": mem.available},
        )
    )

    try:
        st = os.statvfs("/dev/shm")
        shm = st.f_frsize * st.f_blocks
    except (OSError, AttributeError):
        shm = None
    if shm is None:
        out.append(Check(id="platform.shm", section=PLATFORM, title="/dev/shm", status=SKIP,
                         found="no /dev/shm on this system", required="Linux only"))
    else:
        big = shm >= MIN_SHM_BYTES
        out.append(Check(
            id="platform.shm", section=PLATFORM, title="/dev/shm",
            status=OK if big else WARN, found=f"{shm / 1024**2:.0f} MB",
            required=">= 512 MB: DeepSpeed's shm comm op and NCCL keep buffers there",
            hint="" if big else "in Docker, start the container with --shm-size=1g (or --ipc=host)",
            data={"bytes": shm},
        ))
    out.append(_env_check())
    return out


def _env_check() -> Check:
    env = relevant_env()
    problems = []
    if ("RANK" in env) != ("WORLD_SIZE" in env):
        problems.append("only one of RANK / WORLD_SIZE is set (a torchrun rank needs both)")
    if "MASTER_ADDR" in env and "MASTER_PORT" not in env:
        problems.append("MASTER_ADDR without MASTER_PORT")
    if env.get("CUDA_VISIBLE_DEVICES", None) == "":
        problems.append("CUDA_VISIBLE_DEVICES is empty: every GPU is hidden")
    found = ", ".join(f"{k}={v}" for k, v in env.items()) or "none set"
    return Check(
        id="platform.env",
        section=PLATFORM,
        title="Environment variables",
        status=WARN if problems else OK,
        found=found + ("; " + "; ".join(problems) if problems else ""),
        required="launcher (RANK/WORLD_SIZE/MASTER_*), NCCL_*, GLOO_SOCKET_IFNAME, CUDA_VISIBLE_DEVICES, "
        "FMOE_* steer runs",
        hint="unset stray launcher variables, or set them as a complete set" if problems else "",
        data={"variables": env, "problems": problems},
    )

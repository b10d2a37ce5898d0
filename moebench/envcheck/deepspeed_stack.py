"""DeepSpeed: version, what its import chooses (proving it compiles nothing),
the JIT toolchain, the JIT ops already cached, and the MoE + ZeRO-3 restriction."""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import importlib.util
import io
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from moebench.envcheck import versions
from moebench.envcheck.check import DEEPSPEED, FAIL, OK, SKIP, WARN, Check
from moebench.envcheck.tools import run_tool

MIN_DEEPSPEED = (0, 14)
"""pyproject's floor."""
SHM_OP = "deepspeed_shm_comm"
_ZERO3_MOE_MESSAGE = "MoE is not supported with ZeRO Stage 3"


def installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def extensions_root(environ=None) -> str:
    """Where torch (and so DeepSpeed) caches JIT-built ops: the folder holding one subfolder per op."""
    environ = os.environ if environ is None else environ
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return environ["TORCH_EXTENSIONS_DIR"]
    # Same rule as torch.utils.cpp_extension._get_build_directory.
    try:
        import torch._appdirs as appdirs

        base = os.path.realpath(appdirs.user_cache_dir(appname="torch_extensions"))
    except Exception:  # noqa: BLE001 - private torch module: fall back to its documented default
        base = os.path.expanduser("~/.cache/torch_extensions")
    accel = (f"rocm{torch.version.hip.replace('.', '')}" if getattr(torch.version, "hip", None)
             else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    return os.path.join(
        base, f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accel}"
    )


def cached_ops(root: str) -> list[str]:
    """Ops with a built module under root (<root>/<op>/<op>.so)."""
    path = Path(root)
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if p.is_dir() and (p / f"{p.name}.so").exists())


def installed_info() -> dict:
    """DeepSpeed's build record (git_version_info_installed.py), read as a file: no import."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(list(spec.submodule_search_locations)[0]) / "git_version_info_installed.py"
    info = {}
    try:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                try:
                    info[node.targets[0].id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    except (OSError, SyntaxError):
        return {}
    info["package_dir"] = str(path.parent)
    return info


# --------------------------------------------------------------------------- the import itself


def _snapshot(root: str) -> set[str]:
    path = Path(root)
    return {str(p.relative_to(path)) for p in path.rglob("*")} if path.is_dir() else set()


def import_deepspeed() -> dict:
    """Import DeepSpeed here, timed, with its console output captured; report what it chose and prove it
    built nothing (the JIT cache folder is unchanged). DeepSpeed logs to stdout, which must stay clean
    for --json: output during the import is captured and its logger pointed back at the real stdout."""
    root = extensions_root()
    before = _snapshot(root)
    already = "deepspeed" in sys.modules
    buffer = io.StringIO()
    result: dict = {"already_imported": already}
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            try:
                import deepspeed
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                result["error"] = f"{type(exc).__name__}: {exc}"
                return result
            result["import_s"] = round(time.monotonic() - start, 3)
            result["version"] = deepspeed.__version__
            try:
                from deepspeed.accelerator import get_accelerator

                accelerator = get_accelerator()
                result["accelerator"] = accelerator._name
                result["comm_backend"] = accelerator.communication_backend_name()
            except Exception as exc:  # noqa: BLE001
                result["accelerator_error"] = f"{type(exc).__name__}: {exc}"
            start = time.monotonic()
            try:
                # What DeepSpeed consults before JIT-loading an op (e.g. the CPU shm comm op at
                # init_distributed); probing runs tiny compiler feature tests, never an op build.
                import deepspeed.ops

                result["compatible_ops"] = {k: bool(v) for k, v in deepspeed.ops.__compatible_ops__.items()}
            except Exception as exc:  # noqa: BLE001
                result["compatible_ops_error"] = f"{type(exc).__name__}: {exc}"
            result["compat_probe_s"] = round(time.monotonic() - start, 3)
    finally:
        for handler in logging.getLogger("DeepSpeed").handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is buffer:
                handler.setStream(sys.stdout)
        result["output"] = buffer.getvalue()[-2000:]
        result["built_during_import"] = sorted(_snapshot(root) - before)
    return result


# --------------------------------------------------------------------------- checks


def _toolchain() -> dict:
    ninja = shutil.which("ninja")
    ninja_run = run_tool([ninja, "--version"]) if ninja else None
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    cxx_run = run_tool([cxx, "--version"]) if cxx else None
    return {
        "ninja": ninja,
        "ninja_version": ninja_run.output.strip() if ninja_run and ninja_run.ok else None,
        "cxx": cxx,
        "cxx_version": cxx_run.output.strip().splitlines()[0]
        if cxx_run and cxx_run.ok and cxx_run.output.strip()
        else None,
    }


def import_check(result: dict) -> Check:
    """Pure verdict on what import_deepspeed reported."""
    base = dict(id="deepspeed.import", section=DEEPSPEED, title="import deepspeed",
                required="imports without JIT-compiling any op (a cold CPU op build takes 60-90 s)", data=result)
    if result.get("error"):
        return Check(**base, status=FAIL, found=result["error"],
                     hint="reinstall deepspeed: `.venv/bin/pip install --force-reinstall deepspeed`")
    if result.get("built_during_import"):
        return Check(**base, status=FAIL,
                     found=f"importing built {', '.join(result['built_during_import'][:3])}",
                     hint="set DS_BUILD_OPS=0 / reinstall deepspeed from PyPI; report to moebench")
    acc = result.get("accelerator", "?")
    return Check(**base, status=OK,
                 found=("already imported" if result.get("already_imported") else f"{result.get('import_s', '?')} s")
                 + f", compiled nothing; accelerator {acc}, comm backend {result.get('comm_backend', '?')}")


def checks(import_result: dict | None) -> list[Check]:
    """`import_result` is import_deepspeed()'s dict, or None when DeepSpeed is not imported (summary mode)."""
    out = []
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        version = None
    info = installed_info()
    recent = version is not None and versions.parse_version(version)[:2] >= MIN_DEEPSPEED
    prebuilt = sorted(k for k, v in (info.get("installed_ops") or {}).items() if v)
    out.append(Check(
        id="deepspeed.version", section=DEEPSPEED, title="deepspeed",
        status=OK if recent else FAIL,
        found=(f"{version}; wheel built for accelerator '{info.get('accelerator_name', '?')}', "
               f"prebuilt ops: {', '.join(prebuilt) or 'none (all JIT)'}") if version else "not installed",
        required=">= 0.14 for `moebench run deepspeed` (the chapter: deepspeed from PyPI)",
        hint="" if recent else "`.venv/bin/pip install 'deepspeed>=0.14'` (or `make install`)",
        data={"version": version, "accelerator_name": info.get("accelerator_name"), "prebuilt_ops": prebuilt},
    ))
    if version is None:
        return out

    if import_result is None:
        out.append(Check(id="deepspeed.import", section=DEEPSPEED, title="import deepspeed", status=SKIP,
                         found="not imported in summary mode",
                         required="imports without JIT-compiling any op"))
    else:
        out.append(import_check(import_result))

    tc = _toolchain()
    missing = [n for n in ("ninja", "cxx") if not tc[n]]
    out.append(Check(
        id="deepspeed.toolchain", section=DEEPSPEED, title="JIT toolchain (ninja, C++)",
        status=WARN if missing else OK,
        found=f"ninja {tc['ninja_version'] or 'missing'}; C++ {tc['cxx_version'] or 'missing'}",
        required="ninja and a C++ compiler, to JIT-build DeepSpeed ops (shm comm, cpu_adam) on first use",
        hint="`apt-get install ninja-build g++` (or `pip install ninja`)" if missing else "",
        data=tc,
    ))

    root = extensions_root()
    cached = cached_ops(root)
    accelerator = (import_result or {}).get("accelerator") or info.get("accelerator_name")
    compatible = (import_result or {}).get("compatible_ops") or {}
    note = ""
    if accelerator == "cpu" and SHM_OP not in cached and compatible.get(SHM_OP, True):
        note = f"; {SHM_OP} not cached: the first DeepSpeed init_distributed on CPU JIT-builds it (~60 s, once)"
    out.append(Check(
        id="deepspeed.jit_cache", section=DEEPSPEED, title="JIT ops cached",
        status=OK, found=f"{', '.join(cached) or 'none'} in {root}{note}",
        required="information: cached ops load in well under a second, missing ones are built on first use",
        data={"root": root, "cached": cached, "compatible": compatible},
    ))

    engine = Path(info.get("package_dir", "")) / "runtime" / "engine.py"
    try:
        confirmed = _ZERO3_MOE_MESSAGE in engine.read_text(errors="replace")
    except OSError:
        confirmed = False
    out.append(Check(
        id="deepspeed.moe_zero3", section=DEEPSPEED, title="native MoE with ZeRO stage 3",
        status=OK,
        found="unsupported: the engine refuses it" + (f" ({engine.name} says so in {version})" if confirmed
                                                      else " (message not found in this version; assumed)"),
        required="MoE runs use ZeRO stage 0-2; moebench never asks for stage 3 with MoE",
        data={"confirmed_in_source": confirmed},
    ))
    return out

"""fastmoe: fmoe and its CUDA extension (built with NCCL or not), dm-tree (not a shadowing `tree`),
the FMOE_FASTER_* switches, and whether fastmoe could be built here."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from typing import Callable

from moebench.envcheck import versions
from moebench.envcheck.check import FAIL, FASTMOE, OK, SKIP, WARN, Check

NCCL_FUNCTIONS = ("ensure_nccl", "global_scatter", "global_gather")
"""fmoe_cuda defines these only when built with NCCL (fastmoe's setup.py: USE_NCCL=1, the default)."""
TREE_FUNCTIONS = ("map_structure", "flatten")
"""What fmoe/layers.py calls on `tree`."""
FASTER_SWITCHES = ("FMOE_FASTER_SCHEDULE_ENABLE", "FMOE_FASTER_SHADOW_ENABLE")
"""fastmoe's switch_from_env: only "1" or "ON" turn these on; anything else (even "true") means off."""
FASTER_VALUES = ("FMOE_FASTER_GROUP_SIZE", "FMOE_FASTER_GLBPLC_NETBW", "FMOE_FASTER_GLBPLC_GPUTP",
                 "FMOE_FASTER_GLBPLC_ALPHA", "FMOE_FASTER_GLBPLC_DMODEL", "FMOE_TOPO_GPUS_PER_NODE",
                 "FMOE_TOPO_OUTGOING_FRACTION")


def module_present(name: str) -> bool:
    """True if `import name` would find something (honours modules injected into sys.modules)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import(name: str):
    try:
        return importlib.import_module(name), ""
    except Exception as exc:  # noqa: BLE001 - ImportError, or whatever a broken extension raises
        return None, f"{type(exc).__name__}: {exc}"


def fmoe_check(cuda_usable: bool) -> Check:
    base = dict(
        id="fastmoe.fmoe",
        section=FASTMOE,
        title="fmoe",
        required="the real fastmoe (CUDA only) for `run fastmoe --moe-impl fmoe`; otherwise moebench's "
        "reference port runs",
    )
    if not module_present("fmoe"):
        return Check(
            **base,
            status=WARN if cuda_usable else SKIP,
            found="not installed" + ("" if cuda_usable else " (it needs CUDA; CPU runs use the reference port)"),
            hint="build it: `git clone https://github.com/laekov/fastmoe && cd fastmoe && python setup.py install`"
            if cuda_usable
            else "",
            data={"installed": False},
        )
    module, error = _import("fmoe")
    if module is None:
        return Check(**base, status=FAIL, found=f"installed but `import fmoe` fails: {error}",
                     hint="see the fmoe_cuda and dm-tree rows; rebuild fastmoe against this torch",
                     data={"installed": True, "error": error})
    version = _dist_version("fastmoe") or getattr(module, "__version__", None) or "unknown version"
    return Check(**base, status=OK, found=f"{version} at {os.path.dirname(getattr(module, '__file__', '') or '?')}",
                 data={"installed": True, "version": version})


def fmoe_cuda_check(cuda_usable: bool) -> Check:
    base = dict(id="fastmoe.fmoe_cuda", section=FASTMOE, title="fmoe_cuda (built with NCCL)",
                required=f"fmoe's CUDA extension; {', '.join(NCCL_FUNCTIONS)} exist only when built with NCCL "
                         "(distributed experts)")
    if not module_present("fmoe_cuda"):
        fmoe_there = module_present("fmoe")
        return Check(**base, status=FAIL if fmoe_there else SKIP,
                     found="missing" + (" although fmoe is installed" if fmoe_there else " (fastmoe not installed)"),
                     hint="rebuild fastmoe (`python setup.py install`) with CUDA_HOME set" if fmoe_there else "",
                     data={"present": False})
    module, error = _import("fmoe_cuda")
    if module is None:
        return Check(**base, status=FAIL, found=f"present but fails to load: {error}",
                     hint="rebuild fastmoe against the installed torch (extension ABI mismatch)",
                     data={"present": True, "error": error})
    missing = [f for f in NCCL_FUNCTIONS if not hasattr(module, f)]
    if missing:
        return Check(
            **base,
            status=WARN,
            found=f"built without NCCL (USE_NCCL=0): no {', '.join(missing)}; single-GPU only, no distributed experts",
            hint="rebuild with NCCL >= 2.7.5 headers matching torch's: `USE_NCCL=1 python setup.py install`",
            data={"present": True, "missing": missing},
        )
    return Check(**base, status=OK, found=f"built with NCCL ({', '.join(NCCL_FUNCTIONS)} present)",
                 data={"present": True, "missing": []})


def tree_check() -> Check:
    base = dict(id="fastmoe.tree", section=FASTMOE, title="dm-tree (`tree`)",
                required=f"dm-tree: fmoe calls tree.{', tree.'.join(TREE_FUNCTIONS)} (the chapter's pitfall 3)")
    dm_version = _dist_version("dm-tree")
    if not module_present("tree"):
        return Check(**base, status=FAIL, found="no `tree` module", hint="`.venv/bin/pip install dm-tree`",
                     data={"dm_tree_version": dm_version})
    module, error = _import("tree")
    if module is None:
        return Check(**base, status=FAIL, found=f"`import tree` fails: {error}",
                     hint="`.venv/bin/pip install --force-reinstall dm-tree`", data={"error": error})
    origin = getattr(module, "__file__", None) or "?"
    missing = [f for f in TREE_FUNCTIONS if not callable(getattr(module, f, None))]
    from_dm_tree = False
    if dm_version:
        try:
            pkg_dir = os.path.realpath(str(importlib.metadata.distribution("dm-tree").locate_file("tree")))
            from_dm_tree = os.path.realpath(origin).startswith(pkg_dir + os.sep)
        except Exception:  # noqa: BLE001 - provenance is best effort
            from_dm_tree = False
    data = {"origin": origin, "dm_tree_version": dm_version, "missing": missing, "from_dm_tree": from_dm_tree}
    if missing:
        return Check(
            **base,
            status=FAIL,
            data=data,
            found=f"`tree` at {origin} is not dm-tree (no {', '.join(missing)}): another package or file shadows it",
            hint="`pip uninstall tree` (a different PyPI package) and `pip install dm-tree`, or rename your tree.py",
        )
    if not from_dm_tree:
        return Check(
            **base,
            status=WARN,
            data=data,
            found=f"`tree` at {origin} has the functions but is not dm-tree's"
            + ("" if dm_version else " (dm-tree not installed)"),
            hint="`pip install dm-tree` and remove the other `tree` from sys.path",
        )
    return Check(**base, status=OK, data=data, found=f"dm-tree {dm_version} ({os.path.dirname(origin)})")


def env_check(environ=None) -> Check:
    environ = os.environ if environ is None else environ
    on = [k for k in FASTER_SWITCHES if environ.get(k) in ("1", "ON")]
    ignored = [f"{k}={environ[k]}" for k in FASTER_SWITCHES if k in environ and environ[k] not in ("1", "ON")]
    values = [f"{k}={environ[k]}" for k in FASTER_VALUES if k in environ]
    parts = []
    if on:
        parts.append(
            f"{', '.join(on)} on: fmoe takes the FasterMoE path (smart schedule / shadowing), not the chapter's"
        )
    if ignored:
        parts.append(f"{', '.join(ignored)} ignored by fastmoe (only 1 or ON enable it)")
    if values:
        parts.append(", ".join(values))
    return Check(
        id="fastmoe.env",
        section=FASTMOE,
        title="FMOE_FASTER_* variables",
        status=WARN if on or ignored else OK,
        found="; ".join(parts) or "none set: fastmoe's default code path (as in the chapter)",
        required="unset for the chapter's code path; FMOE_FASTER_SCHEDULE_ENABLE / _SHADOW_ENABLE switch to FasterMoE",
        hint="unset them to reproduce the chapter"
        if on
        else "set them to 1 or ON if you meant to enable them"
        if ignored
        else "",
        data={"enabled": on, "ignored": ignored, "values": values},
    )


def build_check(*, torch_cuda: str | None, nvcc_release: str | None, nvcc_error: str, headers_ok: bool,
                cuda_home: str | None, toolkit_root: str | None, cxx: str | None,
                nccl_header: str | None, torch_nccl: str | None, use_nccl: bool, gpus: bool = True) -> Check:
    """Could `python setup.py install` of fastmoe succeed here, and with distributed experts? Where no GPU is
    present (`gpus` False: a CUDA build of torch on a laptop, a login node, CI), a build that cannot succeed is a
    warning, not a failure: fmoe could not run here either, and `run fastmoe` takes the reference port."""
    check = _build_verdict(torch_cuda=torch_cuda, nvcc_release=nvcc_release, nvcc_error=nvcc_error,
                           headers_ok=headers_ok, cuda_home=cuda_home, toolkit_root=toolkit_root, cxx=cxx,
                           nccl_header=nccl_header, torch_nccl=torch_nccl, use_nccl=use_nccl)
    if check.status == FAIL and not gpus:
        check.status = WARN
        check.found += (" (no GPU here: fmoe could not run on this machine either; `run fastmoe` uses the "
                        "reference port)")
        check.hint += "; only where you will run fmoe on a GPU"
    check.data["gpus"] = gpus
    return check


def _build_verdict(*, torch_cuda: str | None, nvcc_release: str | None, nvcc_error: str, headers_ok: bool,
                   cuda_home: str | None, toolkit_root: str | None, cxx: str | None,
                   nccl_header: str | None, torch_nccl: str | None, use_nccl: bool) -> Check:
    base = dict(id="fastmoe.build", section=FASTMOE, title="can build fastmoe",
                required="a CUDA torch, nvcc of the same CUDA major (torch refuses others, warns on minor), "
                         "a C++ compiler; with USE_NCCL=1 also nccl.h and NCCL >= 2.7.5",
                data={"torch_cuda": torch_cuda, "nvcc": nvcc_release, "use_nccl": use_nccl})
    if not torch_cuda:
        return Check(**base, status=SKIP, found="no: torch is a CPU build, fastmoe's extension is CUDA-only "
                                                "(`run fastmoe` uses moebench's reference port)")
    if not nvcc_release:
        return Check(**base, status=FAIL, found=f"no: no working nvcc ({nvcc_error or 'not found'})",
                     hint=f"install the CUDA {torch_cuda} toolkit and set CUDA_HOME")
    nv, tc = versions.parse_version(nvcc_release), versions.parse_version(torch_cuda)
    if nv[:1] != tc[:1]:
        return Check(
            **base,
            status=FAIL,
            found=f"no: nvcc {nvcc_release} vs torch's CUDA {torch_cuda} (major differs)",
            hint=f"install CUDA {versions.fmt(tc[:2])} and set CUDA_HOME, "
            f"or a torch wheel built for CUDA {nvcc_release}",
        )
    if not headers_ok:
        return Check(
            **base,
            status=FAIL,
            found=f"no: CUDA_HOME={cuda_home} has no include/cuda_runtime.h (build fails on missing files)",
            hint=f"export CUDA_HOME={toolkit_root or '/usr/local/cuda-' + nvcc_release}",
        )
    if not cxx:
        return Check(**base, status=FAIL, found="no: no C++ compiler", hint="`apt-get install g++`")
    if use_nccl:
        if not torch_nccl or versions.parse_version(torch_nccl) < versions.FASTMOE_MIN_NCCL:
            return Check(
                **base,
                status=FAIL,
                found=f"no: torch's NCCL {torch_nccl or 'missing'} < 2.7.5 (distributed experts need P2P)",
                hint="upgrade torch, or build with USE_NCCL=0 (no distributed experts)",
            )
        if not nccl_header:
            return Check(**base, status=FAIL, found="no: USE_NCCL=1 (default) but no nccl.h",
                         hint=f"install NCCL {torch_nccl} headers (NCCL_HOME), or build with USE_NCCL=0")
    minor = nv[:2] != tc[:2]
    return Check(
        **base,
        status=WARN if minor else OK,
        found=f"yes: nvcc {nvcc_release}, torch CUDA {torch_cuda}"
        + (" (minor differs: torch warns, builds)" if minor else "")
        + (f", NCCL {torch_nccl}" if use_nccl else ", USE_NCCL=0: no distributed experts"),
        hint="match nvcc's minor version to torch's CUDA to silence the warning" if minor else "",
    )


def checks(lookup: Callable[[str], Check | None]) -> list[Check]:
    """`lookup(id)` returns an earlier check (the CUDA, NCCL and toolchain facts this section builds on)."""
    def data(check_id: str) -> dict:
        found = lookup(check_id)
        return found.data if found else {}

    torch_cuda = data("torch.cuda_build").get("torch_cuda")
    cuda_usable = bool(data("cuda.devices").get("torch_device_count"))
    nvcc = data("cuda.nvcc")
    cxx = data("deepspeed.toolchain").get("cxx")
    if not data("deepspeed.toolchain"):
        import shutil

        cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    out = [fmoe_check(cuda_usable), fmoe_cuda_check(cuda_usable), tree_check(), env_check()]
    out.append(build_check(
        torch_cuda=torch_cuda, nvcc_release=nvcc.get("release"), nvcc_error=nvcc.get("run_error", ""),
        headers_ok=bool(nvcc.get("headers_ok")), cuda_home=nvcc.get("torch_cuda_home"),
        toolkit_root=nvcc.get("toolkit_root"), cxx=cxx, nccl_header=data("comm.nccl_header").get("path"),
        torch_nccl=data("comm.nccl_version").get("version"), use_nccl=os.environ.get("USE_NCCL", "1") == "1",
        gpus=cuda_usable or bool(data("cuda.devices").get("nvidia_smi_gpus")),
    ))
    return out

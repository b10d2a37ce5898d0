"""gpu-check's first step: the chapter's fastmoe pitfalls, then fastmoe built from a source tree.

    python -m moebench.gpucheck.build --out DIR [--src FASTMOE_SRC] [--deadline-s S]

Prints one JSON document; exit 0 built (or reused, or already installed), 1 the build failed,
2 a pitfall applies (its line is env-check's own verdict and one-line fix) or there is no source.

Before anything is compiled, env-check's probes (moebench.envcheck) decide:
- the CUDA toolkit (nvcc, found the way torch's extension builder finds it) against
  `torch.version.cuda`: another major, or a CUDA_HOME without include/cuda_runtime.h, stops here
  (the chapter's pitfall 2: "missing files");
- USE_NCCL: the user's value if set, else 1 when torch's NCCL is >= 2.7.5 (P2P, pitfall 1) and an
  nccl.h is found, else 0, said why;
- dm-tree importable as `tree` (pitfall 3).
The source tree is copied into DIR/src (a build writes build/ and *.egg-info into the tree it builds)
and installed with `pip install --no-build-isolation --no-deps --no-index --target DIR/site`: nothing
is downloaded, nothing lands in any site-packages, and later steps put DIR/site on PYTHONPATH. A
build whose inputs (the tree, torch, nvcc, USE_NCCL, the GPU arch) match DIR's stamp is reused.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

STAMP = "moebench-build.json"
LOG = "build.log"
SOURCE_MARKERS = ("setup.py", "cuda/fmoe_cuda.cpp", "fmoe/__init__.py")
"""Files every fastmoe source tree has (github.com/laekov/fastmoe)."""
MIN_RETRY_S = 60.0
"""A retry without NCCL is only started with at least this long left (one nvcc build of fastmoe for
one GPU arch with ninja and 16 jobs: about a minute, estimated; not yet measured)."""
IMPORT_TIMEOUT_S = 60.0
EXIT_REFUSED = 2


@dataclasses.dataclass(kw_only=True)
class Facts:
    """What the build depends on, from env-check's probes (tests build these by hand)."""

    torch_version: str
    torch_cuda: str | None
    nvcc: dict
    """moebench.envcheck.torch_cuda.Nvcc as a dict (path, release, headers_ok, torch_cuda_home, ...)."""
    torch_nccl: str | None
    nccl_header: str | None
    cxx: str | None
    tree: dict
    """env-check's fastmoe.tree check as a dict (status, found, hint)."""
    gpu_count: int = 0
    arch: str | None = None
    """"9.0" for the first GPU (TORCH_CUDA_ARCH_LIST), None without one."""


def source_problem(src: str) -> str:
    """Why `src` is not a fastmoe source tree ("" when it is)."""
    missing = [m for m in SOURCE_MARKERS if not (Path(src) / m).is_file()]
    if missing:
        return (f"{src} is not a fastmoe source tree (no {', '.join(missing)}); pass a clone of "
                "github.com/laekov/fastmoe")
    return ""


def gather(environ=None) -> Facts:
    """Run env-check's probes for everything the build depends on (imports torch)."""
    import torch

    from moebench.envcheck import comm, fastmoe_stack, versions
    from moebench.envcheck.torch_cuda import find_nvcc

    environ = os.environ if environ is None else environ
    nccl_version, _ = comm.torch_nccl_version()
    header, _ = comm.find_nccl_header(environ)
    count = torch.cuda.device_count() if torch.version.cuda and torch.cuda.is_available() else 0
    arch = ".".join(map(str, torch.cuda.get_device_capability(0))) if count else None
    return Facts(torch_version=torch.__version__, torch_cuda=torch.version.cuda,
                 nvcc=dataclasses.asdict(find_nvcc(environ)), torch_nccl=versions.fmt(nccl_version) if nccl_version
                 else None, nccl_header=header, cxx=environ.get("CXX") or shutil.which("c++") or shutil.which("g++"),
                 tree=fastmoe_stack.tree_check().to_dict(), gpu_count=count, arch=arch)


def choose_use_nccl(facts: Facts, environ) -> tuple[bool, str]:
    """USE_NCCL for the build, and why."""
    from moebench.envcheck import versions

    if "USE_NCCL" in environ:
        return environ["USE_NCCL"] == "1", f"USE_NCCL={environ['USE_NCCL']} set by the user"
    nccl = versions.parse_version(facts.torch_nccl) if facts.torch_nccl else None
    if nccl is None or nccl < versions.FASTMOE_MIN_NCCL:
        return False, f"torch's NCCL {facts.torch_nccl or 'missing'} < 2.7.5: no distributed experts (USE_NCCL=0)"
    if not facts.nccl_header:
        return False, f"no nccl.h for torch's NCCL {facts.torch_nccl}: no distributed experts (USE_NCCL=0)"
    return True, f"torch's NCCL {facts.torch_nccl} >= 2.7.5 and {facts.nccl_header}: distributed experts on"


def pitfall(facts: Facts, use_nccl: bool) -> dict | None:
    """env-check's verdict (a Check as a dict) when a chapter pitfall stops the build, else None."""
    from moebench.envcheck import fastmoe_stack
    from moebench.envcheck.check import FAIL

    if facts.tree.get("status") == FAIL:
        return facts.tree
    nvcc = facts.nvcc
    check = fastmoe_stack.build_check(
        torch_cuda=facts.torch_cuda, nvcc_release=nvcc.get("release"), nvcc_error=nvcc.get("run_error", ""),
        headers_ok=bool(nvcc.get("headers_ok")), cuda_home=nvcc.get("torch_cuda_home"),
        toolkit_root=nvcc.get("toolkit_root"), cxx=facts.cxx, nccl_header=facts.nccl_header,
        torch_nccl=facts.torch_nccl, use_nccl=use_nccl)
    return check.to_dict() if check.status in (FAIL, "skip") else None


def nccl_paths(header: str | None, link_dir: Path) -> tuple[list[str], list[str]]:
    """(include dirs, library dirs) that let `-lnccl` find the NCCL of `header`. pip's nvidia-nccl
    ships only libnccl.so.2, which the linker does not take for -lnccl: a libnccl.so link to it is
    made in `link_dir`."""
    if not header:
        return [], []
    include = os.path.dirname(header)
    lib = os.path.join(os.path.dirname(include), "lib")
    libs = [lib] if os.path.isdir(lib) else []
    versioned = sorted(glob.glob(os.path.join(lib, "libnccl.so.*")))
    if versioned and not os.path.exists(os.path.join(lib, "libnccl.so")):
        link_dir.mkdir(parents=True, exist_ok=True)
        link = link_dir / "libnccl.so"
        if not link.exists():
            link.symlink_to(versioned[0])
        libs.insert(0, str(link_dir))
    return [include], libs


def build_env(facts: Facts, use_nccl: bool, out: Path, environ) -> dict[str, str]:
    """The environment fastmoe's setup.py is run in."""
    env = dict(environ)
    env["USE_NCCL"] = "1" if use_nccl else "0"
    home = facts.nvcc.get("torch_cuda_home")
    if home and "CUDA_HOME" not in env:
        env["CUDA_HOME"] = home
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    if facts.arch:
        env.setdefault("TORCH_CUDA_ARCH_LIST", facts.arch)  # one arch: a third of the compile time
    if use_nccl:
        includes, libs = nccl_paths(facts.nccl_header, out / "nccl-link")
        for var, dirs in (("CPATH", includes), ("LIBRARY_PATH", libs)):
            if dirs:
                env[var] = os.pathsep.join([*dirs, *([env[var]] if env.get(var) else [])])
    return env


def tree_digest(src: str) -> str:
    """A hash of the source tree's files (path, size, mtime), .git and build outputs left out."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in (".git", "build", "__pycache__") and not d.endswith(".egg-info"))
        for name in sorted(files):
            st = os.stat(os.path.join(root, name))
            h.update(f"{os.path.relpath(os.path.join(root, name), src)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def build_key(src: str, facts: Facts, use_nccl: bool) -> str:
    parts = [tree_digest(src), facts.torch_version, facts.torch_cuda, facts.nvcc.get("full_version"), use_nccl,
             facts.arch]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def pip_command(python: str, src: Path, site: Path) -> list[str]:
    return [python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
            "--disable-pip-version-check", "--target", str(site), str(src)]


_COMPILER_ERROR = re.compile(r":\d+(:\d+)?: (fatal )?error\b|^nvcc fatal|^fatal error|undefined reference"
                             r"|cannot find -l")
_PIP_FRAMING = ("subprocess-exited-with-error", "metadata-generation-failed", "Failed building", "legacy-install",
                "× ", "╰─>", "note: ")
"""pip's own lines around a failed build: they say that it failed, never why."""


def first_error(log_text: str) -> str:
    """The line of a build log most likely to say why it failed: the first compiler or linker error,
    else the first other line with "error" that is not pip's framing, else the last line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    hit = next((line for line in lines if _COMPILER_ERROR.search(line)), None)
    hit = hit or next((line for line in lines if "error" in line.lower()
                       and not any(p in line for p in _PIP_FRAMING)), None)
    return (hit or (lines[-1] if lines else "no output"))[:300]


def compile_once(src: str, out: Path, env: dict, timeout_s: float, python: str) -> tuple[bool, str]:
    """Copy the tree to out/src and pip-install it into out/site; (ok, error line)."""
    for sub in ("src", "site"):
        shutil.rmtree(out / sub, ignore_errors=True)
    shutil.copytree(src, out / "src", ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__"))
    with open(out / LOG, "a", encoding="utf-8") as log:
        log.write(f"\n== USE_NCCL={env['USE_NCCL']} CUDA_HOME={env.get('CUDA_HOME')} "
                  f"TORCH_CUDA_ARCH_LIST={env.get('TORCH_CUDA_ARCH_LIST')}\n")
        log.flush()
        try:
            done = subprocess.run(pip_command(python, out / "src", out / "site"), stdout=log, stderr=subprocess.STDOUT,
                                  env=env, timeout=max(timeout_s, 1.0), stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False, f"the build did not finish within {timeout_s:.0f} s"
    if done.returncode != 0:
        return False, first_error((out / LOG).read_text(encoding="utf-8", errors="replace").split("\n== ")[-1])
    return True, ""


def check_import(python: str, site: Path | None) -> dict:
    """Import fmoe and fmoe_cuda in a child (with `site` first on the path): its version and NCCL functions."""
    from moebench.envcheck.fastmoe_stack import NCCL_FUNCTIONS

    code = ("import json, fmoe, fmoe_cuda; print(json.dumps({'fmoe': fmoe.__file__, 'nccl_functions': "
            f"[f for f in {list(NCCL_FUNCTIONS)!r} if hasattr(fmoe_cuda, f)]}}))")
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=IMPORT_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"import did not finish within {IMPORT_TIMEOUT_S:.0f} s"}
    if done.returncode != 0:
        return {"ok": False, "error": first_error(done.stderr)}
    return {"ok": True, **json.loads(done.stdout.strip().splitlines()[-1])}


def run(src: str | None, out: Path, *, deadline_s: float, environ=None, python: str = sys.executable,
        facts: Facts | None = None) -> tuple[int, dict]:
    """The whole step: (exit code, the JSON document)."""
    start = time.monotonic()
    environ = dict(os.environ if environ is None else environ)
    facts = facts or gather(environ)
    use_nccl, why = choose_use_nccl(facts, environ)
    doc: dict = {"use_nccl": use_nccl, "use_nccl_reason": why, "facts": dataclasses.asdict(facts), "attempts": [],
                 "site": None, "reused": False, "pitfall": None}
    if not src:  # nothing to build: an installed fmoe, or nothing
        installed = check_import(python, None)
        if installed["ok"]:
            return 0, {**doc, "status": "pass", "reason": f"no FASTMOE_SRC: the installed fmoe ({installed['fmoe']})",
                       "import": installed}
        return EXIT_REFUSED, {**doc, "status": "refused", "import": installed,
                              "reason": "no fastmoe: pass FASTMOE_SRC= (--fastmoe-src) a clone of "
                                        "github.com/laekov/fastmoe"}
    found = pitfall(facts, use_nccl)
    if found is not None:
        line = f"{found['id']}: {found['found']}" + (f"; fix: {found['hint']}" if found.get("hint") else "")
        return EXIT_REFUSED, {**doc, "status": "refused", "pitfall": found, "reason": line}
    out.mkdir(parents=True, exist_ok=True)
    key = build_key(src, facts, use_nccl)
    stamp = out / STAMP
    if stamp.exists():
        old = json.loads(stamp.read_text(encoding="utf-8"))
        if old.get("key") == key and old.get("ok") and glob.glob(str(out / "site" / "fmoe_cuda*")):
            imported = check_import(python, out / "site")
            if imported["ok"]:
                return 0, {**doc, **old.get("doc", {}), "status": "pass", "reused": True, "import": imported,
                           "site": str(out / "site"), "reason": f"reused the build in {out} (same inputs)"}
    stamp.unlink(missing_ok=True)
    tries = [use_nccl] + ([False] if use_nccl and facts.gpu_count == 1 else [])
    for attempt, nccl in enumerate(tries):
        left = deadline_s - (time.monotonic() - start)
        if attempt and left < MIN_RETRY_S:
            break
        t0 = time.monotonic()
        ok, error = compile_once(src, out, build_env(facts, nccl, out, environ), left, python)
        imported = check_import(python, out / "site") if ok else None
        if imported is not None and not imported["ok"]:  # e.g. an undefined NCCL symbol: as a failed build
            ok, error = False, f"built, but it does not import: {imported['error']}"
        doc["attempts"].append({"use_nccl": nccl, "ok": ok, "elapsed_s": round(time.monotonic() - t0, 1),
                                "error": error})
        if ok:
            doc.update({"use_nccl": nccl, "site": str(out / "site"), "import": imported, "status": "pass",
                        "reason": "built" + (" without NCCL after the NCCL build failed" if attempt else "")})
            stamp.write_text(json.dumps({"key": key, "ok": True, "doc": {"use_nccl": nccl}}), encoding="utf-8")
            return 0, doc
    first = doc["attempts"][0]["error"]
    return 1, {**doc, "status": "fail", "reason": f"the build failed: {first} (log: {out / LOG})"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moebench.gpucheck.build")
    parser.add_argument("--src", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline-s", type=float, default=150.0)
    args = parser.parse_args(argv)
    code, doc = run(args.src or None, Path(args.out), deadline_s=args.deadline_s)
    print(json.dumps(doc, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Install moebench beside a machine's own torch, offline from a wheel folder when there is no network.

    python -m moebench.gpucheck.install --python PY [--venv DIR] [--wheels DIR] [--constraints FILE]

- `--venv DIR` (the Makefile's GPU_VENV, default .venv-gpu): a virtual environment made from PY with
  `--system-site-packages` and a .pth file naming PY's site-packages (PY is often a venv itself,
  whose packages --system-site-packages alone would not show), so the machine's torch (often a cu13
  build of another version than the CPU pin) is seen and used, and whatever moebench adds lands in
  DIR, never in the system's site-packages. `--venv ''` installs into PY's own environment (the
  user's choice).
- torch is never installed: a generated constraints file pins `torch==<the version PY has>`, so no
  dependency can pull another build.
- `--constraints FILE` (moebench/constraints.txt by default): its pins apply only to packages PY
  does not have yet; the machine's own packages are kept (env-check reports the drift).
- `--wheels DIR`: `pip install --no-index --find-links DIR --no-build-isolation`: nothing is
  fetched; a package missing from DIR fails the install naming it.

Standard library only: it runs before moebench's dependencies exist.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PIN_FILE = "moebench-gpu-constraints.txt"
"""The generated constraints file (torch pinned, the other pins of what is missing), in the venv."""
NEVER_INSTALLED = ("torch",)
"""Pinned to what the interpreter has; a wheel folder need not (and should not) hold them."""
PIP_TIMEOUT_S = 900.0
"""An offline install takes seconds; one that reaches for the network without it waits on timeouts."""
PROBE_TIMEOUT_S = 120.0
"""Listing the installed distributions (and importing nothing else) takes about a second."""

_LIST_INSTALLED = ("import importlib.metadata as m, json; "
                   "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions() "
                   "if d.metadata['Name']}))")


class InstallError(Exception):
    """One line for the user; exit 2 for bad input, 1 when pip failed."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def normalize(name: str) -> str:
    """PEP 503 name: `Dm_Tree` -> `dm-tree`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(python: str) -> dict[str, str]:
    """{normalized name: version} of every distribution `python` sees."""
    try:
        done = subprocess.run([python, "-c", _LIST_INSTALLED], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InstallError(f"PYTHON={python} does not run: {exc}") from None
    if done.returncode != 0:
        raise InstallError(f"PYTHON={python} could not list its packages: {done.stderr.strip()[-200:]}")
    return {normalize(k): v for k, v in json.loads(done.stdout).items()}


def constraint_lines(path: str | None) -> list[str]:
    """`name==version` lines of a constraints file (comments and blanks dropped)."""
    if not path:
        return []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InstallError(f"CONSTRAINTS={path} cannot be read ({exc.strerror or exc})") from None
    return [line.split("#", 1)[0].strip() for line in text.splitlines() if line.split("#", 1)[0].strip()]


def _name(requirement: str) -> str:
    return normalize(re.split(r"[<>=!~;\[ @]", requirement, maxsplit=1)[0])


def gpu_constraints(have: dict[str, str], lines: list[str]) -> list[str]:
    """torch pinned to what is installed; each other pin only for a package not installed yet."""
    if "torch" not in have:
        raise InstallError("the interpreter has no torch; pass PYTHON= the one whose torch is a CUDA build")
    keep = [line for line in lines if _name(line) not in have and _name(line) not in NEVER_INSTALLED]
    return [f"torch=={have['torch']}", *keep]


def check_wheels(wheels: str) -> None:
    """WHEELS must be a folder holding wheels."""
    folder = Path(wheels)
    if not folder.is_dir():
        raise InstallError(f"WHEELS={wheels} is not a folder; prepare one with scripts/gpu-wheels.sh (README)")
    if not any(folder.glob("*.whl")):
        raise InstallError(f"WHEELS={wheels} holds no .whl file; prepare it with scripts/gpu-wheels.sh (README)")
    torches = sorted(p.name for p in folder.glob("torch-*.whl"))
    if torches:
        raise InstallError(f"WHEELS={wheels} holds {torches[0]}: torch comes from the machine, remove it")


def venv_python(venv: str) -> str:
    return str(Path(venv) / "bin" / "python")


def pip_install(python: str, *, wheels: str | None, pins: str, requirement: str = "-e", project: str = ".",
                extras: str = "") -> list[str]:
    """The pip command line that installs `project` (editable, with `extras`) under `pins`."""
    cmd = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if wheels:
        cmd += ["--no-index", "--find-links", str(wheels), "--no-build-isolation"]
    cmd += ["-c", pins]
    target = f"{project}[{extras}]" if extras else project
    cmd += (["-e", target] if requirement == "-e" else [target])
    return cmd


def commands(*, python: str, venv: str, wheels: str | None, pins: str, extras: str = "",
             project: str = ".", editable: bool = True, have: dict[str, str] | None = None) -> list[list[str]]:
    """Every command, in order: the venv (only when it does not exist yet), the build tools when PYTHON
    has none (from WHEELS), then the one pip install.

    The venv is made `--without-pip` when PYTHON has pip: the venv then runs PYTHON's pip, setuptools
    and wheel through the .pth link (ensurepip would put an old setuptools, without bdist_wheel,
    in front of them)."""
    have = {"pip": "?", "setuptools": "?"} if have is None else have
    out = []
    target_python = python
    if venv:
        target_python = venv_python(venv)
        if not Path(target_python).exists():
            out.append([python, "-m", "venv", "--system-site-packages", *(["--without-pip"] if "pip" in have else []),
                        venv])
    if "setuptools" not in have:  # --no-build-isolation builds moebench with the environment's setuptools
        out.append(pip_install(target_python, wheels=wheels, pins=pins, project="setuptools>=61", requirement="plain")
                   + ["wheel"])
    out.append(pip_install(target_python, wheels=wheels, pins=pins, project=project, extras=extras,
                           requirement="-e" if editable else "plain"))
    return out


BASE_PTH = "moebench-base-site.pth"
"""Written into a venv made by gpu-check: PYTHON's own site-packages, so the venv sees its torch even
when PYTHON is itself a venv (then --system-site-packages alone would see the base interpreter's)."""

_SITE_PACKAGES = "import json, site; print(json.dumps(site.getsitepackages()))"
_PURELIB = "import sysconfig; print(sysconfig.get_paths()['purelib'])"


def _ask(python: str, code: str) -> str:
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InstallError(f"{python} does not run: {exc}") from None
    if done.returncode != 0:
        raise InstallError(f"{python} failed: {done.stderr.strip()[-200:]}")
    return done.stdout.strip()


def link_base(python: str, venv: str) -> Path:
    """Make the venv see PYTHON's site-packages (its torch): a .pth file in the venv's own."""
    paths = json.loads(_ask(python, _SITE_PACKAGES))
    pth = Path(_ask(venv_python(venv), _PURELIB)) / BASE_PTH
    pth.write_text("".join(f"{p}\n" for p in paths), encoding="utf-8")
    return pth


def check_venv(venv: str) -> None:
    """An existing GPU_VENV must be a venv (the torch it sees is checked once it is linked)."""
    folder = Path(venv)
    if (folder / "bin" / "python").exists():
        return
    if folder.exists() and any(folder.iterdir()):
        raise InstallError(f"GPU_VENV={venv} exists and is not a virtual environment; pass another folder")


def install(*, python: str, venv: str = "", wheels: str | None = None, constraints: str | None = None,
            extras: str = "", project: str = ".", editable: bool = True, dry_run: bool = False,
            echo=print) -> list[list[str]]:
    """Run (or with dry_run only return) the install commands; InstallError on failure."""
    if wheels:
        check_wheels(wheels)
    if venv:
        check_venv(venv)
    have = installed(python)
    pins = gpu_constraints(have, constraint_lines(constraints))
    tmp = None
    if venv and not dry_run:
        pin_path = Path(venv) / PIN_FILE
    else:
        tmp = tempfile.TemporaryDirectory(prefix="moebench-gpu-install-")
        pin_path = Path(tmp.name) / PIN_FILE
    try:
        cmds = commands(python=python, venv=venv, wheels=wheels, pins=str(pin_path), extras=extras,
                        project=project, editable=editable, have=have)
        if dry_run:
            return cmds
        prepared = False
        for cmd in cmds:
            echo(" ".join(cmd))
            if cmd[1:3] == ["-m", "pip"] and not prepared:  # the venv exists by now: link PYTHON's, pin torch
                prepared = True
                if venv:
                    link_base(python, venv)
                    seen = installed(venv_python(venv)).get("torch")
                    if seen != have["torch"]:
                        raise InstallError(f"GPU_VENV={venv} sees torch {seen}, not PYTHON's {have['torch']}; "
                                           "remove it, or pass another GPU_VENV")
                pin_path.parent.mkdir(parents=True, exist_ok=True)
                pin_path.write_text("\n".join(pins) + "\n", encoding="utf-8")
            _run(cmd, wheels)
        return cmds
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(cmd: list[str], wheels: str | None) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise InstallError(f"{' '.join(cmd[:4])} did not finish within {PIP_TIMEOUT_S:.0f} s", 1) from None
    except OSError as exc:
        raise InstallError(f"{cmd[0]} does not run: {exc}", 1) from None
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        last = next((line for line in reversed(lines) if "ERROR" in line), lines[-1] if lines else "")
        where = f" from WHEELS={wheels}" if wheels else ""
        raise InstallError(f"install{where} failed: {last.strip()[:300]}", 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moebench.gpucheck.install", description=__doc__.split("\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose torch is used")
    parser.add_argument("--venv", default="", help="venv with system site packages ('' = install into --python)")
    parser.add_argument("--wheels", default="", help="offline: install only from this wheel folder")
    parser.add_argument("--constraints", default="", help="pins for the packages not installed yet")
    parser.add_argument("--extras", default="", help="moebench extras (e.g. test)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    try:
        cmds = install(python=args.python, venv=args.venv, wheels=args.wheels or None,
                       constraints=args.constraints or None, extras=args.extras, dry_run=args.dry_run)
    except InstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.dry_run:
        print("\n".join(" ".join(c) for c in cmds))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_NO_INPUT", "1")
    sys.exit(main())

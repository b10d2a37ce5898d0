"""Installed package versions against the constraints file shipped inside the package (moebench/constraints.txt).

`make install` installs exactly those versions; this check says when the environment has drifted from them
(a later `pip install -U`, an install without the Makefile, a venv built before the pins changed).
The verdicts are pure functions of the pins, the installed versions and moebench's own requirements, so tests
feed them faked lookups.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.resources
import os
import re
import sys
from collections.abc import Callable, Iterable

from moebench.envcheck.check import OK, PLATFORM, SKIP, WARN, Check

CONSTRAINTS_FILE = "constraints.txt"
"""Package data of `moebench`; the Makefile's default CONSTRAINTS is the same file (moebench/constraints.txt)."""
RUNTIME = "runtime"
"""Role of a package moebench requires unconditionally (pyproject [project] dependencies)."""
TRANSITIVE = "transitive"
"""Role of a pinned package moebench does not name itself (a dependency of a dependency, e.g. pydantic)."""

_NAME_SEPARATORS = re.compile(r"[-_.]+")
_PIN_LINE = re.compile(r"^(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*==\s*(?P<version>[^\s;#,]+)$")
_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)")
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def canonical_name(name: str) -> str:
    """PEP 503 normalisation: "dm_tree", "DM.Tree" and "dm-tree" are one package."""
    return _NAME_SEPARATORS.sub("-", name.strip()).lower()


def parse_constraints(text: str) -> dict[str, str]:
    """Constraints text -> {canonical name: pinned version}, in file order.

    Blank lines and comments (whole-line or after the pin) are skipped; any other line that is not
    `name==version`, or a package pinned twice, raises ValueError naming the line.
    """
    pins: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _PIN_LINE.match(line)
        if not match:
            raise ValueError(f"line {number}: {raw.strip()!r} is not `name==version`")
        name = canonical_name(match.group("name"))
        if name in pins:
            raise ValueError(f"line {number}: {name} is pinned twice")
        pins[name] = match.group("version")
    return pins


def requirement_roles(requires: Iterable[str] | None) -> dict[str, str]:
    """moebench's Requires-Dist lines -> {canonical name: "runtime" | "extra '<name>'"} (the first role wins).

    'typer>=0.29' -> runtime; 'pytest>=7.4; extra == "test"' -> "extra 'test'".
    """
    roles: dict[str, str] = {}
    for req in requires or ():
        match = _REQUIREMENT_NAME.match(req)
        if not match:
            continue
        name = canonical_name(match.group(1))
        _, _, marker = req.partition(";")
        extra = _EXTRA_MARKER.search(marker)
        role = f"extra '{extra.group(1)}'" if extra else RUNTIME
        if role == RUNTIME or name not in roles:
            roles[name] = role
    return roles


def same_version(installed: str, pinned: str) -> bool:
    """PEP 440 equality ("1.0" == "1.0.0") when `packaging` is there (DeepSpeed needs it), else string equality."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return installed.strip().lower() == pinned.strip().lower()
    try:
        return Version(installed) == Version(pinned)
    except InvalidVersion:
        return installed.strip().lower() == pinned.strip().lower()


@dataclasses.dataclass(frozen=True)
class PinVerdict:
    """One pinned package: its pin, what is installed, and the verdict."""

    name: str
    pinned: str
    installed: str | None
    role: str
    """"runtime", "extra '<name>'" or "transitive"."""
    status: str
    """ok (installed == pinned), warn (drift, or a runtime dependency missing), skip (optional and missing)."""
    reason: str


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def judge(pins: dict[str, str], installed: Callable[[str], str | None], roles: dict[str, str]) -> list[PinVerdict]:
    """Per pinned package: ok when the installed version equals the pin, warn when it differs ("drift") or when
    a runtime dependency is missing, skip when an optional package (test extra, transitive) is not installed."""
    out = []
    for name, pinned in pins.items():
        role = roles.get(name, TRANSITIVE)
        found = installed(name)
        if found is None:
            if role == RUNTIME:
                status, reason = WARN, "not installed (a runtime dependency of moebench)"
            else:
                why = f"{role} of moebench" if role != TRANSITIVE else "not a direct dependency of moebench"
                status, reason = SKIP, f"not installed (optional: {why})"
        elif same_version(found, pinned):
            status, reason = OK, f"{found} as pinned"
        else:
            status, reason = WARN, f"drift: found {found}, constraints pin {pinned}"
        out.append(PinVerdict(name=name, pinned=pinned, installed=found, role=role, status=status, reason=reason))
    return out


def _display_path(path: str) -> str:
    """Relative to the working directory when below it (moebench/constraints.txt in a checkout), else absolute."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def verdict_check(verdicts: list[PinVerdict], file: str, python: str = "python") -> Check:
    """The report's row for the per-package verdicts: warn if any package drifted or a runtime one is missing."""
    drift = [v for v in verdicts if v.status == WARN and v.installed is not None]
    missing = [v for v in verdicts if v.status == WARN and v.installed is None]
    skipped = [v for v in verdicts if v.status == SKIP]
    matching = [v for v in verdicts if v.status == OK]
    parts = []
    if drift:
        parts.append("drift: " + "; ".join(f"{v.name} found {v.installed}, constraints pin {v.pinned}" for v in drift))
    if missing:
        parts.append("missing: " + ", ".join(v.name for v in missing) + " (runtime dependencies of moebench)")
    parts.append(f"{len(matching)} of {len(verdicts)} pinned packages at the pinned version")
    if skipped:
        parts.append("not installed (optional): " + ", ".join(v.name for v in skipped))
    bad = drift + missing
    return Check(
        id="platform.constraints", section=PLATFORM, title="Pinned packages",
        status=WARN if bad else OK, found="; ".join(parts),
        required=f"the versions in {file} (what `make install` installs; torch is pinned by TORCH_SPEC instead)",
        hint=(f"`{python} -m pip install -c {file} {' '.join(v.name for v in bad)}` "
              "(or `make install` on a fresh venv)") if bad else "",
        data={"file": file, "drift": [v.name for v in drift], "missing": [v.name for v in missing],
              "packages": [dataclasses.asdict(v) for v in verdicts]},
    )


def checks(installed: Callable[[str], str | None] | None = None) -> list[Check]:
    """The constraints row; `installed` looks up a package's version (default: this environment's metadata)."""
    installed = installed or installed_version
    resource = importlib.resources.files("moebench").joinpath(CONSTRAINTS_FILE)
    file = _display_path(str(resource))
    try:
        pins = parse_constraints(resource.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        unreadable = isinstance(exc, OSError)
        return [Check(
            id="platform.constraints", section=PLATFORM, title="Pinned packages", status=WARN,
            found=f"cannot {'read' if unreadable else 'parse'} {file}: {exc}",
            required="moebench's constraints file, shipped inside the package: one `name==version` a line",
            hint="reinstall moebench (`make install`)" if unreadable else f"fix {file}: one `name==version` a line",
            data={"file": file, "error": str(exc)})]
    try:
        roles = requirement_roles(importlib.metadata.requires("moebench"))
    except importlib.metadata.PackageNotFoundError:
        # Running from a source tree that was never installed: every pinned package counts as required.
        roles = {name: RUNTIME for name in pins}
    return [verdict_check(judge(pins, installed, roles), file, python=_display_path(sys.executable))]

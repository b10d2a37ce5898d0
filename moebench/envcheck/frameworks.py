"""The MoE frameworks `verify-parity --library` verifies, as installed here: each one's version, whether moebench
has measured that release (the compatibility table, moebench.libraries.compatibility) and the torch the framework
declares it needs. Never imports a framework: versions and requirements come from the installed metadata."""

from __future__ import annotations

import importlib.metadata
from typing import Callable

from moebench.envcheck.check import FRAMEWORKS, OK, SKIP, WARN, Check
from moebench.libraries.spec import MEASURED_TORCH


def torch_requirement(dist: str) -> str | None:
    """The torch specifier `dist` declares for a plain install ("" when it declares none, None: not installed)."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        declared = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for text in declared:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name == "torch" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return str(req.specifier)
    return ""


def torch_meets(specifier: str, torch_version: str) -> bool:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(specifier).contains(Version(torch_version.split("+")[0]), prereleases=True)
    except (InvalidVersion, InvalidSpecifier):
        return True  # what cannot be read is judged elsewhere (the torch section), not guessed here


def checks(torch_version: str | None, requirement: Callable[[str], str | None] = torch_requirement) -> list[Check]:
    """One check per built-in library adapter; `torch_version` is the installed torch's (None: not installed)."""
    from moebench.libraries import compatibility, registry

    out = []
    for name in registry.BUILTIN:
        adapter = registry.load(name)
        if adapter is None:
            continue
        dist = adapter.dist_name or adapter.import_name
        version = adapter.version()
        pinned = next((r.versions for r in adapter.compatibility if r.pinned), None)
        data = {"library": name, "dist": dist, "version": version, "pinned": pinned}
        if version is None:
            out.append(Check(id=f"frameworks.{name}", section=FRAMEWORKS, title=name, status=SKIP,
                             found="not installed", required=f"only for verify-parity --library {name}",
                             hint=adapter.install_hint(), data=data))
            continue
        release = compatibility.of_installed(adapter, version, torch_version)
        needs = requirement(dist) or ""
        data.update(release=release.versions if release else None, status=release.status if release else None,
                    torch_requirement=needs)
        problems, hints = [], []
        if release is None:
            problems.append(f"a release moebench has not measured (it pins {pinned})")
            hints.append(f"trust its rows as a first look; moebench's verdicts are measured on {pinned}")
        elif release.status != "verified":
            problems.append(f"{release.status}: {release.result}")
            hints.append(f"torch {MEASURED_TORCH}, the one moebench pins: make install TORCH_SPEC=torch=="
                         f"{MEASURED_TORCH}" if release.torch != MEASURED_TORCH else
                         f"install the release moebench pins ({pinned}): {adapter.install_hint()}")
        if release and release.torch_floor and torch_version and not torch_meets(f">={release.torch_floor}",
                                                                                 torch_version):
            problems.append(f"{release.floor_for} needs torch >= {release.torch_floor} (those rows are refused "
                            f"on torch {torch_version})")
            hints.append(f"a torch >= {release.torch_floor}: make install TORCH_SPEC=torch==X.Y.Z (docs: 'Which "
                         "torch')")
        if needs and torch_version and not torch_meets(needs, torch_version):
            problems.append(f"it declares torch {needs}, torch here is {torch_version}")
            hints.append(f"a torch that meets {needs} (make install TORCH_SPEC=torch==X.Y.Z)")
        verified = (f"verified{' (pinned)' if release.pinned else ''}: verify-parity --list"
                    if release and release.status == "verified" else "")
        found = f"{version}: " + "; ".join(problems or [verified])
        out.append(Check(id=f"frameworks.{name}", section=FRAMEWORKS, title=name, status=WARN if problems else OK,
                         found=found, required=f"moebench measured {pinned} (pinned)" + (
                             f"; {dist} declares torch {needs}" if needs else ""),
                         hint="; ".join(hints), data=data))
    return out

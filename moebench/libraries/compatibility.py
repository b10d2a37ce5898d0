"""The compatibility table: every library x release x torch as moebench measured it, made from the adapters' own
declarations (`Adapter.compatibility`, each package's releases.py) so that `--list`, env-check and
docs/libraries/README.md cannot drift apart.

    python -m moebench.libraries.compatibility            the table, as the docs hold it (markdown)

Importing this module imports no library: only the adapters (which never import theirs).
"""

from __future__ import annotations

import re
import sys

from moebench.libraries import registry
from moebench.libraries.spec import MEASURED_TORCH, Adapter, Release

BEGIN = "<!-- compatibility:begin"
END = "<!-- compatibility:end -->"
"""The markers between which docs/libraries/README.md holds the generated table."""


def entries() -> list[tuple[str, Release]]:
    """(library, release) for every built-in adapter's declared releases, in the registry's order."""
    out = []
    for name in registry.BUILTIN:
        adapter = registry.load(name)
        if adapter is not None:
            out += [(name, release) for release in adapter.compatibility]
    return out


def markdown() -> str:
    """The table as docs/libraries/README.md holds it between BEGIN and END."""
    lines = ["| library | release | torch | status | what moebench measured |", "|---|---|---|---|---|"]
    for name, r in entries():
        shown = f"{r.versions} (pinned)" if r.pinned else r.versions
        lines.append(f"| {name} | {shown} | {r.torch} | {r.status} | {r.result.replace('|', '/')} |")
    return "\n".join(lines)


def console_lines(installed: dict[str, str | None], width: int, torch_version: str | None = None) -> list[str]:
    """The table for --list: a line per release, its result wrapped beneath; `installed` (library -> installed
    version) and the installed torch mark the release that runs here."""
    import textwrap

    out = [f"compatibility: library x release, measured on torch {MEASURED_TORCH} (CPU, gloo) unless said; "
           "docs/libraries/README.md"]
    out = textwrap.wrap(out[0], width)
    for name, r in entries():
        here = installed.get(name)
        adapter = registry.load(name)
        mark = "  <- installed" if here and of_installed(adapter, here, torch_version) is r else ""
        torch = "" if r.torch == MEASURED_TORCH else f", torch {r.torch}"
        out.append(f"  {name} {r.versions}{' (pinned)' if r.pinned else ''}: {r.status}{torch}{mark}")
        out += textwrap.wrap(r.result, width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                             break_on_hyphens=False)
    return out


def _key(text: str) -> tuple[int, ...]:
    """"0.19.8" -> (0, 19, 8); a pre-release or local suffix is dropped ("2.13.0+cpu" -> (2, 13, 0))."""
    parts = []
    for part in text.strip().split("."):
        digits = re.match(r"\d+", part)
        if not digits:
            break
        parts.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(parts)


def covers(versions: str, version: str) -> bool:
    """Whether a declared release (one version, "a-b", "<= a", "4.x") covers an installed `version`. An entry that
    names another library's release too ("0.19.8 + transformers 5.22.2") covers nothing by itself."""
    have = _key(version)
    text = versions.strip()
    if "+" in text or not have:
        return False
    if text.startswith("<="):
        bound = _key(text[2:])
        return have[:len(bound)] <= bound
    if text.endswith(".x"):
        return have[:1] == _key(text[:-2])
    low, _, high = text.partition("-")
    low_key, high_key = _key(low), _key(high or low)
    return have[:len(low_key)] >= low_key and have[:len(high_key)] <= high_key


def of_installed(adapter: Adapter, version: str, torch_version: str | None = None) -> Release | None:
    """The declared release that covers the installed `version` on the installed torch: the entry measured on that
    torch's major.minor when there is one, else the one measured on MEASURED_TORCH (None: a release moebench has
    not measured)."""
    found = [r for r in adapter.compatibility if covers(r.versions, version)]
    here = _key(torch_version or MEASURED_TORCH)[:2]
    return next((r for r in found if _key(r.torch)[:2] == here), None) or next(
        (r for r in found if r.torch == MEASURED_TORCH), None)


def main(argv: list[str]) -> int:
    if argv not in ([], ["--markdown"]):
        print("usage: python -m moebench.libraries.compatibility [--markdown]", file=sys.stderr)
        return 2
    print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Run a finding's script with the fix its page proposes applied in this process.

    python tests/findings/with_patch.py PAGE.md MODULE:QUALNAME [MODULE:QUALNAME ...] -- SCRIPT.py [ARGS]

The page's ```diff block is the patch: each hunk (context and `-` lines -> context and `+` lines) is applied to the
source of the named functions as the installed release has it (inspect.getsource), exactly once in one of them
(else exit 3: the diff does not fit this release), and each patched function replaces the original before the
script runs as __main__ (processes the script forks inherit the replacement). The diff's own line numbers are not
used: the same fix applies to a release whose lines moved.
"""

from __future__ import annotations

import importlib
import inspect
import re
import runpy
import sys
import textwrap


def hunks(page: str) -> list[tuple[str, str]]:
    """The page's diff as (old text, new text) per hunk."""
    block = re.search(r"```diff\n(.*?)```", open(page).read(), re.S)
    if block is None:
        raise SystemExit(f"with_patch: no ```diff block in {page}")
    out, old, new = [], None, None
    for line in block.group(1).splitlines():
        if line.startswith("@@"):
            if old is not None:
                out.append(("".join(old), "".join(new)))
            old, new = [], []
        elif old is None or line.startswith(("---", "+++")):
            continue
        elif line.startswith("-"):
            old.append(line[1:] + "\n")
        elif line.startswith("+"):
            new.append(line[1:] + "\n")
        else:  # context (an empty context line may have lost its space)
            old.append(line[1:] + "\n")
            new.append(line[1:] + "\n")
    if old is not None:
        out.append(("".join(old), "".join(new)))
    return out


def resolve(spec: str):
    module, _, qualname = spec.partition(":")
    owner, obj = None, importlib.import_module(module)
    for part in qualname.split("."):
        owner, obj = obj, getattr(obj, part)
    return owner, qualname.split(".")[-1], inspect.unwrap(obj)


def apply(page: str, specs: list[str]) -> None:
    targets = [resolve(s) for s in specs]
    sources = [inspect.getsource(f) for _, _, f in targets]
    for old, new in hunks(page):
        fits = [i for i, src in enumerate(sources) if src.count(old) == 1]
        if len(fits) != 1:
            raise SystemExit(3)  # the diff does not fit this release's code
        sources[fits[0]] = sources[fits[0]].replace(old, new)
    for (owner, name, func), src in zip(targets, sources):
        scope = dict(func.__globals__)
        exec(compile(textwrap.dedent(src), inspect.getsourcefile(func), "exec"), scope)
        setattr(owner, name, scope[name])


if __name__ == "__main__":
    cut = sys.argv.index("--")
    apply(sys.argv[1], sys.argv[2:cut])
    sys.argv = sys.argv[cut + 1:]
    runpy.run_path(sys.argv[0], run_name="__main__")

"""The frameworks' install: moebench[autoep], [automodel], [torchtitan] pinned in moebench/constraints.txt, the
frameworks themselves in moebench/frameworks.txt (pip's --no-deps), both installed by `make install`, and the one
line a user sees when one is missing."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

from moebench.envcheck.constraints import canonical_name, parse_constraints
from moebench.libraries import pins

ROOT = Path(__file__).resolve().parents[2]
PINS = parse_constraints((ROOT / "moebench" / "constraints.txt").read_text())


def _names(requirements: list[str]) -> list[str]:
    return [canonical_name(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in requirements]


def test_the_extras_and_the_no_deps_frameworks_are_pinned():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("autoep", "automodel", "torchtitan"):
        missing = [n for n in _names(extras[extra]) if n not in PINS]
        assert not missing, f"pin {missing} (extra {extra}) in moebench/constraints.txt"
    listed = parse_constraints((ROOT / "moebench" / "frameworks.txt").read_text())
    assert set(listed) == {"nemo-automodel", "torchtitan"}
    assert all(PINS[name] == version for name, version in listed.items()), "frameworks.txt and the pins disagree"


def test_the_existing_pins_are_kept():
    assert (PINS["transformers"], PINS["deepspeed"]) == ("5.23.0", "0.19.8")


def test_make_install_installs_the_extras_then_the_frameworks_without_their_dependencies():
    makefile = (ROOT / "Makefile").read_text()
    assert "-e '.[test,fast,fairscale,transformers,autoep,automodel,torchtitan,megatron]'" in makefile
    assert "--no-deps -r moebench/frameworks.txt" in makefile


def test_a_missing_framework_is_one_pip_line():
    assert pins.no_deps_command("nemo-automodel", "automodel") == (
        f"pip install 'moebench[automodel]' && pip install --no-deps nemo-automodel=={PINS['nemo-automodel']}")
    assert pins.pinned("Nemo_Automodel") == PINS["nemo-automodel"] and pins.pinned("no-such-package") is None

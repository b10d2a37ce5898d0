"""tests/tiers.py names tests that exist: an entry left behind by a rename would silently keep a test in the
default suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tiers import COLLECTED, MOVED_TO_SLOW

ROOT = Path(__file__).parents[1]


def test_every_moved_test_exists_and_is_slow(request):
    files = sorted({prefix.split("::")[0] for prefix in MOVED_TO_SLOW})
    collected_files, matched = request.config.stash.get(COLLECTED, (set(), set()))
    whole_files = not any("::" in arg for arg in request.config.args)  # no test picked out of its file
    if whole_files and set(files) <= collected_files:  # this session collected them all: no second collection
        missing = [prefix for prefix in MOVED_TO_SLOW if prefix not in matched]
    else:
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "-m", "slow", *files], cwd=ROOT, capture_output=True, text=True, timeout=300)
        collected = [line for line in out.stdout.splitlines() if "::" in line]
        missing = [prefix for prefix in MOVED_TO_SLOW if not any(c.startswith(prefix) for c in collected)]
    assert not missing, f"tests/tiers.py names tests that are not collected as slow: {missing}"
    assert all(reason.strip() for reason in MOVED_TO_SLOW.values())

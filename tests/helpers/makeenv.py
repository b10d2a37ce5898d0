"""The environment of a user's shell for a `make` a test starts: the suite itself may run under make (`make test`,
`make -C repo test`), whose variables would make the test's make a sub-make (its "Entering directory" lines,
the outer command line's variables)."""

from __future__ import annotations

MAKE_VARIABLES = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")


def outside_make(env) -> dict:
    return {k: v for k, v in env.items() if k not in MAKE_VARIABLES}

"""What a process the tests start should not inherit from the test process: the variables of a launcher or of
an outer make, which a user's shell does not have."""

from __future__ import annotations

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""torchrun's: a process with them set is one rank of a job."""
MAKE_VARIABLES = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")
"""An outer make's (`make test`, `make -C repo test`): a make started with them is a sub-make, printing "Entering
directory" lines and taking the outer command line's variables."""


def outside_make(env) -> dict:
    return {k: v for k, v in env.items() if k not in MAKE_VARIABLES}


def outside_launcher(env) -> dict:
    return {k: v for k, v in env.items() if k not in LAUNCHER_VARIABLES}

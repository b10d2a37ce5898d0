"""Raises in the second row (v1) on rank 1 only: the first row, which --adapter tries first, passes."""
from hostile.base import Base, passing
from moebench.libraries.spec import PARITY


def run(ctx, row, opts):
    if row.variant == "v1" and ctx.rank == 1:
        raise ValueError("boom in row v1 on rank 1")  # LATER_RAISE_LINE
    return passing(ctx, row, opts)


class LaterRaise(Base):
    name = "later-raise"
    runners = {PARITY: run}


ADAPTER = LaterRaise()

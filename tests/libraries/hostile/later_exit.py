"""Rank 1 of the second row (v1) ends its process without a word."""
import os

from hostile.base import Base, passing
from moebench.libraries.spec import PARITY


def run(ctx, row, opts):
    if row.variant == "v1" and ctx.rank == 1:
        os._exit(7)
    return passing(ctx, row, opts)


class LaterExit(Base):
    name = "later-exit"
    runners = {PARITY: run}


ADAPTER = LaterExit()

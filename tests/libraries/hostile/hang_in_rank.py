"""Every rank sleeps: a runner that hangs."""
import time

from hostile.base import Base
from moebench.libraries.spec import PARITY


def run(ctx, row, opts):
    time.sleep(3600)  # HANG_LINE


class HangInRank(Base):
    name = "hang-in-rank"
    runners = {PARITY: run}


ADAPTER = HangInRank()

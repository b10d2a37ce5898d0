"""Each rank starts a child in a session of its own (out of the rank's process group) and returns; the child's
command line carries MOEBENCH_TEST_MARKER so a test can look for survivors."""
import os
import subprocess
import sys

from hostile.base import Base, passing
from moebench.libraries.spec import PARITY


def run(ctx, row, opts):
    marker = os.environ.get("MOEBENCH_TEST_MARKER", "moebench-hostile-detached")
    subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(600)  # {marker}"], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if os.environ.get("MOEBENCH_TEST_DETACHED_THEN") == "raise" and ctx.rank == 1:
        raise RuntimeError("rank 1 raised after starting its child")
    return passing(ctx, row, opts)


class Detached(Base):
    name = "detached"
    runners = {PARITY: run}


ADAPTER = Detached()

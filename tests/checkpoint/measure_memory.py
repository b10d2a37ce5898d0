"""Memory of one audit, in a fresh process (a script: `python measure_memory.py audit|hold SMALL BIG`).

SMALL is audited first, so every module the audit uses is imported and every path warmed. Then a thread samples
the process's resident memory every millisecond while BIG is audited: `grown` is the highest sample above the
resident memory just before. The control does what an unbounded reader would (every tensor of BIG read through
the same readers and held; `hold`, in a process of its own), measured the same way: it shows the measurement sees
memory that is held. Prints one JSON line: {"grown", "seconds", "problems", "bytes"} (bytes).
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time

SAMPLE_S = 0.001


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def grown_during(work) -> tuple[int, object]:
    """(the highest resident memory seen while `work()` ran, above what it was before; what work returned)."""
    before, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(SAMPLE_S)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        value = work()
        peak[0] = max(peak[0], _rss())
    finally:
        done.set()
        thread.join()
    return peak[0] - before, value


def main(mode: str, small: str, big: str) -> None:
    from moebench.checkpoint_audit.run import audit_checkpoint, open_checkpoint

    with tempfile.TemporaryDirectory() as results:
        audit_checkpoint(small, results_dir=results)
        if mode == "hold":  # the control, in its own process: memory freed by an audit stays resident
            checkpoint = open_checkpoint(big, "PATH")
            def hold():  # each tensor read and used (summed: a memory-mapped one is paged in), and kept
                held = [t.load() for t in checkpoint.tensors]
                return held, [float(x.float().sum()) for x in held]
            grown, (held, _) = grown_during(hold)
            print(json.dumps({"grown": grown, "held": len(held)}))
            return
        start = time.monotonic()
        grown, (document, _) = grown_during(lambda: audit_checkpoint(big, results_dir=results))
        seconds = time.monotonic() - start
    print(json.dumps({"grown": grown, "seconds": round(seconds, 2), "problems": document["lines"],
                      "bytes": document["bytes"]}))


if __name__ == "__main__":
    main(*sys.argv[1:4])

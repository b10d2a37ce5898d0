"""Name a launch that did not return: which rank raised what, and where in the code under test.

A rank's error comes back as traceback text (moebench.distributed.launch). `failure_diagnosis(result)` turns the
failure that started it (LaunchResult.cause: the earliest, peers' lost connections last) into a diagnosis:
- library-raised: the exception and the innermost frame outside moebench, torch and the standard library: the
  line of the library's (or the user's own layer's, or adapter's) code that raised or called what raised;
- rank-raised: the same when every frame is moebench's, torch's or the standard library's;
- adapter-protocol: the adapter broke its contract (AdapterProtocolError, e.g. a runner returning None);
- rank-died: a rank ended without a result (a signal, an exit);
- hung: the deadline passed; the stuck ranks.
The whole traceback stays in the details (`moebench --debug` prints it) and in the check's reason.
"""

from __future__ import annotations

import os
import re
import sysconfig
from pathlib import Path
from typing import Any

from moebench.parity.diagnosis import HUNG, LIBRARY_RAISED, PROTOCOL, RANK_DIED, make

RANK_RAISED = "rank-raised"
"""A rank raised in moebench's (or torch's) own code: no frame of the code under test is on the stack."""

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
_MOEBENCH = str(Path(__file__).resolve().parents[1])


class AdapterProtocolError(TypeError):
    """An adapter's runner (or another protocol function) gave what the protocol does not allow."""


def not_comparisons(value: Any) -> str:
    """What `value` is when it is not a list of comparisons ("" when it is one), for the protocol's error."""
    from moebench.parity.compare import Comparison

    if not isinstance(value, (list, tuple)):
        return "None" if value is None else f"a {type(value).__name__}"
    bad = [v for v in value if not isinstance(v, Comparison)]
    if not bad:
        return ""
    return f"a {type(value).__name__} holding {'None' if bad[0] is None else 'a ' + type(bad[0]).__name__}"


def _not_under_test() -> tuple[str, ...]:
    """Folders whose frames are never the code under test: moebench's own, torch's, the standard library's."""
    import torch

    roots = [_MOEBENCH, str(Path(torch.__file__).resolve().parent)]
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.append(str(Path(path).resolve()))
    return tuple(r + os.sep for r in roots)


def parse(text: str) -> tuple[list[tuple[str, int, str]], str]:
    """(frames as (file, line, function), innermost last; the exception's first line) of the LAST traceback in
    `text` (a chained exception's final one)."""
    lines = text.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    body = lines[starts[-1] + 1:] if starts else lines
    frames: list[tuple[str, int, str]] = []
    exception = ""
    for line in body:
        m = _FRAME.match(line)
        if m:
            frames.append((m["file"], int(m["line"]), m["func"].strip()))
            exception = ""
        elif line and not line.startswith(" ") and not exception:
            exception = line.strip()
    return frames, exception or (lines[-1].strip() if lines else "")


def shown_path(file: str) -> str:
    """A frame's file as a person reads it: from the package folder in site-packages, else relative to the current
    folder, else as it is."""
    if "site-packages" + os.sep in file:
        return file.split("site-packages" + os.sep, 1)[1]
    try:
        rel = os.path.relpath(file)
    except ValueError:
        return file
    return file if rel.startswith("..") else rel


def code_under_test(frames: list[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    """The innermost frame outside moebench, torch and the standard library (None: there is none)."""
    skip = _not_under_test()
    for file, line, func in reversed(frames):
        resolved = str(Path(file).resolve()) if not file.startswith("<") else file
        if file.startswith("<") or resolved.startswith(skip):
            continue
        return file, line, func
    return None


def raised_diagnosis(rank: int, text: str) -> dict[str, Any]:
    """The diagnosis of one rank's traceback text."""
    frames, exception = parse(text)
    exception = exception[:300]
    if exception.split(":", 1)[0].endswith("AdapterProtocolError"):
        message = exception.split(":", 1)[1].strip() if ":" in exception else exception
        return make(PROTOCOL, f"rank {rank}: {message}", rank=rank, exception=exception, traceback=text)
    frame = code_under_test(frames)
    name = LIBRARY_RAISED if frame is not None else RANK_RAISED
    frame = frame or (frames[-1] if frames else None)
    where = f" at {shown_path(frame[0])}:{frame[1]} (in {frame[2]})" if frame else ""
    details: dict[str, Any] = {"rank": rank, "exception": exception, "traceback": text}
    if frame:
        details.update(file=frame[0], line=frame[1], function=frame[2])
    return make(name, f"rank {rank} raised {exception}{where}", **details)


_DUMPED_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')


def stuck_frame(stacks: str) -> tuple[str, int, str] | None:
    """Where a stuck rank's main thread was in the code under test, from faulthandler's dump (most recent call
    first; the thread that took the dump's signal is the "Current thread")."""
    blocks = re.split(r"^(?=(?:Current thread|Thread) 0x)", stacks, flags=re.M)
    current = next((b for b in blocks if b.startswith("Current thread")), stacks)
    frames = [(m["file"], int(m["line"]), m["func"].strip()) for m in map(_DUMPED_FRAME.match, current.splitlines())
              if m]
    return code_under_test(frames[::-1])


def failure_diagnosis(result) -> dict[str, Any] | None:
    """The diagnosis of a launch that did not return on every rank (None for one that did)."""
    if result.ok:
        return None
    cause = result.cause()
    if cause is not None:
        rank, text = cause
        if text.startswith(f"rank {rank} died without a result"):
            first = text.splitlines()[0]
            return make(RANK_DIED, first, rank=rank, traceback=text)
        return raised_diagnosis(rank, text)
    if result.stuck_ranks:
        rank = result.stuck_ranks[0]
        frame = stuck_frame(result.stacks.get(rank, ""))
        where = (f"; rank {rank} was at {shown_path(frame[0])}:{frame[1]} (in {frame[2]})" if frame
                 else "; their stacks are in the check's reason")
        return make(HUNG, f"ranks {result.stuck_ranks} still running when the deadline passed after "
                          f"{result.elapsed_s:.0f} s{where}", stuck_ranks=list(result.stuck_ranks),
                    **({"file": frame[0], "line": frame[1], "function": frame[2]} if frame else {}))
    return make(RANK_DIED, f"{result.status} on {result.world_size} rank(s) without an error", status=result.status)

"""A recorded `moebench gpu-check` run, from the hand-written tests/gpucheck/recorded/gpucheck.json
(no GPU has run gpu-check yet: every number in it is a placeholder, named as such)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable

RECORDED = Path(__file__).resolve().parents[1] / "gpucheck" / "recorded" / "gpucheck.json"


def recorded() -> dict:
    return json.loads(RECORDED.read_text(encoding="utf-8"))


def write_recorded_run(root: Path, change: Callable[[dict], dict] | None = None) -> Path:
    """results/gpu-check/<id>/ under `root` with the recorded document (changed by `change`), and its
    summary.json written by the real writer (moebench.results.RunDir)."""
    from moebench import results

    doc = copy.deepcopy(recorded())
    if change is not None:
        doc = change(doc)
    run = results.RunDir.create("gpu-check", root=root)
    run.start({"report": "gpucheck.json"})
    run.write_json("gpucheck.json", doc)
    failed = [s["name"] for s in doc["steps"] if s["status"] in ("fail", "timeout")]
    run.finish(results.STATUS_FAILED if failed else results.STATUS_OK,
               {"counts": doc["counts"], "exit_code": 1 if failed else 0, "report": "gpucheck.json",
                **({"error": f"{len(failed)} step(s) failed: {', '.join(failed)}"} if failed else {})})
    return run.path

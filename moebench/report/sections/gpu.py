"""The report's GPU section: the latest `moebench gpu-check` run, read from its gpucheck.json only.

No gpu-check run: the section says "not run" and how to run it. A damaged one: not judged, and why.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from moebench.report import collect
from moebench.report.numbers import real, text
from moebench.report.render import Block, Heading, Para, Table

KIND = "gpu-check"
REPORT_FILE = "gpucheck.json"
HOW = "on a machine with a CUDA GPU run `make gpu-check` (README: On a CUDA machine)"


def _num(value, spec: str) -> str:
    return text(value, spec, missing="-")


def _dict(value) -> dict:
    """A field the schema leaves open, when it is the object the section reads ({} otherwise)."""
    return value if isinstance(value, dict) else {}


def latest_run(root: Path, since: datetime.datetime | None = None) -> collect.Run | None:
    return collect.latest(root, KIND, since)


def blocks(run: collect.Run | None, root: Path) -> list[Block]:
    """The GPU section for `run` (the latest gpu-check run, or None)."""
    out: list[Block] = [Heading("On a GPU (moebench gpu-check)")]
    if run is None:
        return out + [Para(f"Not run: no gpu-check run under {root}; {HOW}. Nothing in this report was "
                           "measured on a GPU.")]
    doc = run.documents.get(REPORT_FILE)
    if run.damage:  # "not judged: run ... is damaged (<file>: <reason>)"
        why = run.not_ok_reason()
        return out + [Para(f"{why[0].upper()}{why[1:]}.")]
    if doc is None:
        return out + [Para(f"Not judged: run {run.run_id} has no {REPORT_FILE} ({run.status}).")]
    counts = doc["counts"]
    gpus = ", ".join(dict.fromkeys(doc.get("gpus") or [])) or "no GPU"
    out.append(Para(
        f"gpu-check {run.run_id} on {doc['host']}: {doc['gpu_count']} GPU(s) ({gpus}), torch {doc['torch']} "
        f"(CUDA {doc['torch_cuda']}); status {run.status}: {counts['pass']} pass, {counts['fail']} fail, "
        f"{counts['timeout']} timeout, {counts['skip']} skip in {_num(doc.get('elapsed_s'), '.0f')} s "
        f"(budget {_num(doc.get('budget_s'), '.0f')} s)."))
    steps = doc["steps"]
    out.append(Table(headers=("step", "status", "time", "what", "outcome"),
                     rows=tuple((s["name"], s["status"],
                                 f"{_num(s['elapsed_s'], '.0f')} s" if s.get("elapsed_s") else "-",
                                 s["title"], s["reason"] or "-") for s in steps),
                     classes=tuple("fail" if s["status"] == "timeout" else s["status"] for s in steps)))
    by_name = {s["name"]: s for s in steps}
    out += _layer_blocks(by_name.get("layers"))
    out += _runs_blocks(by_name.get("runs-compare"), by_name.get("run-fmoe"), by_name.get("run-reference"))
    out += _bench_blocks(by_name.get("bench"))
    return out


def _result(step: dict | None) -> dict | None:
    if not step or step["status"] == "skip" or not isinstance(step.get("result"), dict):
        return None
    return step["result"]


def _layer_blocks(step: dict | None) -> list[Block]:
    result = _result(step)
    if result is None:
        return []
    rows = []
    for g in result.get("gates", []):
        first = _dict(g.get("first_failure"))
        rows.append((g["gate"], str(g["top_k"]), g["status"], f"{g['comparisons_failed']}/{g['comparisons_total']}",
                     _num(g.get("worst_ratio"), ".3g"),
                     f"{first.get('name')}: {first.get('diagnosis')}" if first else "-"))
    tol = _dict(result.get("tolerance"))
    return [Para(f"Real fmoe vs moebench's reference layer, same seed (rtol {tol.get('rtol')}, atol "
                 f"{tol.get('atol_fraction')} x largest): worst = largest |difference| / allowed."),
            Table(headers=("gate", "k", "status", "failed", "worst", "first failure"), rows=tuple(rows),
                  classes=tuple(r[2] for r in rows))]


def _runs_blocks(compare: dict | None, fmoe: dict | None, ref: dict | None) -> list[Block]:
    rows = []
    for label, step in (("fmoe", fmoe), ("reference", ref)):
        r = _result(step)
        if r is not None:
            rows.append((label, _num(r.get("params_total") or 0, ","), _num(r.get("loss_first"), ".4f"),
                         _num(r.get("loss_last"), ".4f"), _num(r.get("tokens_per_s_steady"), ",.0f")))
    if not rows:
        return []
    out: list[Block] = [Table(headers=("run fastmoe --preset chapter", "parameters", "first loss", "last loss",
                                       "tokens/s (steady)"), rows=tuple(rows))]
    if compare and compare["status"] != "skip":
        out.append(Para(f"fmoe vs reference: {compare['status']}: {compare['reason']}."))
    return out


def _bench_blocks(step: dict | None) -> list[Block]:
    result = _result(step)
    if result is None:
        return []
    rows = []
    for r in result.get("rows", []):
        if r.get("skipped"):
            rows.append((r["layer"], r["dtype"], "skipped", "-", "-", "-", str(r["skipped"])[:80]))
        else:
            share = real(r.get("peak_fraction"))
            rows.append((r["layer"], r["dtype"], _num(r.get("tflops"), ".1f"),
                         "-" if share is None else f"{_num(100 * share, '.0f')} %", _num(r.get("vs_ideal"), ".2f"),
                         _num(r.get("vs_dense"), ".2f"), ""))
    peak = _dict(result.get("peak"))
    source = peak.get("source") or f"no datasheet peak known for {result.get('device')}"
    return [Para(f"One MoE layer on {result.get('device')}, forward + backward ({source})."),
            Table(headers=("layer", "dtype", "TFLOP/s", "of peak", "x ideal", "x dense", "note"), rows=tuple(rows))]

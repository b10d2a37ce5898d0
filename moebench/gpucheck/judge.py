"""What gpu-check keeps of each step's JSON output (its digest), and the verdicts of the derived steps.

Pure functions of the documents the steps printed: the CPU tests feed them recorded documents.
"""

from __future__ import annotations

import math

FIRST_LOSS_RTOL = 1e-4
"""`run fastmoe --moe-impl fmoe` vs `--moe-impl reference`, same seed: the first step's loss comes from
the same weights and data through a different order of fp32 sums only (TF32 is off by default for
matmuls): ~1e-6 relative expected, 1e-4 allows 100x that and catches any wrong expert or score."""
CURVE_RTOL = 1e-2
"""...and every later step's loss within 1 %: Adam's update divides by sqrt(v), so the reordering
noise grows step by step over 100 steps of a 273 M-parameter model (on CPU, 10 steps of 1 vs 4 ranks
stay within 1e-5 relative: moebench.parity.compare.STRICT_ADAM); 1 % is 10^3 times that and still 36x
below the 36 % drop the chapter preset's curve shows, so a diverging curve fails."""
PARAMS_EXACT = "equal parameter counts, total and by category (same module structure)"


def _finite(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def digest_build(doc: dict) -> dict:
    keep = ("status", "reason", "use_nccl", "use_nccl_reason", "reused", "site", "attempts", "import", "pitfall")
    return {k: doc.get(k) for k in keep}


def digest_envcheck(doc: dict) -> dict:
    flagged = [{"id": c["id"], "status": c["status"], "found": c["found"], "hint": c.get("hint", "")}
               for c in doc.get("checks", []) if c.get("status") in ("warn", "fail")]
    facts = {c["id"]: c["found"] for c in doc.get("checks", [])
             if c.get("id") in ("torch.version", "torch.cuda_build", "cuda.devices", "cuda.driver", "cuda.nvcc",
                                "comm.nccl_version", "deepspeed.version", "deepspeed.toolchain", "fastmoe.fmoe_cuda")}
    return {"status": doc.get("status"), "counts": doc.get("counts"), "flagged": flagged, "facts": facts,
            "results_path": doc.get("results_path")}


def digest_layers(doc: dict) -> dict:
    gates = [{k: g.get(k) for k in ("gate", "top_k", "status", "comparisons_total", "comparisons_failed",
                                     "worst_ratio", "first_failure", "note")} for g in doc.get("gates", [])]
    return {"status": doc.get("status"), "tolerance": doc.get("tolerance"), "dims": doc.get("dims"), "gates": gates}


def digest_run(doc: dict) -> dict:
    params = doc.get("params") or {}
    loss = doc.get("loss") or {}
    return {"status": doc.get("status"), "run_path": doc.get("run_path"), "moe_impl": doc.get("moe_impl"),
            "device": doc.get("device"), "params_total": params.get("total"), "params": params.get("by_category"),
            "loss_first": loss.get("first"), "loss_last": loss.get("last"), "losses": doc.get("losses"),
            "steps": doc.get("steps"), "tokens_per_s": doc.get("tokens_per_s"),
            "tokens_per_s_steady": doc.get("tokens_per_s_steady"), "wall_time_s": doc.get("wall_time_s"),
            "error": doc.get("error")}


def digest_bench(doc: dict) -> dict:
    return {k: doc.get(k) for k in ("device", "peak", "flop_per_call", "repeats", "rows")}


def digest_parity(doc: dict) -> dict:
    checks = doc.get("checks", [])
    counts = {s: sum(c.get("status") == s for c in checks) for s in ("pass", "fail", "skip")}
    failed = [c.get("name") for c in checks if c.get("status") == "fail"]
    return {"status": doc.get("status"), "world_size": doc.get("world_size"), "counts": counts, "failed": failed,
            "run_path": doc.get("run_path") or doc.get("results_path")}


DIGESTS = {"fastmoe-build": digest_build, "env-check": digest_envcheck, "layers": digest_layers,
           "run-fmoe": digest_run, "run-reference": digest_run, "run-deepspeed": digest_run, "bench": digest_bench,
           "verify-parity-nccl": digest_parity}
"""Step name -> what its record keeps of the JSON each of its commands printed."""


def compare_runs(fmoe: dict, reference: dict) -> dict:
    """The runs-compare step: two digests of chapter runs (fmoe, reference) -> its record body."""
    problems = []
    if fmoe.get("params_total") != reference.get("params_total") or fmoe.get("params") != reference.get("params"):
        problems.append(f"parameters differ: fmoe {fmoe.get('params_total')} vs reference "
                        f"{reference.get('params_total')} ({PARAMS_EXACT})")
    a, b = fmoe.get("losses") or [], reference.get("losses") or []
    worst, worst_step = 0.0, None
    if not a or len(a) != len(b):
        problems.append(f"loss curves of {len(a)} and {len(b)} steps cannot be compared")
    else:
        for step, (x, y) in enumerate(zip(a, b)):
            x, y = _finite(x), _finite(y)
            rel = math.inf if x is None or y is None else abs(x - y) / max(abs(y), 1e-12)
            if rel > worst:
                worst, worst_step = rel, step
        first = abs(a[0] - b[0]) / max(abs(b[0]), 1e-12) if _finite(a[0]) is not None and _finite(b[0]) else math.inf
        if first > FIRST_LOSS_RTOL:
            problems.append(f"first loss differs by {first:.2e} relative (tolerance {FIRST_LOSS_RTOL:g})")
        if worst > CURVE_RTOL:
            problems.append(f"loss curves differ by {worst:.2e} relative at step {worst_step} "
                            f"(tolerance {CURVE_RTOL:g})")
    rate_f, rate_r = fmoe.get("tokens_per_s_steady"), reference.get("tokens_per_s_steady")
    return {"status": "fail" if problems else "pass", "reason": "; ".join(problems) or
            f"equal parameters; loss curves within {CURVE_RTOL:g} (worst {worst:.2e} at step {worst_step})",
            "params_total": fmoe.get("params_total"), "loss_max_rel_diff": worst if math.isfinite(worst) else None,
            "loss_max_rel_step": worst_step, "first_loss_rtol": FIRST_LOSS_RTOL, "curve_rtol": CURVE_RTOL,
            "tokens_per_s_steady": {"fmoe": rate_f, "reference": rate_r},
            "fmoe_speedup": rate_f / rate_r if rate_f and rate_r else None}


def nccl_probe(envcheck_doc: dict | None) -> dict:
    """The nccl-probe step: env-check's probe.nccl row."""
    row = next((c for c in (envcheck_doc or {}).get("checks", []) if c.get("id") == "probe.nccl"), None)
    if row is None:
        return {"status": "fail", "reason": "env-check recorded no probe.nccl row (did env-check run?)"}
    status = {"ok": "pass", "skip": "skip"}.get(row["status"], "fail")
    return {"status": status, "reason": row["found"], "hint": row.get("hint", "")}

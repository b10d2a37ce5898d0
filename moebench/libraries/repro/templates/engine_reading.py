"""How an engine row's script reads its first divergence: which mechanism the numbers point at, in the tool's words
and figures. Shared by the DeepSpeed engine and AutoEP scripts (moebench pastes it into each; it only defines
functions, so where it lands among the pasted files does not matter); the script defines ROW, SETTINGS and
FORWARD_DIFFERS (what a wrong forward pass points at in that library)."""

# ruff: noqa: F405
import math  # @PASTED@ (the script imports it)

from harness import *  # noqa: F403 # @PASTED@ (the script pastes it above)
from rowmath import *  # noqa: F403 # @PASTED@ (the script pastes it above)

RESULTS = {}
"""Every process's records (set by `notes`, read by `mechanism`)."""


def notes(results):
    RESULTS.clear()
    RESULTS.update(results)
    if ROW.clip <= 0:
        return []
    norms = [s["norm"] for s in results["reference"]["steps"]]
    binds = [i + 1 for i, n in enumerate(norms) if n > ROW.clip]
    where = "at every step" if len(binds) == len(norms) else f"at steps {binds}" if binds else "never"
    shown = ", ".join(f"{n:.4g}" for n in norms)
    return [f"clip {ROW.clip:g} binds {where} (reference global gradient norms {shown})"]


def own_norms(step):
    """Per rank, the reference gradient's norm over what that rank holds (its `held` units)."""
    grad = RESULTS["reference"]["steps"][step]["grad"]
    return [math.sqrt(sum(float((grad[u] ** 2).sum()) for u in RESULTS[rank]["held"]))
            for rank in range(SETTINGS["world_size"])]


def update_factors(step):
    """Per rank: the common factors of its updates over the reference's (rowmath.common_factors, as the tool
    reads them) and the global norm they imply."""
    ref_records = {(s, k, n): rest for s, k, n, *rest in RESULTS["reference"]["records"]}
    coef = RESULTS["reference"]["steps"][step]["coef"]
    out = []
    for rank in range(SETTINGS["world_size"]):
        updates, afters = {}, {}
        for s, k, n, _group, tensor, *_ in RESULTS[rank]["records"]:
            if s == step and k in (UPDATE, AFTER) and (s, k, n) in ref_records:
                unit = n.rsplit(" update applied", 1)[0] if k == UPDATE else n.rsplit(" after the step", 1)[0]
                (updates if k == UPDATE else afters)[unit] = (tensor, ref_records[(s, k, n)][1])
        factors = common_factors(updates, afters, SETTINGS["world_size"])
        out.append((factors, implied_norm(ROW.clip, factors[0], coef) if factors and len(factors) == 1 else None))
    return out


def mechanism(kind, rows):
    """One sentence: what the first divergence says about its mechanism (the tool's words and figures)."""
    k = rows_factor(rows)
    factor = "varying factors" if k is None else f"{k:.4g}"
    groups = ", ".join(sorted({r[4] for r in rows}))
    step, rank = rows[0][0], rows[0][2]
    ref_norm = RESULTS["reference"]["steps"][step]["norm"] if RESULTS else 0.0
    if kind == LOSS:
        return FORWARD_DIFFERS
    if kind == GRAD:
        return f"The reduced gradients of the {groups} group(s) differ (scaled by {factor})."
    if kind == NORM:
        norms = {r[2]: float(r[9][0]) for r in rows}
        engine = norms[rank]
        said = (f"Reduced gradients right; the engine's global gradient norm is {engine:.4g} on rank {rank}, the "
                f"reference's {ref_norm:.4g} (x {engine / ref_norm:.4g}): the clip coefficient differs, so every "
                "update is scaled by it")
        if len(norms) == SETTINGS["world_size"]:
            said += which_norm([norms[r] for r in sorted(norms)], own_norms(step), ref_norm)
        return said + "."
    if kind == UPDATE:
        per_rank = update_factors(step)
        factors = per_rank[rank][0]
        if ROW.clip > 0 and factors:
            said = (f"Reduced gradients right; every update on rank {rank} is the reference's scaled by one common "
                    f"factor per rank or ZeRO partition ({', '.join(f'{f:.4g}' for f in factors)}): the global "
                    "gradient norm or the clip coefficient differs")
            if all(implied is not None for _, implied in per_rank):
                said += which_norm([i for _, i in per_rank], own_norms(step), ref_norm)
            return said + "."
        return "Reduced gradients agree, the applied step does not: partitioning or the copy back."
    return "The update agrees, the parameter does not: the updated partition was copied back wrongly."


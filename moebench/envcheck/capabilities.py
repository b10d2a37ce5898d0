"""What can run here: one yes/no (with the reason) per registered variant and for verify-parity."""

from __future__ import annotations

import importlib
from typing import Callable

from moebench import variants
from moebench.envcheck.check import CAPABILITIES, FAIL, OK, WARN, Check
from moebench.envcheck.fastmoe_stack import module_present

RANK_MEMORY_BYTES = 256 * 1024**2
"""Budget per forked gloo rank for the parity checks: a forked rank shares torch's pages with its parent
(~5 MB private after the probe, measured) and the checks' models are small; 256 MB leaves wide headroom."""
PARITY_REGISTRY = "moebench.parity.registry"


def _parity_registry() -> tuple[list | None, dict, str]:
    """(registered checks, module import errors, why not loadable)."""
    try:
        registry = importlib.import_module(PARITY_REGISTRY)
        checks = list(registry.all_checks())
    except Exception as exc:  # noqa: BLE001 - report, never crash env-check
        return None, {}, f"{type(exc).__name__}: {exc}"
    return checks, dict(getattr(registry, "IMPORT_ERRORS", {}) or {}), ""


def _verify_parity(lookup) -> Check:
    base = dict(id="can_run.verify_parity", section=CAPABILITIES, title="verify-parity",
                required="gloo (CPU) or NCCL (GPUs) with working collectives, and the parity check registry")
    gloo = lookup("comm.gloo")
    probe = lookup("probe.gloo")
    memory = lookup("platform.memory")
    cores = lookup("platform.cpu").data.get("cores_usable", 1) if lookup("platform.cpu") else 1
    available = memory.data.get("available_bytes", 0) if memory else 0
    gloo_max = max(1, min(available // RANK_MEMORY_BYTES, importlib.import_module(PARITY_REGISTRY).MAX_WORLD_SIZE))
    gpus = lookup("cuda.devices").data.get("torch_device_count", 0) if lookup("cuda.devices") else 0
    nccl = lookup("comm.nccl")
    nccl_ok = nccl is not None and nccl.status == OK and gpus > 0
    data = {"gloo_max_local_world_size": int(gloo_max), "nccl_max_local_world_size": gpus if nccl_ok else 0,
            "cores": cores}
    if gloo is None or gloo.status == FAIL or (probe is not None and probe.status == FAIL):
        return Check(**base, status=FAIL, data=data, found="no: gloo is unavailable or its probe failed",
                     hint="see the Communication and Collective probe rows")
    registered, import_errors, error = _parity_registry()
    backends = (
        f"gloo up to {gloo_max} local ranks (memory; > {cores} ranks oversubscribe the cores: slower, still correct)"
    )
    backends += f", NCCL up to {gpus} (one GPU per rank)" if nccl_ok else ", NCCL: no (no GPUs)"
    if registered is None:
        return Check(
            **base,
            status=WARN,
            data=data,
            found=f"{backends}; but the check registry does not load: {error}",
            hint="reinstall moebench (`make install`); report the error",
        )
    missing = {c.name: [m for m in getattr(c, "requires", ()) if not module_present(m)] for c in registered}
    missing = {k: v for k, v in missing.items() if v}
    too_big = [c.name for c in registered if (getattr(c, "min_world_size", 1) or 1) > gloo_max]
    data.update(checks=[c.name for c in registered], checks_missing_modules=missing,
                checks_needing_more_ranks=too_big, check_module_errors=sorted(import_errors))
    notes = [f"{len(missing)} need missing modules" if missing else "",
             f"{len(too_big)} need more ranks than fit" if too_big else "",
             f"check modules failing to import: {', '.join(sorted(import_errors))}" if import_errors else ""]
    notes = "; ".join(n for n in notes if n)
    return Check(**base, status=WARN if import_errors else OK, data=data,
                 found=f"yes: {len(registered)} checks; {backends}" + (f"; {notes}" if notes else ""),
                 hint="see `moebench verify-parity --list` for the import errors" if import_errors else "")


def checks(lookup: Callable[[str], Check | None]) -> list[Check]:
    out = []
    for variant in variants.VARIANTS:
        base = dict(id=f"can_run.{variant.name}", section=CAPABILITIES, title=f"run {variant.name}",
                    required=f"modules {', '.join(variant.requires)}; " + variant.description)
        missing = [m for m in variant.requires if not module_present(m)]
        if missing:
            out.append(Check(**base, status=FAIL, found=f"no: missing {', '.join(missing)}",
                             hint="`make install` installs every dependency"))
        else:
            status, found, hint = variant.capability(lookup)
            out.append(Check(**base, status=status, found=found, hint=hint))
    out.append(_verify_parity(lookup))
    return out

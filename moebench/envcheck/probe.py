"""The live collective probe: 2 local ranks run the three collectives MoE layers depend on, values checked.

- all_reduce: gradient averaging;
- a padded variable-size all_gather: gathering a different number of tokens from each rank;
- all_to_all_single with uneven (and empty) splits: expert parallelism's token exchange.

Bounded by a deadline: a hang becomes a `fail` that says "hung", and `launch` kills every rank.
"""

from __future__ import annotations

import time
import traceback
from typing import Callable

import torch
import torch.distributed as dist

from moebench.distributed.launch import LaunchResult, RankContext, launch, under_torchrun
from moebench.envcheck.check import FAIL, OK, PROBE, SKIP, WARN, Check

PROBE_WORLD_SIZE = 2
OPS = ("all_reduce", "all_gather_variable", "all_to_all_single_uneven")


def _rows_on(rank: int) -> int:
    return 2 * rank + 1  # 1, 3, 5, ...: every rank a different size


def _split(src: int, dst: int) -> int:
    # Elements rank src sends rank dst: uneven, and 0 for some pairs (an expert that got no tokens).
    return (src + 2 * dst) % 3


def _probe_all_reduce(ctx: RankContext) -> None:
    x = torch.full((4,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(x)
    expected = float(sum(range(1, ctx.world_size + 1)))
    if not torch.equal(x.cpu(), torch.full((4,), expected)):
        raise AssertionError(f"all_reduce gave {x.tolist()}, expected {expected} everywhere")


def _probe_all_gather_variable(ctx: RankContext) -> None:
    rows = _rows_on(ctx.rank)
    local = torch.arange(rows * 3, dtype=torch.float32, device=ctx.device).reshape(rows, 3) + 1000 * ctx.rank
    sizes = [torch.zeros(1, dtype=torch.int64, device=ctx.device) for _ in range(ctx.world_size)]
    dist.all_gather(sizes, torch.tensor([rows], device=ctx.device))
    sizes_list = [int(s.item()) for s in sizes]
    longest = max(sizes_list)
    padded = torch.zeros(longest, 3, device=ctx.device)
    padded[:rows] = local
    gathered = [torch.empty_like(padded) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, padded)
    result = torch.cat([g[:n] for g, n in zip(gathered, sizes_list)]).cpu()
    expected = torch.cat([torch.arange(_rows_on(r) * 3, dtype=torch.float32).reshape(-1, 3) + 1000 * r
                          for r in range(ctx.world_size)])
    if sizes_list != [_rows_on(r) for r in range(ctx.world_size)] or not torch.equal(result, expected):
        raise AssertionError(f"variable all_gather gave sizes {sizes_list} and wrong values")


def _probe_all_to_all_uneven(ctx: RankContext) -> None:
    w, r = ctx.world_size, ctx.rank
    send_splits = [_split(r, d) for d in range(w)]
    recv_splits = [_split(s, r) for s in range(w)]
    # Each element says where it came from and where it goes: src * 10000 + dst * 100 + index.
    send = torch.cat([torch.arange(n, dtype=torch.float32) + r * 10000 + d * 100
                      for d, n in enumerate(send_splits)]).to(ctx.device)
    recv = torch.full((sum(recv_splits),), -1.0, device=ctx.device)
    dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits)
    expected = torch.cat([torch.arange(n, dtype=torch.float32) + s * 10000 + r * 100
                          for s, n in enumerate(recv_splits)])
    if not torch.equal(recv.cpu(), expected):
        raise AssertionError(f"all_to_all_single (splits in {send_splits}, out {recv_splits}) gave {recv.tolist()}, "
                             f"expected {expected.tolist()}")


_OP_FUNCTIONS = {"all_reduce": _probe_all_reduce, "all_gather_variable": _probe_all_gather_variable,
                 "all_to_all_single_uneven": _probe_all_to_all_uneven}


def probe_rank(ctx: RankContext) -> dict[str, dict]:
    """Run every probed collective on this rank; an op that raises is recorded and the next one still runs."""
    results = {}
    for name, op in _OP_FUNCTIONS.items():
        start = time.monotonic()
        try:
            op(ctx)
            results[name] = {"ok": True, "ms": round(1000 * (time.monotonic() - start), 2)}
        except Exception as exc:  # noqa: BLE001 - reported per op
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            results[name] = {"ok": False, "error": last[:400]}
    return results


def _stuck_in(stack: str) -> str:
    """Name the probed collective a killed rank was inside, from its dumped Python stack."""
    for name, fn in _OP_FUNCTIONS.items():
        if fn.__name__ in stack:
            return name
    return ""


def run_probe(backend: str, timeout_s: float, *, rank_fn: Callable = probe_rank,
              world_size: int = PROBE_WORLD_SIZE) -> Check:
    """Launch the probe on `backend` and turn its LaunchResult into a check.

    `rank_fn` is the function each rank runs (tests inject one that hangs or lies).
    """
    result: LaunchResult = launch(rank_fn, world_size, backend=backend, timeout_s=timeout_s,
                                  label=f"env-check probe ({backend})")
    return probe_check(backend, timeout_s, result)


def probe_check(backend: str, timeout_s: float, result: LaunchResult) -> Check:
    """Pure verdict on a probe's LaunchResult."""
    base = dict(id=f"probe.{backend}", section=PROBE, title=f"{backend}: {PROBE_WORLD_SIZE} ranks",
                required="all_reduce, padded variable all_gather and uneven all_to_all_single give the right values")
    data = {"backend": backend, "status": result.status, "elapsed_s": round(result.elapsed_s, 3),
            "timeout_s": timeout_s, "ops": {}, "errors": result.errors, "stuck_ranks": result.stuck_ranks}
    if result.stuck_ranks or result.status == "hung":
        where = {r: _stuck_in(s) for r, s in result.stacks.items()}
        detail = ", ".join(f"rank {r} in {op or 'unknown code'}" for r, op in sorted(where.items()))
        raised = [f"rank {r}: {t.strip().splitlines()[-1]}" for r, t in sorted(result.errors.items()) if t.strip()]
        for r, ret in enumerate(result.returns):  # ranks that finished, with the ops that gave up waiting
            first_bad = next(((n, e) for n, e in (ret or {}).items() if not e.get("ok")), None)
            if first_bad:
                raised.append(f"rank {r} {first_bad[0]}: {first_bad[1].get('error', '')[:160]}")
        raised = "; ".join(raised)
        data["stuck_in"] = where
        return Check(
            **base,
            status=FAIL,
            data=data,
            found=f"hung: rank(s) {result.stuck_ranks} did not finish within {timeout_s:g} s"
            + (f" ({detail})" if detail else "")
            + (f"; {raised}" if raised else "")
            + "; all ranks were killed",
            hint="rerun with NCCL_DEBUG=INFO / check GLOO_SOCKET_IFNAME and firewalls; "
            "--probe-timeout raises the bound",
        )
    if result.errors:
        first = result.cause()  # the rank that failed first, not a peer that lost it
        return Check(
            **base,
            status=FAIL,
            data=data,
            found=f"rank {first[0]} failed: {first[1].strip().splitlines()[-1] if first[1].strip() else 'no output'}",
            hint="see the error; a torch reinstall (pinned) fixes a broken backend",
        )
    per_op: dict[str, dict] = {}
    for rank, ret in enumerate(result.returns):
        for name in OPS:
            entry = (ret or {}).get(name, {"ok": False, "error": "no result"})
            slot = per_op.setdefault(name, {"ok": True, "errors": {}})
            if not entry.get("ok"):
                slot["ok"] = False
                slot["errors"][rank] = entry.get("error", "")
    data["ops"] = per_op
    bad = [n for n in OPS if not per_op[n]["ok"]]
    if bad:
        text = "; ".join(f"{n}: {next(iter(per_op[n]['errors'].values()))}" for n in bad)
        unsupported = [n for n in bad if any(w in e.lower() for e in per_op[n]["errors"].values()
                                             for w in ("not supported", "unsupported", "does not support"))]
        hint = (
            f"{backend} in this torch lacks {', '.join(unsupported)}: expert parallelism needs it; "
            "use another backend or torch"
            if unsupported
            else "collectives return wrong values: report it with `moebench env-check --report`"
        )
        return Check(**base, status=FAIL, found=f"{len(OPS) - len(bad)}/{len(OPS)} collectives ok; {text}",
                     hint=hint, data=data)
    return Check(**base, status=OK, data=data,
                 found=f"{', '.join(OPS)}: values correct ({result.elapsed_s:.2f} s)")


def checks(*, enabled: bool, timeout_s: float, gpu_count: int) -> list[Check]:
    base_required = "all_reduce, padded variable all_gather and uneven all_to_all_single give the right values"
    if not enabled:
        return [Check(id=f"probe.{b}", section=PROBE, title=f"{b}: {PROBE_WORLD_SIZE} ranks", status=SKIP,
                      found="skipped (--no-probe)", required=base_required) for b in ("gloo", "nccl")]
    if under_torchrun():
        return [Check(id=f"probe.{b}", section=PROBE, title=f"{b}: {PROBE_WORLD_SIZE} ranks", status=WARN,
                      found="skipped: RANK and WORLD_SIZE are set, so this shell looks like a torchrun rank "
                            "and the probe would join that job", required=base_required,
                      hint="unset RANK and WORLD_SIZE, then rerun env-check") for b in ("gloo", "nccl")]
    out = []
    if dist.is_available() and dist.is_gloo_available():
        out.append(run_probe("gloo", timeout_s))
    else:
        out.append(Check(id="probe.gloo", section=PROBE, title=f"gloo: {PROBE_WORLD_SIZE} ranks", status=FAIL,
                         found="gloo not available", required=base_required,
                         hint="install an official torch wheel"))
    if gpu_count >= PROBE_WORLD_SIZE and dist.is_nccl_available():
        out.append(run_probe("nccl", timeout_s))
    else:
        out.append(Check(id="probe.nccl", section=PROBE, title=f"nccl: {PROBE_WORLD_SIZE} ranks", status=SKIP,
                         found=f"needs {PROBE_WORLD_SIZE}+ GPUs and NCCL (found {gpu_count} GPU(s), "
                               f"NCCL {'available' if dist.is_nccl_available() else 'not built in'})",
                         required=base_required))
    return out

"""Expert-parallel layers on 1, 2, 4 ... local ranks, and the all-to-all exchange alone (`--comm`).

One launch per world size W runs every point on W ranks (moebench's launcher: forked gloo ranks
on CPU, NCCL ranks on GPUs). Every rank feeds its own `tokens` tokens; the layer holds
`experts / W` experts per rank and exchanges routed slots by all-to-all:
- `reference-ep`: moebench's FMoEReference with world_size = W (fastmoe's exchange);
- `deepspeed-ep-cf1`: DeepSpeed's `MoE` with ep_size = W, capacity factor 1.0.
A timed call is barrier, forward + backward, barrier, so the time is the slowest rank's. Tokens/s
counts every rank's tokens; `comm_share` is the wall time rank 0 spends inside torch.distributed
collectives during one call (waiting for the others included). A point is oversubscribed when
W x threads per rank exceeds the usable cores: the ranks then share cores and the time says
little about the layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time

import torch

from moebench import signals
from moebench.bench.layers import Point, profile_shares, release_memory, time_call, warm_up
from moebench.rankenv import usable_cores

EP_LAYERS = ("reference-ep", "deepspeed-ep-cf1")


def oversubscribed(world: int) -> bool:
    """More rank threads than usable cores: the ranks take turns on the cores."""
    return world * torch.get_num_threads() > usable_cores()


def _build_ep_layer(name: str, p: Point, world: int, rank: int):
    if name == "reference-ep":
        from moebench.models.moe import build_moe_mlp

        torch.manual_seed(0)  # the same gate on every rank
        return build_moe_mlp(backend="reference", experts=p.experts, d_model=p.d_model, d_hidden=p.d_hidden,
                             top_k=p.top_k, gate="naive", world_size=world)
    from moebench.models.deepspeed_moe import DeepSpeedMoEMLP, create_expert_groups
    from moebench.variants.deepspeed.config import DeepSpeedMoEConfig

    cf = float(name.removeprefix("deepspeed-ep-cf"))
    cfg = DeepSpeedMoEConfig(experts=(p.experts,), d_hidden=p.d_hidden, top_k=p.top_k, capacity_factor=cf,
                             eval_capacity_factor=cf, min_capacity=0, noisy_gate_policy="none", use_residual=False,
                             drop_tokens=True, use_rts=False, ep_size=world)
    torch.manual_seed(0)
    layer = DeepSpeedMoEMLP(cfg, d_model=p.d_model, experts=p.experts, seed=0, ep_rank=rank,
                            top2_2nd_expert_sampling=False)
    create_expert_groups(world)  # a collective on every rank
    layer.moe.set_deepspeed_parallelism()
    return layer


COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce",
               "reduce_scatter_tensor")
"""torch.distributed functions timed by `collective_seconds` (moebench's exchange and DeepSpeed's
call them through the module attribute, so a wrapper sees every call)."""


def collective_seconds(fn) -> tuple[float, float]:
    """(wall seconds of `fn`, seconds of it spent inside torch.distributed collectives). The
    profiler cannot say: a gloo collective's wait is no aten op, so its self time misses it."""
    import torch.distributed as dist

    spent = [0.0]
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def timed(original):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper

    for name, original in saved.items():
        setattr(dist, name, timed(original))
    try:
        t0 = time.perf_counter()
        fn()
        total = time.perf_counter() - t0
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
    return total, spent[0]


def _timed(fn, barrier) -> float:
    barrier()
    seconds = time_call(fn)
    barrier()  # the slowest rank decides
    return seconds


def _ep_rank(ctx, points: list[Point], layers: tuple[str, ...], repeats: int, warmup: int, profile: bool,
             timeout_s: float) -> list[dict]:
    import torch.distributed as dist

    world, rank = ctx.world_size, ctx.rank
    threads = torch.get_num_threads()
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        ds_error = None
        if any(n.startswith("deepspeed") for n in layers):
            try:
                from moebench.parity.checks_deepspeed import group_timeout_s, new_groups_time_out_after
                from moebench.variants.deepspeed.comm import deepspeed_comm

                stack.enter_context(new_groups_time_out_after(group_timeout_s(timeout_s)))
                stack.enter_context(deepspeed_comm(ctx, compiled_ops=False, timeout_s=timeout_s))
            except Exception as e:  # noqa: BLE001 - the layer is reported skipped, with why
                ds_error = f"{type(e).__name__}: {e}"[:200]
        for p in points:
            base = {**dataclasses.asdict(p), "world_size": world, "threads_per_rank": threads,
                    "oversubscribed": oversubscribed(world), "device": ctx.device}
            fns, skipped = {}, {}
            g = torch.Generator().manual_seed(1000 + rank)
            x = torch.randn(1, p.tokens, p.d_model, generator=g).to(ctx.device).requires_grad_()
            for name in layers:
                if p.experts % world:
                    skipped[name] = f"{p.experts} experts do not split over {world} ranks"
                elif name.startswith("deepspeed") and ds_error:
                    skipped[name] = ds_error
                else:
                    layer = _build_ep_layer(name, p, world, rank).to(ctx.device)

                    def fn(m=layer):
                        y = m(x)[0]
                        y.backward(torch.ones_like(y))

                    fns[name] = fn
            peak = warm_up(fns, warmup)  # every rank calls (collectives); rank 0's peaks are reported
            times: dict[str, list[float]] = {n: [] for n in fns}
            for _ in range(repeats):
                for name, fn in fns.items():  # interleaved, as the one-process sweep
                    times[name].append(_timed(fn, dist.barrier))
            for name in layers:
                if name in skipped:
                    rows.append({**base, "layer": name, "skipped": skipped[name]})
                    continue
                m = statistics.median(times[name])
                row = {**base, "layer": name, "skipped": None, "time_s": m, "min_s": min(times[name]),
                       "max_s": max(times[name]), "repeats": len(times[name]), "tokens_per_s": world * p.tokens / m,
                       "gflops": world * p.flops / m / 1e9,
                       "peak_rss_mb": None if peak[name] is None else peak[name] / 2**20}
                if profile:  # every rank runs the profiled calls (collectives); rank 0's figures are kept
                    dist.barrier()
                    row.update(profile_shares(fns[name]))
                    dist.barrier()
                    wall, in_collectives = collective_seconds(fns[name])
                    row["comm_share"] = in_collectives / wall
                rows.append(row)
    return rows if rank == 0 else []


def run_expert_parallel(points: list[Point], world_sizes: list[int], layers: tuple[str, ...] = EP_LAYERS,
                        repeats: int = 3, warmup: int = 1, profile: bool = True, timeout_s: float = 900.0,
                        log=None) -> list[dict]:
    """Rows for every (world size, point, layer); `vs_world_1` is tokens/s over the W = 1 row's."""
    from moebench.distributed.launch import check, launch
    from moebench.models.deepspeed_moe import set_accelerator_env

    set_accelerator_env("cuda" if torch.cuda.is_available() else "cpu")
    release_memory()  # forked ranks start from this process's memory
    rows: list[dict] = []
    for world in world_sizes:
        signals.check()  # a safe point between launches (inside one, the launch's wait loop)
        if log:
            log(f"expert parallel on {world} rank(s)")
        result = check(launch(_ep_rank, world, args=(points, layers, repeats, warmup, profile, timeout_s),
                              timeout_s=timeout_s, label=f"bench expert-parallel W={world}"))
        rows += result.returns[0]
    single = {(r["layer"], r["experts"], r["tokens"], r["top_k"]): r["tokens_per_s"]
              for r in rows if r["world_size"] == 1 and not r["skipped"]}
    for r in rows:
        one = single.get((r["layer"], r["experts"], r["tokens"], r["top_k"]))
        r["vs_world_1"] = r["tokens_per_s"] / one if one and not r["skipped"] else None
    return rows


def _comm_rank(ctx, sizes: list[int], repeats: int, warmup: int) -> list[dict]:
    import torch.distributed as dist

    world = ctx.world_size
    rows = []
    for numel in sizes:
        numel -= numel % world  # equal splits
        send = torch.randn(numel, device=ctx.device)
        recv = torch.empty_like(send)
        for _ in range(warmup):
            dist.all_to_all_single(recv, send)
        times = [_timed(lambda: dist.all_to_all_single(recv, send), dist.barrier) for _ in range(repeats)]
        m = statistics.median(times)
        nbytes = numel * send.element_size()
        rows.append({"world_size": world, "backend": ctx.backend, "bytes_per_rank": nbytes, "time_s": m,
                     "min_s": min(times), "max_s": max(times), "repeats": len(times),
                     # what leaves each rank: (W-1)/W of its buffer (its own share stays)
                     "bytes_per_s": nbytes * (world - 1) / world / m,
                     "oversubscribed": oversubscribed(world)})
    return rows if ctx.rank == 0 else []


def comm_backends(world: int) -> list[str]:
    """gloo always; NCCL where this torch has it and there is a GPU per rank."""
    import torch.distributed as dist

    nccl = torch.cuda.is_available() and torch.cuda.device_count() >= world and dist.is_nccl_available()
    return ["gloo", "nccl"] if nccl else ["gloo"]


def run_comm(points: list[Point], world_sizes: list[int], repeats: int = 5, warmup: int = 1,
             timeout_s: float = 300.0, log=None) -> list[dict]:
    """All-to-all alone, at the sizes the points exchange (tokens x k x d_model fp32 per rank)."""
    from moebench.distributed.launch import check, launch

    sizes = sorted({p.tokens * p.top_k * p.d_model for p in points})
    rows: list[dict] = []
    for world in [w for w in world_sizes if w > 1]:
        for backend in comm_backends(world):
            if log:
                log(f"all-to-all on {world} {backend} rank(s)")
            result = check(launch(_comm_rank, world, args=(sizes, repeats, warmup), backend=backend,
                                  timeout_s=timeout_s, label=f"bench all-to-all W={world} {backend}"))
            rows += result.returns[0]
    return rows


__all__ = ["EP_LAYERS", "oversubscribed", "run_comm", "run_expert_parallel"]

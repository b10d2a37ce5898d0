"""`moebench bench`: forward + backward speed of one MoE layer against its compute bound.

Layers (each timed as forward + backward of one layer, same process, interleaved repeats):
- `ideal`: the routed slots (tokens x k), perfectly balanced, through per-expert GEMMs;
- `dense`: one GEMM pair of the same FLOPs (the machine's achievable bound);
- `reference`: moebench's FMoEReference (fastmoe-exact), routed by its own naive gate;
- `reference-balanced`: the same layer's code on `ideal`'s balanced routing (gate skipped);
- `deepspeed-cf1` / `deepspeed-cf2`: DeepSpeed's `MoE` at capacity factor 1.0 / 2.0;
- `fmoe`: the real fastmoe layer, where it imports (CUDA only);
- `grouped-mm`: the balanced slots through `torch._grouped_mm` (one call per matmul).

GFLOP/s counts the expert GEMMs only: 3 x 2 x tokens x k x d_model x d_hidden x 2 (two matmuls,
forward + two backward GEMMs each). Peak memory is what the first warm-up call adds to the
resident set at its peak (`peak_memory`): torch's CPU allocator keeps no statistics and
tracemalloc does not see its allocations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from moebench import signals

LAYERS = ("ideal", "dense", "reference", "reference-balanced", "deepspeed-cf1", "deepspeed-cf2", "fmoe", "grouped-mm")


@dataclasses.dataclass(frozen=True)
class Point:
    experts: int
    tokens: int
    top_k: int
    d_model: int
    d_hidden: int

    @property
    def flops(self) -> float:
        return 3 * 2 * self.tokens * self.top_k * self.d_model * self.d_hidden * 2


def balanced_counts(slots: int, experts: int) -> list[int]:
    base, extra = divmod(slots, experts)
    return [base + (1 if i < extra else 0) for i in range(experts)]


def balanced_routing(p: Point) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot s of token t goes to expert (t * k + s) mod E: every expert gets tokens * k / E slots
    (as `balanced_counts`), and a token's k slots go to k different experts. Scores: softmax of
    seeded noise."""
    idx = (torch.arange(p.tokens * p.top_k) % p.experts).reshape(p.tokens, p.top_k)
    score = torch.softmax(torch.randn(p.tokens, p.top_k, generator=torch.Generator().manual_seed(1)), -1)
    return idx, score


def expert_weights(p: Point, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
                   ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    s1, s2 = p.d_model ** -0.5, p.d_hidden ** -0.5
    w1 = (torch.rand(p.experts, p.d_hidden, p.d_model, generator=g) * 2 - 1) * s1
    b1 = torch.zeros(p.experts, p.d_hidden)
    w2 = (torch.rand(p.experts, p.d_model, p.d_hidden, generator=g) * 2 - 1) * s2
    b2 = torch.zeros(p.experts, p.d_model)
    return tuple(t.to(device, dtype).requires_grad_() for t in (w1, b1, w2, b2))


def per_expert_leaves(stacked: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], ...]:
    return tuple([t.detach()[e].clone().requires_grad_() for e in range(t.shape[0])] for t in stacked)


def per_expert_loop(slots: torch.Tensor, counts: list[int], w1, b1, w2, b2) -> torch.Tensor:
    """The `ideal` computation: expert e's contiguous slice through Linear-GELU-Linear."""
    outs = [F.linear(F.gelu(F.linear(chunk, w1[e], b1[e])), w2[e], b2[e])
            for e, chunk in enumerate(slots.split(counts))]
    return torch.cat(outs, 0)


def grouped_mm_experts(slots: torch.Tensor, counts: list[int], w1, b1, w2, b2) -> torch.Tensor:
    """Same as `per_expert_loop` with one grouped GEMM per matmul. torch 2.13 CPU needs: offs int32
    and cumulative (ends), every stride a multiple of 16 bytes, and a contiguous grad_output (an
    expanded one from `.sum().backward()` raises "Invalid strides/sizes ... [0, 0]")."""
    offs = torch.tensor(counts, dtype=torch.int32, device=slots.device).cumsum(0, dtype=torch.int32)
    ids = torch.repeat_interleave(torch.arange(len(counts), device=slots.device),
                                  torch.tensor(counts, device=slots.device))
    h = torch._grouped_mm(slots, w1.transpose(-2, -1), offs=offs) + b1[ids]
    return torch._grouped_mm(F.gelu(h), w2.transpose(-2, -1), offs=offs) + b2[ids]


def _backward(y: torch.Tensor) -> None:
    y.backward(torch.ones_like(y))  # contiguous grad (grouped_mm rejects expanded ones)


class _DeepSpeed:
    """DeepSpeed's comm on one in-process rank, opened once for the whole sweep."""

    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.error: str | None = None
        self.ready = False

    def open(self) -> None:
        if self.ready or self.error:
            return
        try:
            from moebench.models.deepspeed_moe import create_expert_groups, set_accelerator_env

            set_accelerator_env("cpu" if not torch.cuda.is_available() else "cuda")
            from moebench.distributed.launch import RankContext
            from moebench.variants.deepspeed.comm import deepspeed_comm

            ctx = RankContext(rank=0, world_size=1, local_rank=0, backend="none", device="cpu")
            self.stack.enter_context(deepspeed_comm(ctx, compiled_ops=False, timeout_s=120))
            create_expert_groups(1)
            self.ready = True
        except Exception as e:  # noqa: BLE001 - report why the layer is skipped
            self.error = f"{type(e).__name__}: {e}"[:200]

    def close(self) -> None:
        self.stack.close()


def build_layers(p: Point, layers: tuple[str, ...], ds: _DeepSpeed, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> tuple[dict[str, Callable], dict[str, str]]:
    """One zero-argument fwd+bwd callable per layer that can run; a skip reason for the rest. Every
    tensor and module is on `device` in `dtype` (gpu-check times CUDA in fp32 and bf16)."""
    torch.manual_seed(0)
    x = torch.randn(1, p.tokens, p.d_model).to(device, dtype)
    slots_n = p.tokens * p.top_k
    counts = balanced_counts(slots_n, p.experts)
    slots = x.reshape(-1, p.d_model).repeat_interleave(p.top_k, 0).detach().requires_grad_()
    fns: dict[str, Callable] = {}
    skipped: dict[str, str] = {}
    for name in layers:
        try:
            if name == "ideal":
                # One leaf per expert (as the reference's modules): indexing a stacked leaf would
                # make backward write a full [E, ...] zero gradient per expert (E^2 traffic).
                w = per_expert_leaves(expert_weights(p, device=device, dtype=dtype))
                fns[name] = lambda w=w: _backward(per_expert_loop(slots, counts, *w))
            elif name == "grouped-mm":
                if not hasattr(torch, "_grouped_mm"):
                    raise RuntimeError("torch._grouped_mm missing in this torch")
                w = expert_weights(p, device=device, dtype=dtype)
                _backward(grouped_mm_experts(slots, counts, *w))  # probe: raises if unsupported
                fns[name] = lambda w=w: _backward(grouped_mm_experts(slots, counts, *w))
            elif name == "dense":
                w = per_expert_leaves(expert_weights(dataclasses.replace(p, experts=1), device=device, dtype=dtype))
                fns[name] = lambda w=w: _backward(per_expert_loop(slots, [slots_n], *w))
            elif name == "reference":
                from moebench.models.moe import build_moe_mlp

                layer = build_moe_mlp(backend="reference", experts=p.experts, d_model=p.d_model,
                                      d_hidden=p.d_hidden, top_k=p.top_k, gate="naive").to(device, dtype)
                xr = x.clone().requires_grad_()
                fns[name] = lambda m=layer, xr=xr: _backward(m(xr)[0])
            elif name == "reference-balanced":
                # The reference layer's own code (sort, scatter, expert loop, weighted gather) on
                # ideal's balanced routing: its overhead over `ideal` without the gate's imbalance.
                from moebench.models.moe import build_moe_mlp

                layer = build_moe_mlp(backend="reference", experts=p.experts, d_model=p.d_model,
                                      d_hidden=p.d_hidden, top_k=p.top_k, gate="naive").to(device, dtype)
                idx, score = (t.to(device) for t in balanced_routing(p))
                xr = x.reshape(-1, p.d_model).clone().requires_grad_()
                fns[name] = lambda m=layer, xr=xr: _backward(m.moe_forward(xr, idx, score))
            elif name.startswith("deepspeed-cf"):
                ds.open()
                if ds.error:
                    raise RuntimeError(ds.error)
                from moebench.models.deepspeed_moe import DeepSpeedMoEMLP
                from moebench.variants.deepspeed.config import DeepSpeedMoEConfig

                cf = float(name.removeprefix("deepspeed-cf"))
                cfg = DeepSpeedMoEConfig(experts=(p.experts,), d_hidden=p.d_hidden, top_k=p.top_k,
                                         capacity_factor=cf, eval_capacity_factor=cf, min_capacity=0,
                                         noisy_gate_policy="none", use_residual=False, drop_tokens=True,
                                         use_rts=False, ep_size=1)
                layer = DeepSpeedMoEMLP(cfg, d_model=p.d_model, experts=p.experts, seed=0,
                                        top2_2nd_expert_sampling=False).to(device, dtype)
                xr = x.clone().requires_grad_()
                fns[name] = lambda m=layer, xr=xr: _backward(m(xr)[0])
            elif name == "fmoe":
                if not torch.cuda.is_available():
                    raise RuntimeError("no CUDA GPU; fastmoe's kernels are CUDA-only")
                if not str(device).startswith("cuda"):
                    raise RuntimeError(f"fastmoe's kernels are CUDA-only and this sweep runs on {device}")
                import fmoe  # noqa: F401

                from moebench.models.moe import build_moe_mlp

                layer = build_moe_mlp(backend="fmoe", experts=p.experts, d_model=p.d_model,
                                      d_hidden=p.d_hidden, top_k=p.top_k, gate="naive",
                                      device="cuda").to(device, dtype)
                xr = x.clone().requires_grad_()
                fns[name] = lambda m=layer, xr=xr: _backward(m(xr)[0])
            else:
                raise ValueError(f"unknown layer {name!r}")
        except Exception as e:  # noqa: BLE001 - a layer that cannot run is reported, not fatal
            skipped[name] = f"{type(e).__name__}: {e}"[:200]
    return fns, skipped


def release_memory() -> None:
    """Hand freed memory back to the OS. glibc keeps what a point's tensors freed in its arenas
    (measured: 4.2 GB resident after one E=64, T=8192 point, 0.4 GB after malloc_trim), and ranks
    forked later would start from that, enough for the OOM killer at 4 ranks."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _high_water() -> int | None:
    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None


def peak_memory(fn: Callable) -> int:
    """Bytes `fn` adds to the resident set at its peak. On Linux the kernel's high-water mark is
    reset first (/proc/self/clear_refs "5") after freed memory went back to the OS, so the peak
    inside the call counts; elsewhere only the RSS after the call is seen (a lower bound)."""
    release_memory()
    base = _rss()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    fn()
    top = _high_water()
    return max(0, (top if top is not None else _rss()) - base)


def warm_up(fns: dict[str, Callable], warmup: int) -> dict[str, int | None]:
    """Call each layer `warmup` times; the first call measures its peak memory (None without one)."""
    peak: dict[str, int | None] = dict.fromkeys(fns)
    for name, fn in fns.items():
        for i in range(max(warmup, 0)):
            if i == 0:
                peak[name] = peak_memory(fn)
            else:
                fn()
    return peak


def time_call(fn: Callable) -> float:
    if torch.cuda.is_available():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000.0
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm"})
GROUPS = ("gemm", "gate_topk", "sort_dispatch", "combine", "activation", "comm", "other")
_GROUP_OF = {
    **{k: "gate_topk" for k in ("aten::topk", "aten::softmax", "aten::_softmax")},
    **{k: "sort_dispatch" for k in ("aten::sort", "aten::argsort", "aten::bincount", "aten::index_select",
                                    "aten::where", "aten::index_select_backward", "aten::split_with_sizes",
                                    "aten::_local_scalar_dense")},
    **{k: "combine" for k in ("aten::index_copy", "aten::index_copy_", "aten::cat", "aten::zeros",
                              "aten::new_zeros", "aten::index_add_", "aten::fill_", "aten::zero_")},
}


def profile_shares(fn: Callable) -> dict:
    """torch.profiler over one call of `fn` (already warmed up): self CPU time of the aten ops and
    the collectives, grouped into GEMMs (mm / addmm / bmm), gate, sort/dispatch, combine, GELU,
    communication (c10d:: ops: the time a rank waits in all-to-all / all-gather) and the rest."""
    from torch.profiler import ProfilerActivity, profile

    from moebench.console import stderr_to_devnull

    # torch's profiler (kineto) prints "USDT: ... profiler_start/stop" from C++, with no setting to stop it.
    with stderr_to_devnull(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    groups = dict.fromkeys(GROUPS, 0.0)
    for ev in prof.key_averages():
        k = ev.key
        if k.startswith("c10d::"):
            group = "comm"
        elif not k.startswith("aten::"):
            continue
        elif k in GEMM_OPS:
            group = "gemm"
        elif "gelu" in k:
            group = "activation"
        else:
            group = _GROUP_OF.get(k, "other")
        groups[group] += ev.self_cpu_time_total
    total = sum(groups.values()) or 1.0
    return {"total_ms": total / 1000.0, "share": {k: v / total for k, v in groups.items()},
            "outside_gemm": 1.0 - groups["gemm"] / total}


def reference_breakdown(p: Point) -> dict:
    """The profiler's shares for one fwd+bwd of the reference layer at point `p`."""
    fns, _ = build_layers(p, ("reference",), _DeepSpeed())
    fns["reference"]()  # warm-up: first-call allocations are not the layer's cost
    return {"point": dataclasses.asdict(p), **profile_shares(fns["reference"])}


def run_sweep(points: list[Point], layers: tuple[str, ...] = LAYERS, repeats: int = 3, warmup: int = 1,
              profile: bool = True, log: Callable[[str], None] | None = None) -> dict:
    """Time every layer at every point; rows carry medians, spreads and same-process ratios."""
    ds = _DeepSpeed()
    rows, breakdown = [], []
    device = "cuda" if torch.cuda.is_available() else "cpu"  # what each row's "device" says (and time_call times)
    try:
        for p in points:
            signals.check()  # a safe point between points
            if log:
                log(f"E={p.experts} T={p.tokens} k={p.top_k} d={p.d_model}/{p.d_hidden}")
            fns, skipped = build_layers(p, layers, ds, device=device)
            peak = warm_up(fns, warmup)
            times: dict[str, list[float]] = {n: [] for n in fns}
            for _ in range(max(repeats, 1)):
                for name, fn in fns.items():  # interleaved: every layer once per repeat
                    times[name].append(time_call(fn))
            med = {n: statistics.median(t) for n, t in times.items()}
            for name in layers:
                row = {"layer": name, **dataclasses.asdict(p), "threads": torch.get_num_threads(), "device": device}
                if name in skipped:
                    rows.append({**row, "skipped": skipped[name]})
                    continue
                m = med[name]
                row.update({"time_s": m, "min_s": min(times[name]), "max_s": max(times[name]),
                            "repeats": len(times[name]),
                            "tokens_per_s": p.tokens / m, "gflops": p.flops / m / 1e9,
                            "peak_rss_mb": None if peak[name] is None else peak[name] / 2**20, "skipped": None})
                for ref, key in (("ideal", "vs_ideal"), ("dense", "vs_dense"), ("deepspeed-cf1", "vs_deepspeed_cf1")):
                    row[key] = med[ref] / m if ref in med else None
                rows.append(row)
            if profile and "reference" in fns:
                breakdown.append(reference_breakdown(p))
            del fns
            release_memory()
    finally:
        ds.close()
    return {"rows": rows, "breakdown": breakdown, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "memory_method": "resident-set high-water of the first warm-up call over its start (VmHWM reset)",
            "grouped_mm_requirements": grouped_mm_experts.__doc__.split("torch 2.13 CPU needs: ")[-1].strip()}

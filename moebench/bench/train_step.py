"""`moebench bench --train`: one full training step of each variant's preset, phase by phase.

Phases: data (the batch the run trains on), forward (to the loss), backward, optimizer (update and
clear the gradients). Each phase gets the bound that applies:
- forward and backward: their matmul FLOPs (counted by torch's FlopCounterMode on one step) at
  the GEMM rate this machine reaches on one large dense matmul;
- optimizer: the bytes Adam must move, ADAM_BYTES_PER_PARAM per trainable element, at the memory
  bandwidth (the faster of an in-place add and torch's fused Adam over one flat 256 MB buffer);
- data: the batch's bytes, read and written once, at that bandwidth.
`x_bound` is time / bound: 1.0 is as fast as this machine can do that work.
"""

from __future__ import annotations

import statistics
import time

import torch

from moebench import signals

PHASES = ("data", "forward", "backward", "optimizer")
ADAM_BYTES_PER_PARAM = 28
"""Adam reads weight, gradient, exp_avg and exp_avg_sq and writes weight, exp_avg and exp_avg_sq:
7 fp32 streams of 4 bytes per element. The fused kernel does exactly this; others move more."""
BANDWIDTH_ELEMENTS = 64 * 2**20
"""fp32 elements per operand of the bandwidth probe: 256 MB each, far beyond any CPU cache."""
GEMM_SIZE = 2048
"""The peak-rate probe multiplies two GEMM_SIZE-square fp32 matrices (17 GFLOP)."""


def _best(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bandwidth_probes() -> dict[str, float]:
    """Bytes/s of two streaming kernels over 256 MB operands, both in place like Adam's update:
    `a += b` (two reads, one write per element) and torch's fused Adam on one flat buffer (28 bytes
    per element). Which is faster varies here (add 43-51 GB/s; fused Adam 51 GB/s on 256 MB, 85 GB/s
    once on 1 GB), so the faster of the two is the bound. (An out-of-place add reads its fresh
    output before writing it, write-allocate, and would understate the bandwidth further.)"""
    a, b = torch.rand(BANDWIDTH_ELEMENTS), torch.rand(BANDWIDTH_ELEMENTS)
    add = 3 * 4 * BANDWIDTH_ELEMENTS / _best(lambda: a.add_(b))
    flat = torch.nn.Parameter(a)
    flat.grad = b
    adam = torch.optim.Adam([flat], lr=1e-3, fused=True)
    return {"add_": add, "adam_fused": ADAM_BYTES_PER_PARAM * BANDWIDTH_ELEMENTS / _best(adam.step)}


def gemm_rate() -> float:
    """FLOP/s of one large fp32 matmul: what the step's GEMMs could reach here."""
    a, b = torch.randn(GEMM_SIZE, GEMM_SIZE), torch.randn(GEMM_SIZE, GEMM_SIZE)
    return 2 * GEMM_SIZE**3 / _best(lambda: a @ b)


def _count_cpu_attention() -> None:
    """torch 2.13's FlopCounterMode has formulas for the CUDA attention kernels only: on CPU the
    attention's two matmuls (scores and values) would count as 0. Register the same formulas for
    the CPU flash kernel, once."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is None or forward in fc.flop_registry:
        return

    @fc.register_flop_formula(forward)
    def _forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(query, key, value)  # shapes: the decorator passes shapes

    if backward is not None:
        @fc.register_flop_formula(backward)
        def _backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
            return fc.sdpa_backward_flop_count(grad_out, query, key, value)


def _flops(fn) -> tuple[object, int]:
    from torch.utils.flop_counter import FlopCounterMode

    _count_cpu_attention()
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return out, counter.get_total_flops()


def breakdown(variant, config, *, steps: int = 3, warmup: int = 1, rates: dict) -> dict:
    """Median seconds per phase over `steps` steps after `warmup` whole steps, with the bounds."""
    times = {phase: [] for phase in PHASES}
    with variant.step_parts(config) as parts:
        batch = parts.data(0)
        batch_bytes = sum(t.numel() * t.element_size() for t in batch)
        loss, forward_flops = _flops(lambda: parts.forward(batch))
        _, backward_flops = _flops(lambda: parts.backward(loss))
        parts.optimizer()
        for step in range(1, warmup + steps + 1):
            marks = [time.perf_counter()]
            batch = parts.data(step)
            marks.append(time.perf_counter())
            loss = parts.forward(batch)
            marks.append(time.perf_counter())
            parts.backward(loss)
            marks.append(time.perf_counter())
            parts.optimizer()
            marks.append(time.perf_counter())
            if step > warmup:
                for phase, t0, t1 in zip(PHASES, marks, marks[1:]):
                    times[phase].append(t1 - t0)
        trainable, optimizer_name = parts.trainable_params, parts.optimizer_name
    work = {"data": (2 * batch_bytes, "bytes"), "forward": (forward_flops, "flop"),
            "backward": (backward_flops, "flop"), "optimizer": (ADAM_BYTES_PER_PARAM * trainable, "bytes")}
    phases = []
    for phase in PHASES:
        amount, unit = work[phase]
        bound = amount / (rates["gemm_flop_per_s"] if unit == "flop" else rates["memory_bytes_per_s"])
        median = statistics.median(times[phase])
        phases.append({"phase": phase, "time_s": median, "min_s": min(times[phase]), "max_s": max(times[phase]),
                       "work": amount, "unit": unit, "bound_s": bound, "x_bound": median / bound if bound else None})
    step_s = sum(p["time_s"] for p in phases)
    for p in phases:
        p["share"] = p["time_s"] / step_s
    return {"variant": variant.name, "preset": config.preset, "steps": steps, "warmup": warmup,
            "trainable_params": trainable, "optimizer": optimizer_name,
            "tokens_per_step": config.train.tokens_per_step, "step_s": step_s, "phases": phases}


def run_train(preset: str = "chapter", *, steps: int = 3, warmup: int = 1, log=None) -> dict:
    """The breakdown for every registered variant's `preset`, with the machine's measured rates."""
    from moebench import variants

    probes = bandwidth_probes()
    rates = {"gemm_flop_per_s": gemm_rate(), "memory_bytes_per_s": max(probes.values()),
             "bandwidth_probes": probes, "threads": torch.get_num_threads()}
    out = []
    for variant in variants.VARIANTS:
        signals.check()  # a safe point between presets
        if log:
            log(f"training step: {variant.name} --preset {preset}")
        config = variants.resolve_config(variant, preset, {})
        out.append(breakdown(variant, config, steps=steps, warmup=warmup, rates=rates))
    return {"rates": rates, "variants": out}

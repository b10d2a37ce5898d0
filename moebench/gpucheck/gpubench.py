"""gpu-check's bench step: one MoE layer on the GPU, in fp32 (TF32 off) and bf16.

    python -m moebench.gpucheck.gpubench [--device cuda]

The layers of `moebench bench` (moebench.bench.layers: `ideal` per-expert GEMMs, `dense` one GEMM
of the same FLOPs, `reference`, DeepSpeed at capacity factors 1 and 2, real `fmoe`,
`torch._grouped_mm`) at the chapter's MoE layer (32 experts, d_model 1024, d_hidden 4096, top-2)
with a GPU-sized batch, forward + backward, timed with CUDA events, interleaved repeats, medians.
Each row: TFLOP/s of the expert GEMMs, the fraction of the device's datasheet peak for the dtype
(moebench.gpucheck.peaks), and the ratio to `ideal` and `dense`. A layer that cannot run (fmoe not
built, grouped GEMM not supported for the dtype) is a row with its reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch

from moebench.bench.layers import Point, _DeepSpeed, build_layers, time_call
from moebench.gpucheck import peaks

LAYERS = ("ideal", "dense", "reference", "grouped-mm", "deepspeed-cf1", "deepspeed-cf2", "fmoe")
POINT = Point(experts=32, tokens=8192, top_k=2, d_model=1024, d_hidden=4096)
"""The chapter's MoE layer (fastmoe's FMoETransformerMLP defaults) on 8192 tokens: 0.82 TFLOP per
forward + backward, ~15 ms at an H100's fp32 peak, so each timing is far above launch overheads."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WARMUP = 2
REPEATS = 5


def measure(point: Point = POINT, *, device: str = "cuda", layers: tuple[str, ...] = LAYERS,
            dtypes: dict[str, torch.dtype] = DTYPES, warmup: int = WARMUP, repeats: int = REPEATS) -> dict:
    """Every layer in every dtype at `point`: the rows described in the module docstring."""
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    peak = peaks.peak_for(name)
    ds = _DeepSpeed()
    rows = []
    try:
        for label, dtype in dtypes.items():
            fns, skipped = build_layers(point, layers, ds, device=device, dtype=dtype)
            times: dict[str, list[float]] = {n: [] for n in fns}
            for fn in fns.values():
                for _ in range(warmup):
                    fn()
            for _ in range(repeats):
                for layer, fn in fns.items():  # interleaved
                    times[layer].append(time_call(fn))
            med = {n: statistics.median(t) for n, t in times.items()}
            for layer in layers:
                row = {"layer": layer, "dtype": label, **dataclasses.asdict(point)}
                if layer in skipped or layer not in med:
                    rows.append({**row, "skipped": skipped.get(layer, "did not run")})
                    continue
                tflops = point.flops / med[layer] / 1e12
                rows.append({**row, "skipped": None, "time_s": med[layer], "min_s": min(times[layer]),
                             "max_s": max(times[layer]), "tflops": tflops,
                             "peak_fraction": peaks.fraction(tflops, name, label),
                             "vs_ideal": med["ideal"] / med[layer] if "ideal" in med else None,
                             "vs_dense": med["dense"] / med[layer] if "dense" in med else None})
            del fns
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    finally:
        ds.close()
    return {"device": name, "torch": torch.__version__, "peak": dataclasses.asdict(peak) if peak else None,
            "flop_per_call": point.flops, "warmup": warmup, "repeats": repeats, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moebench.gpucheck.gpubench")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 rows are fp32 (the peak they are judged on)
        torch.backends.cudnn.allow_tf32 = False
    doc = measure(device=args.device)
    print(json.dumps(doc, default=str))
    ran = [r for r in doc["rows"] if not r["skipped"]]
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())

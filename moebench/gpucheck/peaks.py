"""Peak dense throughput of the GPUs gpu-check is likely to meet, from their vendors' datasheets.

fp32 is the CUDA-core rate (gpu-check times fp32 with TF32 off, so the tensor cores' TF32 rate
does not apply); bf16 is the dense tensor-core rate (no structured sparsity). Boost clocks: a
measured fraction is of the datasheet's number, not of what the card sustains under its power cap.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Peak:
    fp32_tflops: float
    bf16_tflops: float
    source: str


# Matched in order against torch.cuda.get_device_name(), case-insensitive: the first key found in
# the name wins (so "h100 pcie" is tried before "h100").
PEAKS: tuple[tuple[str, Peak], ...] = (
    ("h200", Peak(67.0, 989.4, "NVIDIA H200 datasheet (SXM): FP32 67 TFLOPS, BF16 989 TFLOPS dense")),
    ("h100 pcie", Peak(51.2, 756.5, "NVIDIA H100 datasheet (PCIe): FP32 51 TFLOPS, BF16 756 TFLOPS dense")),
    ("h100 nvl", Peak(60.0, 835.0, "NVIDIA H100 datasheet (NVL): FP32 60 TFLOPS, BF16 835 TFLOPS dense")),
    ("h100", Peak(67.0, 989.4, "NVIDIA H100 datasheet (SXM): FP32 67 TFLOPS, BF16 989 TFLOPS dense")),
    ("a100", Peak(19.5, 312.0, "NVIDIA A100 datasheet: FP32 19.5 TFLOPS, BF16 312 TFLOPS dense")),
    ("l40s", Peak(91.6, 362.1, "NVIDIA L40S datasheet: FP32 91.6 TFLOPS, BF16 362 TFLOPS dense")),
    ("rtx 4090", Peak(82.6, 165.2, "NVIDIA Ada whitepaper (RTX 4090): FP32 82.6, BF16 (FP32 accumulate) 165 TFLOPS")),
    ("rtx 3090", Peak(35.6, 71.0, "NVIDIA Ampere GA102 whitepaper (RTX 3090, the chapter's GPU): FP32 35.6, "
                                  "BF16 (FP32 accumulate) 71 TFLOPS")),
)


def peak_for(device_name: str) -> Peak | None:
    """The datasheet peak of `device_name` (None for a GPU not in the table: fractions are then not given)."""
    name = device_name.lower()
    return next((peak for key, peak in PEAKS if key in name), None)


def fraction(tflops: float | None, device_name: str, dtype: str) -> float | None:
    """`tflops` as a fraction of the device's `dtype` ("fp32" / "bf16") peak."""
    peak = peak_for(device_name)
    if peak is None or tflops is None:
        return None
    return tflops / (peak.fp32_tflops if dtype == "fp32" else peak.bf16_tflops)

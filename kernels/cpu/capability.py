"""What torch's own CPU kernels do well on this machine: the one place serving's weight packing (and so batch
invariance) and calibration's compute dtype ask."""

from __future__ import annotations

import torch


def onednn_bf16() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT). Without them torch's bf16
    GEMM runs a portable path: on an AVX2-only EPYC, 3.6-5.6x slower than fp32 at 64 rows, though 2.4-3x faster
    at one row, where half the weight bytes count (bench/cpu_dtype.py, BENCHMARKS.md ninth session)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()

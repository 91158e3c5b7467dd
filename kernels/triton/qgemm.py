# qgemm - x [..., K] fp16/bf16 @ W'.T (QTensor W' [N, K], 4/8-bit) -> [..., N], x.dtype; dispatch by M tokens
"""The interface QLinear calls on CUDA:

    prepared = prepare(qt)                  # once at load: repack into the kernels' layout (repack.py)
    y = matmul(x, prepared, bias=None)      # every forward

M = number of rows of x (tokens). Decode is memory-bound: the packed weight must stream at full bandwidth, which
takes many programs per column tile (split-K). Prefill is compute-bound: cuBLAS on a dequantized copy wins once
the one-off dequantize is amortised over enough rows. In between, a tiled dequant-GEMM reads 4x/2x fewer bytes
than fp16 and still feeds the tensor cores.

  M <= GEMV_MAX_M                 dequant_gemv   split-K, one launch, tl.dot on 16-, 32- or 64-row tiles: every
                                                 decode batch bucket up to 64
  GEMV_MAX_M < M < DEQUANT_MIN_M  dequant_gemm   tiled, grouped program order
  M >= DEQUANT_MIN_M              dequantize -> torch.matmul (cuBLAS)

`python bench/gpu_kernels.py` times all three paths at M = 1..4096 on Llama shapes and prints the first M where
the next path is faster, with the constants it implies. GEMV_MAX_M = 64 is the largest M the GEMV kernel accepts
(its 64-row tiles; at 64 rows the tiled GEMM leaves most SMs idle on a 4096-wide layer without split-K);
DEQUANT_MIN_M = 512 is the published crossover of Triton W4A16 GEMMs against cuBLAS fp16 on A100/H100 (gemlite,
vLLM's awq_triton), to be confirmed on the integrator's GPU with the bench script and updated here with its output.
"""

from __future__ import annotations

import torch

from .dequant_gemm import dequant_gemm
from .dequant_gemv import GEMV_MAX_M, dequant_gemv, reserve_workspace
from .dequantize import dequant_matmul_ref, dequantize
from .repack import PackedWeight, repack

DEQUANT_MIN_M = 512  # first M that dequantizes once and calls cuBLAS (see module docstring)

Prepared = PackedWeight


def prepare(qt) -> Prepared:
    """QTensor (on the target device) -> Prepared: packed once; reserves the device's split-K workspace."""
    pw = repack(qt)
    reserve_workspace(pw.device, pw.out_features)
    return pw


def kernel_for(m: int, dtype: torch.dtype = torch.float16) -> str:
    """Name of the path `matmul` takes for M rows of `dtype`: 'gemv', 'gemm' or 'dequant' (always for fp32:
    tl.dot would round fp32 operands to tf32)."""
    if dtype == torch.float32:
        return "dequant"
    if m <= GEMV_MAX_M:
        return "gemv"
    return "gemm" if m < DEQUANT_MIN_M else "dequant"


def matmul(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp16/bf16/fp32 -> x @ W'.T + bias, [..., N] in x.dtype (fp32 accumulation on every path)."""
    k, n = prepared.in_features, prepared.out_features
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, the weight expects {k}"
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*x.shape[:-1], n))
    path = kernel_for(m, x.dtype)
    if path == "gemv":
        y = dequant_gemv(x2, prepared, bias)
    elif path == "gemm":
        y = dequant_gemm(x2, prepared, bias)
    else:
        w = dequantize(prepared, x.dtype)  # [K, N]
        y = torch.addmm(bias, x2, w) if bias is not None else x2 @ w
    return y.reshape(*x.shape[:-1], n)


def matmul_ref(x: torch.Tensor, prepared: Prepared, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch `matmul`: fp32 x @ dequantized weight (+ bias), cast to x.dtype."""
    k, n = prepared.in_features, prepared.out_features
    return dequant_matmul_ref(x.reshape(-1, k), prepared, bias).reshape(*x.shape[:-1], n)

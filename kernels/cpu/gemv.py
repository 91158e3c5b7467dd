"""W4/W8 GEMV for decode-sized calls (1 to MAX_ROWS rows) on AVX-512 BF16 and AVX2 CPUs (gemv.c, built once by
build.py): y = x @ dequantize(W)^T with x and y bf16, streaming the weight once per call. The AVX2 build does the
AVX-512 build's arithmetic lane for lane, in two 8-lane halves of each 16-column block: the same bits.

Weight: gemm.py's pack_quantized layout, the very tensors QLinear already holds for the AMX GEMM (no second copy):
  codes  4-bit: uint8 [N/16, K/2, 16]  byte = q[n, 2r] | q[n, 2r + 1] << 4;  8-bit: uint16 (int16) q | q' << 8
  qparams fp16 [N/16, G, 2, 16]        (scale, zero) per column and group, 64 bytes per block and group
A 16-column block's codes are one run of K * 8 (4-bit) or K * 16 bytes, its r-th 16 (32) bytes the codes of
k = 2r, 2r + 1 of the 16 columns: one 512-bit load widens to a lane per column. Bytes per weight at group 64:
0.5625 (4-bit), 1.0625 (8-bit).

Math per column n, group g of gs columns of K, row m (U = 16 for 4-bit, 256 for 8-bit):
  y[m, n] = sum_g s[n, g] * (U * acc[m, n, g] - (U + z[n, g]) * X[m, g]),
  acc = sum_{k in g} x[m, k] * (1 + q[n, k] / U),  X = sum_{k in g} x[m, k]
1 + q / U is q's bits under the exponent of 1.0 (4-bit: q << 19 | 0x3F800000), exact, two integer operations
per 16 codes; fp32 FMAs sum it against x in fp32 (exact from bf16), two chains (even and odd k) per row and
block; scale and zero are the fp16 values widened. This is dequantize(qt, float32)'s w = s * (q - z) regrouped:
the fp32 result differs from the fp32 reference matmul only by accumulation order and the cancellation of the
U terms (tests/kernels/test_cpu_gemv.py bounds both); the one rounding to bf16 is the last step (nearest even).
act: the blocks alternate gate and up; each product is rounded to bf16, then silu(gate) * up in fp32 (silu.h)
and rounded again, as gemm.py's epilogue and fused.py's silu_mul do.

Threads: OpenMP over pairs of 16-column blocks, static schedule (torch's thread count); each output column is one
thread's sum, so results do not depend on the thread count. The act-order permutation applies to x first
(matmul), bias is the caller's. x's fp32 copy and group sums are made once per call, before the threads start.
"""

from __future__ import annotations

import ctypes

import torch

from quantkit.kernels.cpu.build import load_library
from quantkit.kernels.cpu.gemm import _check_quantized, _check_x, matmul_bf16_ref, run_quantized
from quantkit.quant.scheme import QTensor, dequantize, in_group_order

MAX_ROWS = 4  # gemv.c's MAX_M: rows of x per call
_P, _INT, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SIGNATURES = {"qgemv": [_P, _INT, _INT, _P, _I64, _P, _I64, _INT, _INT, _INT, _P, _INT, _INT]}
_lib = None


def _library():
    """The compiled kernel, or None without AVX2 + FMA + F16C (AVX512-BF16 CPUs have them too) or a compiler."""
    global _lib
    if _lib is None:
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line.split() for line in f if line.startswith("flags")), [])
        except OSError:
            flags = []
        _lib = (load_library("gemv", SIGNATURES) if {"avx2", "fma", "f16c"} <= set(flags) else None) or False
    return _lib or None


def available() -> bool:
    return _library() is not None


# qgemv - x [M, K] bf16 contiguous (1 <= M <= 4), pack_quantized's weight of N columns -> y [M, N] bf16
#         ([M, N/2] with act)
def qgemv(x: torch.Tensor, packed, bits: int, act: bool = False) -> torch.Tensor:
    """y = x @ dequantize(W)^T (act: silu(gate) * up of the alternating gate/up blocks)."""
    _check_x(x, _check_quantized(packed, bits))
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"qgemv takes 1 to {MAX_ROWS} rows, got {x.shape[0]}")
    return run_quantized(_library().qgemv, x, packed, bits, act)


# matmul - x [M, K] bf16 (M <= 4), perm int64 [K] or None, pack_quantized's weight of N columns -> y [M, N] bf16
def matmul(x: torch.Tensor, perm: torch.Tensor | None, packed, bits: int, act: bool = False) -> torch.Tensor:
    """qgemv through gemm.prepare's (perm, packed): the act-order permutation first puts x's columns in group
    order, as gemm.matmul_packed does."""
    return qgemv(in_group_order(x, perm), packed, bits, act)


# qgemv_ref - x [M, K] bf16, QTensor [N, K] -> [M, N] fp32 ([M, N/2] with act)
def qgemv_ref(x: torch.Tensor, qt: QTensor, act: bool = False) -> torch.Tensor:
    """The fp32 matmul with the format's fp32 dequantization, before the kernel's rounding to bf16. act: qt's
    16-row blocks alternate gate and up; both products are rounded to bf16, then silu(gate) * up in fp32."""
    return matmul_bf16_ref(x, dequantize(qt, torch.float32), act)  # its math takes an fp32 weight as it is

"""Row-invariant bf16 GEMM for batch-invariant CPU serving (rowwise_gemm.c, built once by build.py):
y = x @ W^T (+ bias) with x and y bf16, fp32 accumulation, on any CPU with a C compiler (AVX-512 BF16 where the
CPU has it, plain C with the same order otherwise).

Invariant (what serving relies on): row m of the result depends only on row m of x and on W, bit for bit, whatever
M, the other rows, the thread count or the call (decode, prefill chunk, speculative verify). Each output element
is one fp32 chain over the K/2 pairs of K in order from 0, then the bias in fp32, then one rounding to bf16; K is
never split and no reduction spans rows. oneDNN, by contrast, picks its kernel and K blocking by M.

Weight: gemm.py's VNNI layout (`pack_bf16`, pure torch, no AMX needed): int32 [N/16, K/2, 16], element [b, r, n]
= bf16 W[16b + n, 2r] | W[16b + n, 2r + 1] << 16, or a view of whole blocks of one (any stride between blocks).
Register blocks of 4 rows x 4 column blocks (16 accumulators); threads split (64-column panel, 64-row chunk)
items. act: the blocks alternate gate and up, and the result is silu(bf16(gate)) * bf16(up) [M, N/2] (fused.py's
silu_mul arithmetic), so FusedLinear's gate/up epilogue runs here too.
"""

from __future__ import annotations

import ctypes

import torch

from quantkit.kernels.cpu.build import load_library
from quantkit.kernels.cpu.gemm import _check_vnni, _check_x, _out_columns, matmul_bf16_ref

_P, _INT, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SIGNATURES = {"rowwise_gemm": [_P, _INT, _INT, _P, _I64, _INT, _P, _P, _INT, _INT]}


def _library():
    return load_library("rowwise_gemm", SIGNATURES)


def available() -> bool:
    return _library() is not None


def vectorised() -> bool:
    """Whether the build runs the AVX-512 BF16 kernel (False: the portable C one, several times slower)."""
    return available() and bool(_library().rowwise_gemm_avx512bf16())


# matmul - x [M, K] bf16 contiguous, packed int32 [N/16, K/2, 16], bias bf16 [N] or None -> y [M, N] bf16
#          ([M, N/2] with act)
def matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, act: bool = False) -> torch.Tensor:
    """y = x @ W^T + bias with a pack_bf16 weight (or a view of whole blocks of one); act as the module docstring."""
    _check_x(x, _check_vnni(packed))
    m, k = x.shape
    n = packed.shape[0] * 16
    if bias is not None and (act or bias.dtype is not torch.bfloat16 or bias.shape != (n,)
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous bfloat16 [{n}] and comes without act; got {tuple(bias.shape)} "
                         f"{bias.dtype} (act {act})")
    y = torch.empty(m, _out_columns(n, act), dtype=torch.bfloat16)
    if m:
        _library().rowwise_gemm(x.data_ptr(), m, k, packed.data_ptr(), packed.stride(0), n,
                                None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads(),
                                act)
    return y


# matmul_ref - x [M, K] bf16, w [N, K] bf16, bias [N] or None -> [M, N] fp32 ([M, N/2] with act)
def matmul_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, act: bool = False) -> torch.Tensor:
    """matmul(x, pack_bf16(w), bias, act) before its rounding to bf16 (the fp32 matmul; act as gemm.py's ref)."""
    y = matmul_bf16_ref(x, w, act)
    return y if bias is None else y + bias.float()

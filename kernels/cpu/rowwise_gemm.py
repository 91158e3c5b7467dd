"""Row-invariant bf16 GEMM for batch-invariant CPU serving (rowwise_gemm.c, built once by build.py):
y = x @ W^T (+ bias) with x and y bf16, fp32 accumulation, on any CPU with a C compiler (AVX-512 BF16 where the
CPU has it, else AVX2 + FMA, else plain C; each its own fixed order). On AVX2 CPUs, where oneDNN has no bf16
kernels and torch's bf16 GEMM runs a portable path, it is bf16 serving's GEMM in every mode (serve/cpu_linear.py).

Invariant (what serving relies on): row m of the result depends only on row m of x and on W, bit for bit, whatever
M, the other rows, the thread count or the call (decode, prefill chunk, speculative verify). Each output element
is one fp32 chain over the K/2 pairs of K in order from 0, then the bias in fp32, then one rounding to bf16; K is
never split and no reduction spans rows. oneDNN, by contrast, picks its kernel and K blocking by M.

Weight: gemm.py's VNNI layout (`pack_bf16`, pure torch, no AMX needed): int32 [N/16, K/2, 16], element [b, r, n]
= bf16 W[16b + n, 2r] | W[16b + n, 2r + 1] << 16, or a view of whole blocks of one (any stride between blocks).
Register blocks of 4 rows x 4 column blocks (16 accumulators); threads split (64-column panel, 64-row chunk)
items. act: the blocks alternate gate and up, and the result is silu(bf16(gate)) * bf16(up) [M, N/2] (fused.py's
silu_mul arithmetic), so FusedLinear's gate/up epilogue runs here too.

W4/W8 (`qmatmul`, AVX-512 BF16 and AVX2 builds): gemm.py's quantized packing, each 64-column panel dequantized to
bf16 once per call into a thread's buffer (dequant.h, as dequantize(qt, bfloat16) rounds), then the same chains: the
result is `matmul` of the dequantized weight bit for bit. It serves QLinear's calls of 5 rows and more on CPUs
without AMX (qlinear.packed_kernel), where torch's per-row int4 kernels cost as much per row as the GEMV.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from quantkit.kernels.cpu.build import load_library
from quantkit.kernels.cpu.gemm import (_check_quantized, _check_vnni, _check_x, _out_columns, matmul_bf16_ref,
                                       run_quantized)

_P, _INT, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SIGNATURES = {"rowwise_gemm": [_P, _INT, _INT, _P, _I64, _INT, _P, _P, _INT, _INT]}
QGEMM_SIGNATURE = [_P, _INT, _INT, _P, _I64, _P, _I64, _INT, _INT, _INT, _P, _INT, _INT]  # gemm.c's qgemm's


def _library():
    return load_library("rowwise_gemm", SIGNATURES)


def available() -> bool:
    return _library() is not None


ISAS = {2: "avx512_bf16", 1: "avx2", 0: "portable"}  # rowwise_gemm_isa()'s codes


def isa() -> str | None:
    """The chain this build runs: "avx512_bf16", "avx2" (+ FMA) or "portable" (plain C, several times slower than
    either); None without a build."""
    return ISAS[_library().rowwise_gemm_isa()] if available() else None


def vectorised() -> bool:
    """Whether the build runs a SIMD kernel (AVX-512 BF16 or AVX2), fast enough to serve bf16 with."""
    return isa() in ("avx512_bf16", "avx2")


@functools.cache
def _quantized_kernel():
    """rowwise_qgemm with its argtypes, or None: the AVX-512 BF16 and AVX2 (+ F16C) builds export it."""
    if not vectorised() or not hasattr(_library(), "rowwise_qgemm"):
        return None
    fn = _library().rowwise_qgemm
    fn.restype, fn.argtypes = None, QGEMM_SIGNATURE
    return fn


def quantized_available() -> bool:
    """Whether qmatmul runs here."""
    return _quantized_kernel() is not None


# qmatmul - x [M, K] bf16 contiguous, gemm.pack_quantized's weight of N columns -> y [M, N] bf16 ([M, N/2] act)
def qmatmul(x: torch.Tensor, packed, bits: int, act: bool = False) -> torch.Tensor:
    """y = x @ dequantize(W)^T, W dequantized to bf16."""
    if _quantized_kernel() is None:
        raise RuntimeError("rowwise_gemm.qmatmul needs the AVX-512 BF16 or AVX2 build (quantized_available() False)")
    _check_x(x, _check_quantized(packed, bits))
    return run_quantized(_library().rowwise_qgemm, x, packed, bits, act)  # looked up per call: timers wrap it


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

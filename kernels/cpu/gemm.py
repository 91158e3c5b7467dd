"""AMX GEMMs for CPU serving (gemm.c, built once by build.py): y = x @ W^T with x and y bf16, fp32 accumulation.
One tile loop serves the bf16 weights of PackedLinear and QLinear's W4/W8 codes, dequantized per column block.

Weight layout ("VNNI", what TDPBF16PS takes as its B tile): 16 output columns per block,
  bf16   uint32 [N/16, K/2, 16]   element [b, r, n] = bf16 W[16b + n, 2r] | W[16b + n, 2r + 1] << 16
so one 16 x 32 slice of K is one contiguous 1 KiB tile. Quantized weights (`pack_quantized`):
  codes  4-bit: uint8  [N/16, K/2, 16]  byte = q[n, 2r] | q[n, 2r + 1] << 4
         8-bit: uint16 [N/16, K/2, 16]  q[n, 2r] | q[n, 2r + 1] << 8   (held as int16)
  qparams fp16 [N/16, G, 2, 16]         (scale, zero) per column of the block and group: the format's fp16
                                        scale and the zero exactly, 64 bytes per block and group
dequantized to the bf16 layout (w = s * (q - z) in fp32, rounded to bf16 exactly as `dequantize(qt, bfloat16)`).
Needs N % 16 == 0 and K % 32 == 0 (and an even group size): the pack functions return None otherwise, and the
launchers check x and the packed weight against what the C code assumes before passing their pointers. A packed
weight may be a view of whole blocks of a larger one (any stride between blocks, each block contiguous).

Tiling: a pass computes 32 rows x 32 columns in four fp32 accumulator tiles (two x row tiles times two weight
blocks: four tile loads per four TDPBF16PS; 1.5x oneDNN's bf16 matmul at 64 rows on SmolLM2's shapes). Threads
split the column-block pairs; rows go in chunks of M_CHUNK so a chunk of x stays in L2 while the weights stream
past it. Up to 16 rows (decode), a pass is one row tile times four weight blocks (four weight streams in flight).
Row invariance (what batch-invariant serving takes this GEMM for, serve/cpu_linear.py): every output element is
the same TDPBF16PS sequence over K in order into a zeroed tile, whatever M, the tiling or the thread count. A last partial row tile (M % 16 rows) is read from a zero-padded copy. The quantized GEMM dequantizes a
pair of column blocks into an L2 buffer and runs all rows on it (`qgemm`, decode-sized M); above _FUSED_MAX_M rows
the whole weight is dequantized once into a per-thread scratch and the bf16 GEMM runs on that.

`prepare(qt)` is the one place that turns a QTensor into this layout; `matmul_bf16_ref` and `matmul_quantized_ref`
are the plain torch references.
"""

from __future__ import annotations

import ctypes
import threading

import torch
import torch.nn.functional as F

from quantkit.kernels.cpu.build import load_library
from quantkit.quant.scheme import QTensor, contiguous_groups, dequantize, in_group_order

_lib = None
_P, _INT, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SIGNATURES = {"gemm_bf16": [_P, _INT, _INT, _P, _I64, _INT, _P, _INT, _INT],
              "qgemm": [_P, _INT, _INT, _P, _I64, _P, _I64, _INT, _INT, _INT, _P, _INT, _INT],
              "dequant_vnni": [_P, _I64, _P, _I64, _INT, _INT, _INT, _INT, _P, _INT]}
# above this many rows the quantized GEMM dequantizes the whole weight once (per-pair dequantization in qgemm
# keeps the weight in L2 for decode-sized M; at prefill sizes x no longer fits beside it)
_FUSED_MAX_M = 256
_CODE_DTYPES = {4: torch.uint8, 8: torch.int16}  # pack_quantized's codes per bit width
_BF16 = torch.bfloat16


def _library():
    """The compiled kernels, or None without AMX (CPU, kernel permission or compiler)."""
    global _lib
    if _lib is None:
        _lib = False
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line.split() for line in f if line.startswith("flags")), [])
        except OSError:
            flags = []
        if "amx_bf16" in flags and "amx_tile" in flags:
            lib = load_library("gemm", SIGNATURES)
            if lib is not None and lib.amx_ready():
                _lib = lib
    return _lib or None


def available() -> bool:
    return _library() is not None


def _column_pairs(t: torch.Tensor) -> torch.Tensor:
    """t [N, K] -> the VNNI order as a view [N/16, K/2, 16, 2]: element [b, r, n, j] = t[16b + n, 2r + j]."""
    n, k = t.shape
    return t.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3)


def _check_x(x: torch.Tensor, k: int) -> None:
    """x [M, K] bf16, contiguous, on the CPU: the kernels read M rows of K elements from x.data_ptr()."""
    if x.dtype is not _BF16 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() or not x.is_cpu:
        raise ValueError(f"x must be [M, {k}] bfloat16, contiguous, on the CPU; got {tuple(x.shape)} {x.dtype} "
                         f"strides {x.stride()} on {x.device}")


# The weight checks run on every call (decode hot path: ~1 us together): shapes once, strides only for views.
def _check_vnni(packed: torch.Tensor) -> int:
    """packed [N/16, K/2, 16] int32 with K % 32 == 0, each block contiguous -> K."""
    shape = packed.shape
    if packed.dtype is not torch.int32 or len(shape) != 3 or shape[1] % 16 or shape[2] != 16 \
            or (not packed.is_contiguous() and packed.stride()[1:] != (16, 1)):
        raise ValueError(f"packed must be pack_bf16's int32 [N/16, K/2, 16] (K % 32 == 0, blocks contiguous); got "
                         f"{tuple(shape)} {packed.dtype} strides {packed.stride()}")
    return 2 * shape[1]


def _check_quantized(packed, bits: int) -> int:
    """pack_quantized's (codes [N/16, K/2, 16] uint8 (4-bit) / int16 (8-bit), qparams fp16 [N/16, K/gs, 2, 16],
    gs even), K % 32 == 0, each block contiguous -> K."""
    codes, qparams, gs = packed
    cs, qs = codes.shape, qparams.shape
    if codes.dtype is not _CODE_DTYPES.get(bits) or qparams.dtype is not torch.float16 or len(cs) != 3 \
            or len(qs) != 4 or cs[1] % 16 or cs[2] != 16 or gs % 2 or qs[0] != cs[0] or qs[1] * gs != 2 * cs[1] \
            or qs[2] != 2 or qs[3] != 16 or (not codes.is_contiguous() and codes.stride()[1:] != (16, 1)) \
            or (not qparams.is_contiguous() and qparams.stride()[1:] != (32, 16, 1)):
        raise ValueError(f"packed must be pack_quantized's {bits}-bit (codes, qparams, gs); got codes {tuple(cs)} "
                         f"{codes.dtype} strides {codes.stride()}, qparams {tuple(qs)} {qparams.dtype} strides "
                         f"{qparams.stride()}, gs {gs}")
    return 2 * cs[1]


def _out_columns(n: int, act: bool) -> int:
    if act and n % 32:
        raise ValueError("act needs gate and up blocks in pairs")
    return n // 2 if act else n


# pack_bf16 - w [N, K] bf16 -> int32 [N/16, K/2, 16] (VNNI bit patterns), or None when N % 16 or K % 32
def vnni_fits(n: int, k: int) -> bool:
    """Whether the VNNI layout takes an [N, K] weight."""
    return n % 16 == 0 and k % 32 == 0


def pack_bf16(w: torch.Tensor):
    n, k = w.shape
    if not vnni_fits(n, k):
        return None
    pairs = _column_pairs(w.detach().contiguous().view(torch.int16)).contiguous()  # [N/16, K/2, 16, 2]
    return pairs.view(torch.int32).view(n // 16, k // 2, 16)


def unpack_bf16(packed: torch.Tensor) -> torch.Tensor:
    """The VNNI layout back to bf16 [N, K] (pack_bf16's inverse)."""
    blocks, half, _ = packed.shape
    pairs = packed.view(torch.int16).view(blocks, half, 16, 2).permute(0, 2, 1, 3)
    return pairs.reshape(blocks * 16, half * 2).view(torch.bfloat16)


# matmul_bf16 - x [M, K] bf16 contiguous, packed int32 [N/16, K/2, 16] -> y [M, N] bf16 ([M, N/2] with act)
def matmul_bf16(x: torch.Tensor, packed: torch.Tensor, act: bool = False) -> torch.Tensor:
    """y = x @ W^T with a pack_bf16 weight (or a view of whole blocks of one). act: the blocks alternate gate and
    up, and the result is silu(gate) * up [M, N / 2]."""
    _check_x(x, _check_vnni(packed))
    m, k = x.shape
    n = packed.shape[0] * 16
    y = torch.empty(m, _out_columns(n, act), dtype=torch.bfloat16)
    _library().gemm_bf16(x.data_ptr(), m, k, packed.data_ptr(), packed.stride(0), n, y.data_ptr(),
                         torch.get_num_threads(), act)
    return y


# matmul_bf16_ref - x [M, K] bf16, w [N, K] bf16 -> [M, N] fp32 ([M, N/2] with act)
def matmul_bf16_ref(x: torch.Tensor, w: torch.Tensor, act: bool = False) -> torch.Tensor:
    """matmul_bf16(x, pack_bf16(w), act) before its rounding to bf16. act: w's 16-row blocks alternate gate and up;
    both products are rounded to bf16, then silu(gate) * up in fp32 (as the kernel's epilogue)."""
    y = x.float() @ w.float().T
    if not act:
        return y
    m, n = y.shape
    blocks = y.bfloat16().float().view(m, n // 32, 2, 16)  # [M, pairs, gate | up, 16]
    return (F.silu(blocks[:, :, 0]) * blocks[:, :, 1]).reshape(m, n // 2)


# pack_quantized - codes uint8 [N, K] in contiguous groups of gs, scales fp16 / zeros uint8 [N, G] -> (codes,
#                  qparams, gs) in the kernel's layout, or None
def pack_quantized(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, gs: int):
    """The kernel's layout (module docstring) of codes in contiguous groups of gs columns (K for per-channel), or
    None when the shape does not fit (N % 16, K % 32, odd group size)."""
    n, k = codes.shape
    if n % 16 or k % 32 or gs % 2 or k % gs or bits not in (4, 8):
        return None
    pairs = _column_pairs(codes).to(torch.int32)
    if bits == 4:
        packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).contiguous()
    else:
        packed = (pairs[..., 0] | (pairs[..., 1] << 8)).to(torch.int16).contiguous()  # bit pattern of the uint16
    groups = scales.shape[1]
    qparams = torch.stack([scales.half().view(n // 16, 16, groups), zeros.half().view(n // 16, 16, groups)], dim=2)
    return packed, qparams.permute(0, 3, 2, 1).contiguous(), gs  # [N/16, G, 2, 16]


# prepare - QTensor [N, K] 4/8-bit -> (perm int64 [K] or None, pack_quantized's (codes, qparams, gs)), or None
def prepare(qt: QTensor):
    """This backend's weight for qt, for matmul_packed(x, perm, packed, qt.bits) and gemv.py's GEMV, which streams
    the same packing: the act-order permutation into contiguous groups, then pack_quantized. None for a layer the
    kernels do not take (N % 16, K % 32, an odd group size, act-order groups of unequal sizes); whether either
    kernel runs here is the caller's question (available(), gemv.available())."""
    layout = contiguous_groups(qt)
    if layout is None:
        return None
    perm, g, codes = layout
    packed = pack_quantized(codes, qt.scales, qt.zeros, qt.bits, g)
    return None if packed is None else (perm, packed)


def _strides(packed) -> tuple[int, int]:
    """(bytes between code blocks, halves between qparam blocks) of a packed weight or a view of whole blocks."""
    codes, qparams, _ = packed
    return codes.stride(0) * codes.element_size(), qparams.stride(0)


# matmul_quantized - x [M, K] bf16 contiguous, pack_quantized's weight of N columns -> y [M, N] bf16 ([M, N/2] with act)
def matmul_quantized(x: torch.Tensor, packed, bits: int, act: bool = False) -> torch.Tensor:
    """y = x @ dequantize(W)^T (act as in matmul_bf16)."""
    _check_x(x, _check_quantized(packed, bits))
    if x.shape[0] > _FUSED_MAX_M:
        return matmul_bf16(x, dequantize_vnni(packed, bits), act)
    return run_quantized(_library().qgemm, x, packed, bits, act)


def run_quantized(kernel, x: torch.Tensor, packed, bits: int, act: bool) -> torch.Tensor:
    """y [M, N] bf16 ([M, N/2] with act) from a C kernel taking qgemm's arguments (gemm.c's qgemm, gemv.c's
    qgemv), x and the packed weight already checked."""
    codes, qparams, gs = packed
    m, k = x.shape
    n = codes.shape[0] * 16
    y = torch.empty(m, _out_columns(n, act), dtype=torch.bfloat16)
    cs, qs = _strides(packed)
    kernel(x.data_ptr(), m, k, codes.data_ptr(), cs, qparams.data_ptr(), qs, n, gs, bits, y.data_ptr(),
           torch.get_num_threads(), act)
    return y


# matmul_quantized_ref - x [M, K] bf16, QTensor [N, K] -> [M, N] fp32 ([M, N/2] with act)
def matmul_quantized_ref(x: torch.Tensor, qt: QTensor, act: bool = False) -> torch.Tensor:
    """matmul_packed(x, *prepare(qt), qt.bits, act) before its rounding to bf16: the format's bf16 dequantization,
    then matmul_bf16_ref (the act-order permutation of x and of the columns cancels)."""
    return matmul_bf16_ref(x, dequantize(qt, torch.bfloat16), act)


# matmul_packed - x [M, K] bf16, perm int64 [K] or None, a packed weight of N columns -> y [M, N] bf16
def matmul_packed(x: torch.Tensor, perm: torch.Tensor | None, weight, bits: int, act: bool = False) -> torch.Tensor:
    """y through a packed weight: pack_bf16's (bits 16) or pack_quantized's (4, 8), whose act-order `perm` (or
    None) first puts x's columns into group order; act as in matmul_bf16."""
    x = in_group_order(x, perm)
    return matmul_bf16(x, weight, act) if bits == 16 else matmul_quantized(x, weight, bits, act)


_scratch = threading.local()  # per thread: one buffer reused by every layer's whole-weight dequantization


# dequantize_vnni - pack_quantized's weight of N columns -> int32 [N/16, K/2, 16], pack_bf16's layout
def dequantize_vnni(packed, bits: int) -> torch.Tensor:
    """The packed weight dequantized into the bf16 VNNI layout (unpack_bf16 of it is bit-identical to
    dequantize(qt, torch.bfloat16) of the packed columns). It lives in a per-thread scratch buffer (fresh pages
    cost more than the dequantization): use it before the next call on this thread."""
    k = _check_quantized(packed, bits)
    codes, qparams, gs = packed
    blocks, half = codes.shape[0], k // 2
    size = blocks * half * 16
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < size:
        buf = _scratch.buf = torch.empty(size, dtype=torch.int32)
    w = buf[:size].view(blocks, half, 16)
    cs, qs = _strides(packed)
    _library().dequant_vnni(codes.data_ptr(), cs, qparams.data_ptr(), qs, blocks * 16, k, gs, bits,
                            w.data_ptr(), torch.get_num_threads())
    return w

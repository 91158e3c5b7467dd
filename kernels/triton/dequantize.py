# dequantize - PackedWeight qweight int32 [ceil(K/p), N] -> w [K, N] (input-column order), fp16/bf16/fp32
"""Dequantize once (the large-M path: then one cuBLAS matmul), plus `dequant_tile3` / `dequant_tile`, the tile
decoder every dequant-GEMM kernel shares: each packed int32 word is loaded once (coalesced along N) and unpacked in
registers with p shifts, and a K tile inside one group loads that group's scales (and zeros) once.

W'[k, n] = scales[grp, n] * (code - zeros[grp, n]) with grp = packed row // group_k (repack.py's layout).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .repack import PackedWeight


@triton.jit
def dequant_tile3(
    qw_ptr, s_ptr, z_ptr,  # qweight int32 [KW, N]; scales fp16 [G, N]; zeros uint8 [G, N]
    k0, offs_n, K, N,  # tile start k0 (a multiple of BLOCK_K) and the tile's columns
    stride_qw, stride_sg,  # row strides of qweight and of scales/zeros (columns are contiguous)
    BITS: tl.constexpr, GROUP_K: tl.constexpr, SYM: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """-> fp32 [BLOCK_K / P, P, BLOCK_N]: element (w, j, n) is packed row k0 + w*P + j; rows >= K are 0 codes."""
    P: tl.constexpr = 32 // BITS
    MAXQ: tl.constexpr = (1 << BITS) - 1
    mask_n = offs_n < N
    # words [k0/P, +BLOCK_K/P) x offs_n, word (w, n) at qw_ptr + w * stride_qw + n: each loaded once, evict_first
    # (weights are streamed once)
    offs_w = k0 // P + tl.arange(0, BLOCK_K // P)  # [BKW]
    words = tl.load(qw_ptr + offs_w[:, None] * stride_qw + offs_n[None, :],
                    mask=(offs_w * P < K)[:, None] & mask_n[None, :], other=0, eviction_policy="evict_first")
    shifts = tl.arange(0, P) * BITS  # [P]: packed row w*P + j sits at bits [BITS*j, BITS*(j+1)) of word w
    code = ((words[:, None, :] >> shifts[None, :, None]) & MAXQ).to(tl.float32)  # [BKW, P, BN]
    if GROUP_K % BLOCK_K == 0:
        # the whole tile lies in group k0 // GROUP_K: one [BN] row of scales (and zeros) per tile
        g = k0 // GROUP_K
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, None, :]
        if SYM:
            z = (MAXQ + 1) // 2
        else:
            z = tl.load(z_ptr + g * stride_sg + offs_n, mask=mask_n, other=0).to(tl.float32)[None, None, :]
    else:
        # groups shorter than (or not aligned with) the tile: gather the group row of every packed row
        g_rows = (k0 + tl.arange(0, BLOCK_K // P)[:, None] * P + tl.arange(0, P)[None, :]) // GROUP_K  # [BKW, P]
        offs = g_rows[:, :, None] * stride_sg + offs_n[None, None, :]
        mask = (g_rows * GROUP_K < K)[:, :, None] & mask_n[None, None, :]
        s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if SYM:
            z = (MAXQ + 1) // 2
        else:
            z = tl.load(z_ptr + offs, mask=mask, other=0).to(tl.float32)
    return (code - z) * s


@triton.jit
def dequant_tile(
    qw_ptr, s_ptr, z_ptr, k0, offs_n, K, N, stride_qw, stride_sg,
    BITS: tl.constexpr, GROUP_K: tl.constexpr, SYM: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dequant_tile3 as a 2D fp32 tile [BLOCK_K, BLOCK_N], row r = packed row k0 + r (the tl.dot operand)."""
    w = dequant_tile3(qw_ptr, s_ptr, z_ptr, k0, offs_n, K, N, stride_qw, stride_sg, BITS, GROUP_K, SYM, BLOCK_K)
    return tl.reshape(w, (BLOCK_K, offs_n.shape[0]))


@triton.jit
def _dequantize_kernel(
    qw_ptr, s_ptr, z_ptr,
    perm_ptr,  # int32 [K]: packed row k -> input column (read only when HAS_PERM)
    out_ptr,  # [K, N] output dtype, column stride 1
    K, N, stride_qw, stride_sg, stride_ok,
    BITS: tl.constexpr, GROUP_K: tl.constexpr, SYM: tl.constexpr, HAS_PERM: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # program (pid_k, pid_n) decodes packed rows [pid_k*BLOCK_K, +BLOCK_K) x columns [pid_n*BLOCK_N, +BLOCK_N)
    k0 = tl.program_id(0) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_n, K, N, stride_qw, stride_sg, BITS, GROUP_K, SYM, BLOCK_K)
    mask_k = offs_k < K
    if HAS_PERM:
        rows = tl.load(perm_ptr + offs_k, mask=mask_k, other=0)  # [BK] scatter packed rows back to input order
    else:
        rows = offs_k
    # out (row, n) at out_ptr + row * stride_ok + n: each row segment of BLOCK_N stays contiguous
    tl.store(out_ptr + rows[:, None] * stride_ok + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=mask_k[:, None] & (offs_n < N)[None, :])


def check_packed(pw: PackedWeight) -> None:
    """The launchers' shared assertions on a PackedWeight."""
    k, n, p = pw.in_features, pw.out_features, pw.pack_factor
    assert pw.qweight.dtype == torch.int32 and tuple(pw.qweight.shape) == (triton.cdiv(k, p), n), "qweight shape"
    assert pw.qweight.stride(1) == 1 and pw.scales.stride(1) == 1 and pw.zeros.stride(1) == 1, "N must be contiguous"
    assert pw.scales.dtype == torch.float16 and pw.zeros.dtype == torch.uint8, "scales fp16, zeros uint8"
    assert pw.scales.shape == pw.zeros.shape and pw.scales.shape[1] == n, "scales/zeros [G, N]"
    assert pw.scales.stride(0) == pw.zeros.stride(0), "scales and zeros share one row stride"
    assert pw.perm is None or (pw.perm.dtype == torch.int32 and tuple(pw.perm.shape) == (k,)), "perm int32 [K]"


def check_matmul_inputs(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None) -> None:
    """The dequant-GEMM launchers' shared assertions: x [M, K] fp16/bf16 rows, optional bias [N] in x.dtype."""
    check_packed(pw)
    m, k = x.shape
    assert k == pw.in_features, f"x has K={k}, weight has K={pw.in_features}"
    assert x.dtype in (torch.float16, torch.bfloat16) and x.stride(1) == 1, "x fp16/bf16 with column stride 1"
    assert x.device == pw.device, "x and weight on one device"
    n = pw.out_features
    assert bias is None or (bias.dtype == x.dtype and tuple(bias.shape) == (n,) and bias.stride(0) == 1), "bias [N]"


# The dequant-matmul kernels' (dequant_gemm, dequant_gemv) arguments, in this order:
#   x_ptr     [M, K] fp16/bf16, column stride stride_xm between rows, 1 between columns
#   qw_ptr, s_ptr, z_ptr   PackedWeight qweight int32 [KW, N], scales fp16 [G, N], zeros uint8 [G, N] (weight_args)
#   perm_ptr  int32 [K]: x column of packed row k (read only when HAS_PERM)
#   bias_ptr  [N] x.dtype (read only when HAS_BIAS)
#   out_ptr   [M, N] x.dtype, row stride stride_om, column stride 1
#   M, N, K, M_BUCKET (an autotune key only), stride_xm, stride_om, stride_qw, stride_sg (weight strides)
#   BITS, GROUP_K, SYM, HAS_PERM (weight_meta), HAS_BIAS, FP32_DOT (common.fp32_dot), then each kernel's tiles
def weight_args(pw: PackedWeight) -> tuple:
    """(qweight, scales, zeros, perm) kernel pointers; a dummy for perm when there is none (HAS_PERM=False)."""
    return pw.qweight, pw.scales, pw.zeros, pw.perm if pw.perm is not None else pw.qweight


def weight_meta(pw: PackedWeight) -> dict:
    """The weight's constexprs: BITS, GROUP_K, SYM, HAS_PERM."""
    return dict(BITS=pw.bits, GROUP_K=pw.group_k, SYM=pw.sym, HAS_PERM=pw.perm is not None)


def dequantize(pw: PackedWeight, dtype: torch.dtype = torch.float16, block_k: int = 64, block_n: int = 128
               ) -> torch.Tensor:
    """-> W' transposed, [K, N] in `dtype`, rows in input-column order (x @ result == x @ W'.T)."""
    check_packed(pw)
    assert dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {dtype}"
    k, n = pw.in_features, pw.out_features
    out = torch.empty((k, n), dtype=dtype, device=pw.device)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _dequantize_kernel[grid](
        *weight_args(pw), out, k, n, pw.qweight.stride(0), pw.scales.stride(0), out.stride(0),
        **weight_meta(pw), BLOCK_K=block_k, BLOCK_N=block_n,
    )
    return out


def dequantize_ref(pw: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure-torch `dequantize` from the packed layout: unpack words, apply group scales/zeros, undo perm."""
    k, n, p, bits = pw.in_features, pw.out_features, pw.pack_factor, pw.bits
    shifts = torch.arange(p, device=pw.device, dtype=torch.int64) * bits
    words = pw.qweight.to(torch.int64) & 0xFFFFFFFF  # [KW, N] unsigned
    codes = ((words[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)).reshape(-1, n)[:k]  # [K, N]
    grp = torch.arange(k, device=pw.device) // pw.group_k  # [K] group of each packed row
    zeros = torch.full_like(pw.scales, 1 << (bits - 1), dtype=torch.float32) if pw.sym else pw.zeros.float()
    w = pw.scales.float()[grp] * (codes.float() - zeros[grp])  # [K, N] packed-row order
    if pw.perm is not None:
        w = torch.empty_like(w).index_copy_(0, pw.perm.to(torch.int64), w)  # row perm[k] <- packed row k
    return w.to(dtype)


def dequant_matmul_ref(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch x [M, K] @ W'.T (+ bias) in fp32 from the packed layout, cast to x.dtype: every GEMM's reference."""
    y = x.float() @ dequantize_ref(pw)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)

# repack - QTensor codes uint8 [N, K] -> PackedWeight.qweight int32 [ceil(K / p), N] (+ scales/zeros [G, N])
"""One kernel-friendly layout for every quantized Linear, built once at load (never needs calibration tools).

The canonical QTensor (quantkit/quant/scheme.py) keeps codes row-major [N, K] and a possibly non-monotonic
g_idx (GPTQ act-order). The dequant-GEMM kernels want instead:

  qweight  int32 [ceil(K/p), N]  p = 32 / bits codes per word packed along K, sequential (code of packed row k at
                                 bits [b*(k % p), b*(k % p + 1)) of word [k // p, n]); the GPTQ qweight order, so
                                 one [BLOCK_K / p, BLOCK_N] tile load is coalesced along N
  scales   float16 [G, N]        one row per group: a K tile loads its group's scales once
  zeros    uint8 [G, N]          unused by the kernels when `sym` (every zero is 2^(b-1), a constant)
  perm     int32 [K] | None      act-order: packed row k holds input column perm[k]; rows are sorted by group,
                                 so every group is a contiguous run of `group_k` packed rows and the kernels
                                 gather x's columns through perm instead of gathering scales per row

Packed rows past K (K % p != 0) hold code 0; the kernels mask x there, so they never contribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from quantkit.errors import QuantkitError

# group_k of a per-channel weight: larger than any K, so every K tile sits in group 0.
GROUP_PER_CHANNEL = 1 << 30


@dataclass(frozen=True)
class PackedWeight:
    """A quantized Linear in the kernels' layout (module docstring); built by `repack` / `repack_ref`."""

    qweight: torch.Tensor  # int32 [ceil(K / p), N]
    scales: torch.Tensor  # float16 [G, N]
    zeros: torch.Tensor  # uint8 [G, N]
    perm: Optional[torch.Tensor]  # int32 [K] or None (identity)
    bits: int
    group_k: int  # packed rows per group (GROUP_PER_CHANNEL for per-channel)
    sym: bool  # every zero == 2^(bits - 1)
    in_features: int  # K
    out_features: int  # N

    @property
    def pack_factor(self) -> int:
        return 32 // self.bits

    @property
    def device(self) -> torch.device:
        return self.qweight.device


@triton.jit
def _repack_kernel(
    codes_ptr,  # uint8 [N, K], column stride 1
    perm_ptr,  # int32 [K] (read only when HAS_PERM)
    out_ptr,  # int32 [KW, N], column stride 1
    N, K, KW,
    stride_cn, stride_ow,
    BITS: tl.constexpr, HAS_PERM: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # program (pid_w, pid_n) writes words [pid_w*BLOCK_W : +BLOCK_W, pid_n*BLOCK_N : +BLOCK_N]
    P: tl.constexpr = 32 // BITS
    offs_w = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)  # [BW] word rows
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
    mask_n = offs_n < N
    word = tl.zeros((BLOCK_W, BLOCK_N), dtype=tl.int32)
    for j in tl.static_range(P):
        k = offs_w * P + j  # [BW] packed row held at bit offset BITS*j
        valid_k = k < K
        if HAS_PERM:
            src = tl.load(perm_ptr + k, mask=valid_k, other=0)  # [BW] input column of packed row k
        else:
            src = k
        # codes[n, src]: element (w, n) at codes_ptr + n * stride_cn + src[w]
        code = tl.load(codes_ptr + offs_n[None, :] * stride_cn + src[:, None],
                       mask=valid_k[:, None] & mask_n[None, :], other=0)  # [BW, BN] uint8
        word = word | (code.to(tl.int32) << (BITS * j))
    # word (w, n) at out_ptr + w * stride_ow + n
    tl.store(out_ptr + offs_w[:, None] * stride_ow + offs_n[None, :], word,
             mask=(offs_w < KW)[:, None] & mask_n[None, :])


def _layout_plan(qt) -> tuple[Optional[torch.Tensor], int, bool]:
    """(perm int64 [K] | None, group_k, sym) for a QTensor; raises when act-order groups are not equal runs."""
    n, k = qt.codes.shape
    g = qt.group_size
    group_k = GROUP_PER_CHANNEL if g == -1 else g
    perm = None
    if qt.g_idx is not None and g != -1:
        grp = qt.g_idx.to(torch.int64)
        perm = torch.argsort(grp, stable=True)  # [K] packed row -> input column, groups ascending
        expected = torch.arange(k, device=grp.device) // g
        if not torch.equal(grp[perm], expected):
            raise QuantkitError(
                f"g_idx of a [{n}, {k}] weight does not put exactly {g} columns in each group; the CUDA kernels "
                f"need equal groups (GPTQ act-order makes them): re-export the checkpoint or run it on CPU"
            )
        if torch.equal(perm, torch.arange(k, device=grp.device)):
            perm = None
    sym = bool(qt.sym) and bool((qt.zeros == (1 << (qt.bits - 1))).all())
    return perm, group_k, sym


def _check_qtensor(qt) -> None:
    n, k = qt.codes.shape
    assert qt.bits in (4, 8), f"bits {qt.bits}"
    assert qt.codes.dtype == torch.uint8 and qt.codes.stride(1) == 1, "codes must be uint8 [N, K], column stride 1"
    assert qt.scales.dtype == torch.float16 and qt.scales.shape[0] == n, "scales must be float16 [N, G]"
    assert qt.zeros.dtype == torch.uint8 and qt.zeros.shape == qt.scales.shape, "zeros must be uint8 [N, G]"
    assert qt.g_idx is None or tuple(qt.g_idx.shape) == (k,), "g_idx must be [K]"


def repack(qt, block_w: int = 16, block_n: int = 64) -> PackedWeight:
    """QTensor (any device; Triton needs CUDA or TRITON_INTERPRET=1) -> PackedWeight on the same device."""
    _check_qtensor(qt)
    n, k = qt.codes.shape
    perm, group_k, sym = _layout_plan(qt)
    p = 32 // qt.bits
    kw = triton.cdiv(k, p)
    qweight = torch.empty((kw, n), dtype=torch.int32, device=qt.codes.device)
    perm32 = None if perm is None else perm.to(torch.int32).contiguous()
    grid = (triton.cdiv(kw, block_w), triton.cdiv(n, block_n))
    _repack_kernel[grid](
        qt.codes, perm32 if perm32 is not None else qt.codes, qweight,
        n, k, kw, qt.codes.stride(0), qweight.stride(0),
        BITS=qt.bits, HAS_PERM=perm32 is not None, BLOCK_W=block_w, BLOCK_N=block_n,
    )
    return _finish(qt, qweight, perm32, group_k, sym)


def repack_ref(qt) -> PackedWeight:
    """Pure-torch `repack`: permute columns, zero-pad K to a multiple of p, pack along K, transpose."""
    _check_qtensor(qt)
    n, k = qt.codes.shape
    perm, group_k, sym = _layout_plan(qt)
    p = 32 // qt.bits
    codes = qt.codes if perm is None else qt.codes[:, perm]  # [N, K] in packed-row order
    codes = torch.nn.functional.pad(codes.to(torch.int64), (0, -k % p)).t()  # [KW*p, N]
    shifts = torch.arange(p, device=codes.device, dtype=torch.int64) * qt.bits
    words = (codes.reshape(-1, p, n) << shifts[None, :, None]).sum(dim=1)  # [KW, N] in [0, 2^32)
    qweight = (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)
    perm32 = None if perm is None else perm.to(torch.int32)
    return _finish(qt, qweight, perm32, group_k, sym)


def _finish(qt, qweight, perm32, group_k, sym) -> PackedWeight:
    n, k = qt.codes.shape
    return PackedWeight(
        qweight=qweight, scales=qt.scales.t().contiguous(), zeros=qt.zeros.t().contiguous(), perm=perm32,
        bits=qt.bits, group_k=group_k, sym=sym, in_features=k, out_features=n,
    )

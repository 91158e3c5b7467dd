"""Host-side helpers every kernel launcher shares."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing


def fp32_dot(dtype: torch.dtype) -> bool:
    """True when tl.dot must see fp32 operands: Triton's CPU interpreter (TRITON_INTERPRET=1) multiplies the raw
    uint16 storage of bfloat16 operands. Kernels then round to bf16 first and upcast, so products and fp32 sums
    are the same as a tensor-core bf16 dot; on a GPU this is always False."""
    return bool(triton.knobs.runtime.interpret) and dtype == torch.bfloat16


def quick_bench(fn, quantiles):
    """Autotuning timer: shorter than Triton's default (25 ms warm-up, 100 ms runs) so a first run tunes fast."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


@triton.jit
def mma(a, b, acc, FP32_DOT: tl.constexpr):
    """acc [BM, BN] fp32 += a [BM, BK] @ b [BK, BN] (a and b in one fp16/bf16 dtype); see fp32_dot."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


def exact_bf16_cast(dtype: torch.dtype) -> bool:
    """True when kernels must round fp32 -> bfloat16 themselves (round_to): Triton's CPU interpreter truncates
    that cast (its _convert_float, even with fp_downcast_rounding="rtne"), a bias of half an ulp per rounding that
    compounds over a chain of rounded GEMMs; a GPU rounds to nearest even, so this is always False there."""
    return bool(triton.knobs.runtime.interpret) and dtype == torch.bfloat16


@triton.jit
def round_to(x, dtype: tl.constexpr, EXACT_BF16: tl.constexpr):
    """fp32 x -> `dtype`, rounded to nearest even (EXACT_BF16: by integer ops on the bits; finite x); see
    exact_bf16_cast."""
    if EXACT_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)

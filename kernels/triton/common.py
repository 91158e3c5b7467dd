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

# rope - q [T, Hq, D], k [T, Hkv, D] rotated in place by cos, sin [T, 1, R], R <= D (rotate-half RoPE of the first R
#        dims of each head, the rest untouched: partial rotary), fp16/bf16/fp32
"""Rotate-half RoPE (the HF convention, quantkit/models/layers.py's apply_rope) of q and k in ONE launch, rounding as
torch's ops do: out = round(round(x * cos) + round(rotate_half(x) * sin)) in x's dtype, rotate_half(x) =
cat(-x[D/2:], x[:D/2]) (the negation is exact). Products of two 16-bit values are exact in fp32, so each rounding is
torch's and fp16/bf16 results equal apply_rope's bit for bit (fp32: a GPU may contract a product and its sum into
one FMA). Grid (T, Hq + Hkv): program (t, h) rotates row h of token t, q's heads first, then k's. The torch
reference is apply_rope itself (tests/kernels/test_triton_layer_ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import exact_bf16_cast, round_to


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr,  # q [T, Hq, D], k [T, Hkv, D]; head_dim contiguous
    cos_ptr, sin_ptr,  # [T, R = 2 * HALF], contiguous
    HQ, stride_qt, stride_qh, stride_kt, stride_kh,
    HALF: tl.constexpr, BLOCK: tl.constexpr, EXACT_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < HQ:
        row = q_ptr + t * stride_qt + h * stride_qh
    else:
        row = k_ptr + t * stride_kt + (h - HQ) * stride_kh
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    dtype = q_ptr.dtype.element_ty
    x1 = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK] first half
    x2 = tl.load(row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    trig = t * 2 * HALF + offs
    c1 = tl.load(cos_ptr + trig, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + trig + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + trig, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + trig + HALF, mask=mask, other=0.0).to(tl.float32)
    a1 = round_to(x1 * c1, dtype, EXACT_BF16).to(tl.float32)
    b1 = round_to(-x2 * s1, dtype, EXACT_BF16).to(tl.float32)
    a2 = round_to(x2 * c2, dtype, EXACT_BF16).to(tl.float32)
    b2 = round_to(x1 * s2, dtype, EXACT_BF16).to(tl.float32)
    tl.store(row + offs, round_to(a1 + b1, dtype, EXACT_BF16), mask=mask)
    tl.store(row + HALF + offs, round_to(a2 + b2, dtype, EXACT_BF16), mask=mask)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: the first R dims of each head of q [T, Hq, D] and k [T, Hkv, D] (head_dim contiguous) rotated by
    cos, sin [T, 1, R] (or [T, R]; R even, R <= D) in q's dtype."""
    t, hq, d = q.shape
    r = cos.shape[-1]
    assert k.dim() == 3 and k.shape[0] == t and k.shape[2] == d and k.dtype == q.dtype, "k [T, Hkv, D] like q"
    assert r % 2 == 0 and r <= d and q.stride(2) == 1 and k.stride(2) == 1, "R even, R <= D, head_dim contiguous"
    cos2, sin2 = cos.reshape(t, r), sin.reshape(t, r)
    assert cos2.dtype == sin2.dtype == q.dtype and cos2.is_contiguous() and sin2.is_contiguous(), \
        "cos/sin [T, 1, R] contiguous, in q's dtype"
    if t == 0:
        return
    _rope_kernel[(t, hq + k.shape[1])](
        q, k, cos2, sin2, hq, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        HALF=r // 2, BLOCK=triton.next_power_of_2(r // 2), EXACT_BF16=exact_bf16_cast(q.dtype),
    )


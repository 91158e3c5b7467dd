# rmsnorm - x [T, H] (+ residual [T, H]), weight [H] -> out [T, H] (+ new residual [T, H]), fp16/bf16/fp32
"""Fused residual add + RMSNorm, bit-compatible with the model's two steps (quantkit/models/llama.py, as HF):

    r = x + residual                      (rounded to the model dtype: the residual stream)
    out = weight * (r_fp32 * rsqrt(mean(r_fp32^2) + eps)).to(dtype)

fp32_norm is the same launch for the norms rounded once from fp32 (TorchOps.fp32_norm: Gemma's (1 + w), OLMo's, and
LayerNorm, mean-centred, with an optional bias): out = ((r - mean) * rsqrt(var + eps) * (offset + w) + b).to(dtype).
One program per token row; the whole row (BLOCK_H >= H) sits in registers, reductions in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr,  # x [T, H], residual [T, H] (read when HAS_RESIDUAL), weight [H], bias [H]
    out_ptr, res_out_ptr,  # out [T, H], new residual [T, H] (written when HAS_RESIDUAL)
    H, eps, offset,
    stride_x, stride_r, stride_o, stride_ro,  # row strides; columns are contiguous
    HAS_RESIDUAL: tl.constexpr, FP32_SCALE: tl.constexpr, CENTERED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)  # [BH] model dtype
    if HAS_RESIDUAL:
        r = x.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = r.to(x_ptr.dtype.element_ty)  # the residual stream is kept in the model dtype
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    if CENTERED:
        x32 = tl.where(mask, x32 - tl.sum(x32, axis=0) / H, 0.0)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if FP32_SCALE:  # fp32_norm: one rounding, at the end
        y = x32 * inv_rms * (offset + w)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        y = w * (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [..., H] -> out [..., H]; with `residual` -> (out, x + residual), both in x.dtype."""
    return _launch(x, weight, eps, residual, None, None, False)


def fp32_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, centered: bool,
              bias: torch.Tensor | None = None, residual: torch.Tensor | None = None):
    """TorchOps.fp32_norm's math (module docstring): x [..., H] -> out [..., H]; with `residual` -> (out, x +
    residual), both in x.dtype."""
    assert bias is None or (bias.shape == weight.shape and bias.dtype == x.dtype and bias.stride(0) == 1), "bias [H]"
    return _launch(x, weight, eps, residual, offset, bias, centered)


def _launch(x, weight, eps: float, residual, offset: float | None, bias, centered: bool):
    """offset None: rmsnorm's rounding; else fp32_norm's."""
    h = x.shape[-1]
    assert weight.shape == (h,) and weight.dtype == x.dtype and weight.stride(0) == 1, "weight [H] in x.dtype"
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype), "residual like x"
    x2 = x.reshape(-1, h)
    res2 = None if residual is None else residual.reshape(-1, h)
    assert x2.stride(1) == 1 and (res2 is None or res2.stride(1) == 1), "H must be contiguous"
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    block_h = triton.next_power_of_2(h)
    _rmsnorm_kernel[(x2.shape[0],)](
        x2, res2 if res2 is not None else x2, weight, bias if bias is not None else weight, out, res_out, h, eps,
        offset or 0.0, x2.stride(0), (res2 if res2 is not None else x2).stride(0), out.stride(0), res_out.stride(0),
        HAS_RESIDUAL=residual is not None, FP32_SCALE=offset is not None, CENTERED=centered,
        HAS_BIAS=bias is not None, BLOCK_H=block_h, num_warps=min(16, max(1, block_h // 256)),
    )
    if residual is None:
        return out.reshape(x.shape)
    return out.reshape(x.shape), res_out.reshape(x.shape)


def rmsnorm_ref(x, weight, eps, residual=None):
    """Pure torch `rmsnorm` (the model's residual add and RMSNorm, step by step)."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    out = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, x)

# layer_ops - a model's per-token ops on CUDA (TorchOps' contract) on the Triton kernels
"""TritonOps: the CUDA counterpart of kernels/cpu/fused.py's CpuFusedOps, set by serving on CUDA (serve/prepare.py).

  rms_norm  the residual add and the RMSNorm in one launch (rmsnorm.py), where torch runs about eight kernels
  silu_mul  silu(gate) * up in one launch (silu_gate.py), where torch runs two; gelu_tanh_mul (GeGLU) and
            activation (the MLPs without gate) likewise
  fp32_norm the norms rounded once from fp32 (Gemma's, OLMo's, LayerNorm) in rms_norm's launch
  rope      q and k rotated in place in one launch (rope.py), where torch runs about ten kernels (the cos/sin
            rows are the rotary embedding's, computed once per forward)

Each kernel rounds as the torch ops do (their docstrings): outputs match TorchOps up to the evaluation order of
fp32 reductions (and gelu's tanh, computed as a sigmoid). Inputs the kernels do not take (another device, mixed
dtypes, a strided last dimension, another dtype) take `fallback`. The kernels' grids depend only on shapes, so they
run inside the decode CUDA graphs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from .rmsnorm import fp32_norm, rmsnorm
from .rope import rope_
from .silu_gate import activation, gelu_gate, silu_gate

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TritonOps:
    """A model's per-token ops (module docstring); `fallback` has the same ops (the model's torch ops)."""

    def __init__(self, fallback):
        self.fallback = fallback

    def rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
        """-> (weight * norm(x + residual), x + residual) (x alone when residual is None)."""
        if not _norm_ours(x, residual, weight):
            return self.fallback.rms_norm(x, residual, weight, eps)
        if residual is None:
            return rmsnorm(x, weight, eps), x
        return rmsnorm(x, weight, eps, residual)

    def rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary):
        """q [T, Hq, D], k [T, Hkv, D] at positions [T] -> (q, k) rotated in place; other layouts: the fallback."""
        if (q.dim() != 3 or k.dim() != 3 or positions.dim() != 1 or not _ours(q, k) or k.shape[0] != q.shape[0]
                or k.shape[2] != q.shape[2]):
            return self.fallback.rope(q, k, positions, rotary)
        cos, sin = rotary(positions, q.dtype)  # [T, 1, R], R <= D
        if cos.shape[:2] != (q.shape[0], 1) or not (cos.is_contiguous() and sin.is_contiguous()):
            return self.fallback.rope(q, k, positions, rotary)
        rope_(q, k, cos, sin)
        return q, k

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not _ours(gate, up) or gate.shape != up.shape:
            return self.fallback.silu_mul(gate, up)
        return silu_gate(gate, up)

    def fp32_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                  offset: float, centered: bool, bias: Optional[torch.Tensor] = None):
        """-> ((offset + weight) * norm(x + residual) + bias, x + residual), rounded once from fp32."""
        if not _norm_ours(x, residual, weight, bias):
            return self.fallback.fp32_norm(x, residual, weight, eps, offset, centered, bias)
        if residual is None:
            return fp32_norm(x, weight, eps, offset, centered, bias), x
        return fp32_norm(x, weight, eps, offset, centered, bias, residual)

    def gelu_tanh_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not _ours(gate, up) or gate.shape != up.shape:
            return self.fallback.gelu_tanh_mul(gate, up)
        return gelu_gate(gate, up)

    def activation(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        if not _ours(x, x):
            return self.fallback.activation(x, kind)
        return activation(x, kind)


def _norm_ours(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
               bias: Optional[torch.Tensor] = None) -> bool:
    """The norm kernels take x, weight and bias (where given) alike, and a residual (where given) shaped as x."""
    return _ours(x, weight) and (residual is None or (_ours(residual, x) and residual.shape == x.shape)) and (
        bias is None or _ours(bias, x))


def _ours(x: torch.Tensor, other: torch.Tensor) -> bool:
    """Both on one CUDA device (or in Triton's CPU interpreter), in one kernel dtype, their last dims contiguous."""
    on_device = x.is_cuda or bool(triton.knobs.runtime.interpret)
    return (on_device and x.device == other.device and x.dtype == other.dtype and x.dtype in KERNEL_DTYPES
            and x.stride(-1) == 1 and other.stride(-1) == 1)

# silu_gate - gate [T, I], up [T, I] (may be strided halves of one gate_up output) -> silu(gate) * up [T, I],
#             fp16/bf16/fp32
"""Fused SwiGLU activation, rounding like torch's two ops: a = silu(gate) in fp32 rounded to the dtype, then
a * up computed in fp32 and rounded. Grid (T, cdiv(I, BLOCK)): program (t, c) handles columns [c*BLOCK, +BLOCK).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import exact_bf16_cast, round_to


@triton.jit
def _silu_gate_kernel(
    g_ptr, u_ptr, out_ptr,  # gate [T, I], up [T, I], out [T, I]; columns contiguous
    I, stride_g, stride_u, stride_o,  # row strides
    EXACT_BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    a = round_to(g / (1.0 + tl.exp(-g)), out_ptr.dtype.element_ty, EXACT_BF16).to(tl.float32)  # silu(gate), as torch
    tl.store(out_ptr + row * stride_o + offs, round_to(a * u, out_ptr.dtype.element_ty, EXACT_BF16), mask=mask)


def silu_gate(gate: torch.Tensor, up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up [..., I] in gate.dtype."""
    assert gate.shape == up.shape and gate.dtype == up.dtype, "gate and up alike"
    i = gate.shape[-1]
    g2, u2 = gate.reshape(-1, i), up.reshape(-1, i)
    assert g2.stride(1) == 1 and u2.stride(1) == 1, "I must be contiguous"
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    block = min(block, triton.next_power_of_2(i))
    _silu_gate_kernel[(g2.shape[0], triton.cdiv(i, block))](
        g2, u2, out, i, g2.stride(0), u2.stride(0), out.stride(0), EXACT_BF16=exact_bf16_cast(gate.dtype), BLOCK=block,
    )
    return out.reshape(gate.shape)


def silu_gate_ref(gate, up):
    """Pure torch `silu_gate`."""
    return torch.nn.functional.silu(gate) * up

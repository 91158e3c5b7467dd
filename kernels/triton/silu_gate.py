# silu_gate - gate [T, I], up [T, I] (may be strided halves of one gate_up output) -> silu(gate) * up [T, I],
#             fp16/bf16/fp32
"""Fused SwiGLU activation, rounding like torch's two ops: a = silu(gate) in fp32 rounded to the dtype, then
a * up computed in fp32 and rounded. gelu_gate is GeGLU (gelu's tanh approximation, as g * sigmoid(2y)) the same
way; activation is the gelu or relu(x)^2 of an MLP without gate, rounded once. Grid (T, cdiv(I, BLOCK)): program
(t, c) handles columns [c*BLOCK, +BLOCK).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import exact_bf16_cast, round_to


SILU, GELU_TANH, RELU2 = 0, 1, 2  # ACT
ACTIVATIONS = {"gelu_tanh": GELU_TANH, "relu2": RELU2}  # TorchOps.activation's kinds


@triton.jit
def _silu_gate_kernel(
    g_ptr, u_ptr, out_ptr,  # gate [T, I], up [T, I] (read when HAS_UP), out [T, I]; columns contiguous
    I, stride_g, stride_u, stride_o,  # row strides
    ACT: tl.constexpr, HAS_UP: tl.constexpr, EXACT_BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:  # SILU
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:  # GELU_TANH: 0.5 g (1 + tanh(y)) = g * sigmoid(2y)
        a = g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g)))
    else:  # RELU2
        a = tl.maximum(g, 0.0) * tl.maximum(g, 0.0)
    if HAS_UP:  # a rounded first, as torch's act(gate) * up
        u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
        a = round_to(a, out_ptr.dtype.element_ty, EXACT_BF16).to(tl.float32) * u
    tl.store(out_ptr + row * stride_o + offs, round_to(a, out_ptr.dtype.element_ty, EXACT_BF16), mask=mask)


def silu_gate(gate: torch.Tensor, up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up [..., I] in gate.dtype."""
    return _launch(gate, up, SILU, block)


def gelu_gate(gate: torch.Tensor, up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate, up [..., I] -> gelu_tanh(gate) * up [..., I] in gate.dtype."""
    return _launch(gate, up, GELU_TANH, block)


def activation(x: torch.Tensor, kind: str, block: int = 1024) -> torch.Tensor:
    """x [..., I] -> ACTIVATIONS[kind](x) [..., I] in x.dtype."""
    return _launch(x, None, ACTIVATIONS[kind], block)


def _launch(gate: torch.Tensor, up: torch.Tensor | None, act: int, block: int) -> torch.Tensor:
    assert up is None or (gate.shape == up.shape and gate.dtype == up.dtype), "gate and up alike"
    i = gate.shape[-1]
    g2 = gate.reshape(-1, i)
    u2 = g2 if up is None else up.reshape(-1, i)
    assert g2.stride(1) == 1 and u2.stride(1) == 1, "I must be contiguous"
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    block = min(block, triton.next_power_of_2(i))
    _silu_gate_kernel[(g2.shape[0], triton.cdiv(i, block))](
        g2, u2, out, i, g2.stride(0), u2.stride(0), out.stride(0), ACT=act, HAS_UP=up is not None,
        EXACT_BF16=exact_bf16_cast(gate.dtype), BLOCK=block,
    )
    return out.reshape(gate.shape)


def silu_gate_ref(gate, up):
    """Pure torch `silu_gate`."""
    return torch.nn.functional.silu(gate) * up

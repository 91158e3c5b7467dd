"""Fused RMSNorm(+residual) and SiLU-gate kernels against the model's own modules and torch ops.

Runs under TRITON_INTERPRET=1 on CPU (tests/kernels/triton_env.py), compiled on CUDA with TRITON_INTERPRET=0.
Tolerances: fp32 1e-5; fp16 1 ulp (rtol 1e-3: tl.rsqrt may differ from torch.rsqrt in the last fp32 bit);
bf16 2 ulps (rtol 1.6e-2: the interpreter converts fp32 -> bf16 by truncation, GPUs round to nearest).
"""

from __future__ import annotations

from tests.kernels.triton_env import DEVICE  # first: sets TRITON_INTERPRET before triton loads

import pytest
import torch
import torch.nn.functional as F

from quantkit.kernels.triton import rmsnorm, silu_gate
from quantkit.models.llama import RMSNorm

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("hidden", [64, 72])  # a power of two and a masked row
def test_rmsnorm_matches_model_module(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(2, 3, hidden, generator=gen) * 4).to(DEVICE, dtype)
    residual = torch.randn(2, 3, hidden, generator=gen).to(DEVICE, dtype)
    norm = RMSNorm(hidden, 1e-5).to(DEVICE, dtype)
    norm.weight.data = (torch.rand(hidden, generator=gen) + 0.5).to(DEVICE, dtype)
    with torch.no_grad():
        expected_plain, expected_fused = norm(x), norm(x + residual)
    torch.testing.assert_close(rmsnorm.rmsnorm(x, norm.weight.data, 1e-5), expected_plain, **TOL[dtype])
    out, new_residual = rmsnorm.rmsnorm(x, norm.weight.data, 1e-5, residual)
    torch.testing.assert_close(new_residual, x + residual, **TOL[dtype])
    torch.testing.assert_close(out, expected_fused, **TOL[dtype])
    ref_out, ref_residual = rmsnorm.rmsnorm_ref(x, norm.weight.data, 1e-5, residual)
    assert torch.equal(ref_out, expected_fused) and torch.equal(ref_residual, x + residual)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_silu_gate_on_strided_halves(dtype):
    gate_up = (torch.randn(5, 2 * 200, generator=torch.Generator().manual_seed(0)) * 3).to(DEVICE, dtype)
    gate, up = gate_up[:, :200], gate_up[:, 200:]  # row stride 400: the halves of one fused projection
    out = silu_gate.silu_gate(gate, up, block=64)
    torch.testing.assert_close(out, F.silu(gate) * up, **TOL[dtype])

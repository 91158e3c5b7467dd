"""TritonOps (kernels/triton/layer_ops.py), the per-token ops serving sets on CUDA: which inputs take the Triton
kernels and which the fallback, RoPE (kernels/triton/rope.py) against the model's apply_rope, the fp32-rounded norms
and the GeGLU / relu^2 / gelu activations against TorchOps, and a model's logits with them against the same model
on its torch ops (Llama, Gemma 2, OLMo 2, Cohere, StarCoder2, Nemotron).

Runs under TRITON_INTERPRET=1 on CPU (tests/kernels/triton_env.py), compiled on CUDA with TRITON_INTERPRET=0.
RoPE rounds bf16 itself in the interpreter (common.round_to); the norms do not, so the model runs in fp32 and fp16
only (the interpreter rounds fp32 -> bf16 by truncation: tests/kernels/test_kernels_fused.py).
"""

from __future__ import annotations

from tests.kernels.triton_env import DEVICE  # first: sets TRITON_INTERPRET before triton loads

import pytest
import torch

from quantkit.kernels.triton.layer_ops import TritonOps
from quantkit.kernels.triton.rmsnorm import rmsnorm
from quantkit.kernels.triton.silu_gate import silu_gate
from quantkit.models.layers import RotaryEmbedding, TorchOps, apply_rope
from quantkit.models.llama import LlamaForCausalLM, ModelConfig
from tests.conftest import tiny_hf_config


def test_contiguous_rows_take_the_kernels_and_the_rest_the_fallback():
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, 64, generator=gen).to(DEVICE, torch.float16) for _ in range(2))
    weight = (torch.rand(64, generator=gen) + 0.5).to(DEVICE, torch.float16)
    ops = TritonOps(TorchOps)
    out, total = ops.rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_total = rmsnorm(x, weight, 1e-5, residual)
    assert torch.equal(out, expected_out) and torch.equal(total, expected_total)
    out, same = ops.rms_norm(x, None, weight, 1e-5)
    assert torch.equal(out, rmsnorm(x, weight, 1e-5)) and same is x
    gate, up = x[:, :32], x[:, 32:]  # strided halves of one gate_up output, last dim contiguous
    assert torch.equal(ops.silu_mul(gate, up), silu_gate(gate, up))
    columns = x.t()  # [64, 5], the last dim strided: the fallback's, bit for bit
    assert torch.equal(ops.silu_mul(columns, columns), TorchOps.silu_mul(columns, columns))
    weight5 = (torch.rand(5, generator=gen) + 0.5).to(DEVICE, torch.float16)
    for got, want in zip(ops.rms_norm(columns, None, weight5, 1e-5), TorchOps.rms_norm(columns, None, weight5, 1e-5)):
        assert torch.equal(got, want)
    mixed = ops.rms_norm(x, residual.float(), weight, 1e-5)  # mixed dtypes: the fallback's
    assert all(torch.equal(a, b) for a, b in zip(mixed, TorchOps.rms_norm(x, residual.float(), weight, 1e-5)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("partial", [1.0, 0.75])  # 0.75: the first 12 of 16 dims rotate, 4 pass through
def test_rope_rotates_q_and_k_in_place_as_apply_rope_does(dtype, partial):
    """Paged [T, H, D] rows (q with a token stride, as a view of a wider projection) bit for bit against the
    model's apply_rope on its rotary embedding's cos/sin; a dense [B, L, H, D] batch takes the fallback."""
    cfg = ModelConfig.from_hf(tiny_hf_config(vocab_size=256, partial_rotary_factor=partial))
    rotary = RotaryEmbedding(cfg).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    t, hq, hkv, d = 7, 4, 2, cfg.head_dim
    wide = torch.randn(t, (hq + 1) * d, generator=gen).to(DEVICE, dtype)
    q = wide[:, : hq * d].view(t, hq, d)  # token stride (hq + 1) * d
    k = torch.randn(t, hkv, d, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([0, 1, 2, 5, 9, 40, 100], device=DEVICE)
    cos, sin = rotary(positions, dtype)
    expected_q, expected_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    dense_q, dense_k = q.reshape(1, t, hq, d).clone(), k.reshape(1, t, hkv, d).clone()  # before the rotation
    got_q, got_k = TritonOps(TorchOps).rope(q, k, positions, rotary)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    got_q, got_k = TritonOps(TorchOps).rope(dense_q, dense_k, positions, rotary)
    assert got_q.data_ptr() != dense_q.data_ptr()  # the fallback's new tensors
    assert torch.equal(got_q[0], expected_q) and torch.equal(got_k[0], expected_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("offset, centered, biased", [(0.0, False, False), (1.0, False, False), (0.0, True, False),
                                                     (1.0, True, True)])  # OLMo 2, Gemma, Cohere, Nemotron
def test_fp32_norms_and_activations_match_the_torch_ops(dtype, offset, centered, biased):
    gen = torch.Generator().manual_seed(2)
    x = (2 + torch.randn(5, 96, generator=gen)).to(DEVICE, dtype)
    residual = torch.randn(5, 96, generator=gen).to(DEVICE, dtype)
    weight = (0.1 * torch.randn(96, generator=gen)).to(DEVICE, dtype)
    bias = torch.randn(96, generator=gen).to(DEVICE, dtype) if biased else None
    ops, tol = TritonOps(TorchOps), 1e-5 if dtype == torch.float32 else 4e-3
    for residual_or_none in (residual, None):
        got = ops.fp32_norm(x, residual_or_none, weight, 1e-6, offset, centered, bias)
        want = TorchOps.fp32_norm(x, residual_or_none, weight, 1e-6, offset, centered, bias)
        torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
        assert torch.equal(got[1], want[1])
    gate, up = x[:, :48] - 2, x[:, 48:]  # strided halves of one gate_up output
    torch.testing.assert_close(ops.gelu_tanh_mul(gate, up), TorchOps.gelu_tanh_mul(gate, up), rtol=tol, atol=tol)
    for kind in ("gelu_tanh", "relu2"):
        torch.testing.assert_close(ops.activation(gate, kind), TorchOps.activation(gate, kind), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float16, 2e-2)])
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "olmo2", "cohere", "starcoder2", "nemotron"])
def test_a_model_on_the_triton_ops_gives_its_torch_logits(dtype, atol, model_type):
    """The ops' contract as the model uses it: every norm (residual adds fused), every gated or plain activation."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(tiny_hf_config(model_type, vocab_size=256))).to(DEVICE, dtype).eval()
    ids = torch.randint(3, 256, (2, 12), device=DEVICE)
    with torch.inference_mode():
        expected = model(ids).float()
        model.set_ops(TritonOps(TorchOps))
        got = model(ids).float()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)

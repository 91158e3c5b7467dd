"""The fused CPU kernels (kernels/cpu/fused.py) against their torch references (*_ref) and the model's plain torch
ops (TorchOps, their fallback), per dtype, on strided views like the ones the runner hands them, and a whole model
run through each; the RoPE table against the model's rotary embedding; the launchers' refusals."""

from __future__ import annotations

import pytest
import torch

from quantkit.models.llama import LlamaForCausalLM, ModelConfig, RotaryEmbedding, TorchOps
from quantkit.kernels.cpu import fused
from quantkit.kernels.cpu.fused import CpuFusedOps
from tests.conftest import tiny_hf_config

# fp32: the kernels' exp and reciprocal are polynomial (~1e-7 relative); bf16/fp16: one rounding step of the
# output (the torch path rounds after every op, the kernels once)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
DTYPES = list(TOLERANCE)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def ops():
    ops = CpuFusedOps.load(TorchOps)
    if ops is None:
        pytest.fail("the fused CPU kernels did not build: a C compiler (gcc) is expected on this machine")
    return ops


def close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_add_rms_norm(ops, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 200, generator=gen).to(dtype)
    x = wide[:, 8:104]  # a strided row view, as a slice of a fused projection would be
    residual = torch.randn(rows, 96, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    got, total = ops.rms_norm(x, residual, weight, 1e-5)
    want, want_total = TorchOps.rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, want_total)  # one rounding of the sum in both
    close(got, want, dtype)
    ref, ref_total = fused.add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(ref_total, total)
    close(got, ref, dtype)
    alone, same = ops.rms_norm(x, None, weight, 1e-5)
    assert same is x
    close(alone, TorchOps.rms_norm(x, None, weight, 1e-5)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset, centered, biased", [(0.0, False, False), (1.0, False, False), (0.0, True, False),
                                                     (0.0, True, True), (1.0, True, True)])
def test_fp32_norm(ops, dtype, offset, centered, biased):  # OLMo 2, Gemma, Cohere, StarCoder2, Nemotron
    gen = torch.Generator().manual_seed(int(offset) + 2 * centered + 4 * biased)
    x = (3 + torch.randn(9, 200, generator=gen)).to(dtype)[:, 8:104]  # strided rows, far from zero mean
    residual = torch.randn(9, 96, generator=gen).to(dtype)
    weight = (0.1 * torch.randn(96, generator=gen)).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype) if biased else None
    got, total = ops.fp32_norm(x, residual, weight, 1e-6, offset, centered, bias)
    want, want_total = TorchOps.fp32_norm(x, residual, weight, 1e-6, offset, centered, bias)
    assert torch.equal(total, want_total)
    close(got, want, dtype)
    ref, _ = fused.add_fp32_norm_ref(x, residual, weight, 1e-6, offset, centered, bias)
    close(got, ref, dtype)
    alone, same = ops.fp32_norm(x, None, weight, 1e-6, offset, centered, bias)
    assert same is x
    close(alone, TorchOps.fp32_norm(x, None, weight, 1e-6, offset, centered, bias)[0], dtype)
    if centered and dtype == torch.float32:  # the mean is subtracted: a shifted row norms alike (exact x + 5)
        close(ops.fp32_norm(x + 5, None, weight, 1e-6, offset, centered, bias)[0], alone, dtype)
    if biased and not offset:  # torch's own LayerNorm
        close(alone, torch.nn.functional.layer_norm(x, (96,), weight, bias, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["relu2", "gelu_tanh"])
def test_activations_of_mlps_without_gate(ops, dtype, kind):
    gen = torch.Generator().manual_seed(5)
    x = (4 * torch.randn(7, 200, generator=gen)).to(dtype)[:, 30:130]  # strided rows
    x[0, :7] = torch.tensor([-200.0, -90.0, -1e-3, 0.0, 1e-3, 90.0, 200.0]).to(dtype)
    got = ops.activation(x, kind)
    close(got, TorchOps.activation(x, kind), dtype)
    close(got, fused.activation_ref(x, kind), dtype)
    if kind == "relu2":  # max(x, 0)^2 rounded once, as torch rounds it
        assert torch.equal(got, TorchOps.activation(x, kind))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("act", ["silu_mul", "gelu_tanh_mul"])
def test_gated_activations(ops, dtype, rows, act):
    gen = torch.Generator().manual_seed(rows)
    gate_up = (6 * torch.randn(rows, 2 * 80, generator=gen)).to(dtype)  # [T, 2I]: gate | up, strided halves
    gate, up = gate_up[:, :80], gate_up[:, 80:]
    kernel, torch_op, ref = getattr(ops, act), getattr(TorchOps, act), getattr(fused, f"{act}_ref")
    close(kernel(gate, up), torch_op(gate, up), dtype)
    close(kernel(gate, up), ref(gate, up), dtype)
    extreme = torch.tensor([[-200.0, -90.0, -1e-3, 0.0, 1e-3, 90.0, 200.0]]).to(dtype)
    close(kernel(extreme, torch.ones_like(extreme)), torch_op(extreme, torch.ones_like(extreme)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                     YARN])  # YaRN: cos and sin scaled by its attention factor
@pytest.mark.parametrize("partial", [1.0, 0.75])  # 0.75: the first 24 of 32 dims rotate, the rest pass through
def test_rope_in_place_matches_torch(ops, dtype, scaling, partial):
    cfg = ModelConfig.from_hf(tiny_hf_config("llama", rope_scaling=scaling, rope_theta=10000.0, head_dim=32,
                                             partial_rotary_factor=partial))
    rotary = RotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(3)
    tokens, hq, hkv, d = 11, 4, 2, cfg.head_dim
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)  # one fused projection's output
    q, k = qkv[:, : hq * d].view(tokens, hq, d), qkv[:, hq * d: (hq + hkv) * d].view(tokens, hkv, d)
    positions = torch.tensor([0, 1, 2, 15, 16, 17, 300, 301, 1000, 5, 5])
    q_before, k_before = q.clone(), k.clone()
    want_q, want_k = TorchOps.rope(q.clone(), k.clone(), positions, rotary)
    got_q, got_k = ops.rope(q, k, positions, rotary)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)
    table = ops.rope_table(positions, rotary)
    assert table.shape[0] > 1000
    # no FMA contraction in the kernel: the same fp32 products and sums as the reference, one rounding
    assert torch.equal(got_q, fused.rope_ref(q_before, positions, table))
    assert torch.equal(got_k, fused.rope_ref(k_before, positions, table))


def test_kv_store_equals_index_copy(ops):
    gen = torch.Generator().manual_seed(0)
    caches = [torch.zeros(6, 4, 2, 8, dtype=torch.bfloat16) for _ in range(4)]
    kv = torch.randn(5, 3 * 16, generator=gen).to(torch.bfloat16)  # rows of q | k | v, k and v strided
    k, v = kv[:, 16:32].view(5, 2, 8), kv[:, 32:].view(5, 2, 8)
    slots = torch.tensor([3, 0, 23, 9, 10])
    ops.kv_store(k, v, caches[0], caches[1], slots)
    fused.kv_store_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "olmo2", "cohere"])  # + (1 + w) norms, GeGLU; fp32 norms
def test_model_with_fused_ops_matches_torch_ops(ops, dtype, model_type):
    """The dense path (rope falls back to torch for [B, L, H, D]) and the flat paged layout both agree."""
    cfg = ModelConfig.from_hf(tiny_hf_config(model_type))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    for norm in (m for m in model.modules() if hasattr(m, "weight_offset")):  # not the init's ones: w matters
        torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        want = model(ids)
        model.set_ops(ops)
        got = model(ids)
        model.set_ops(TorchOps)
    tol = 1e-4 if dtype == torch.float32 else 0.15
    torch.testing.assert_close(got, want, atol=tol, rtol=0)


def test_rope_table_is_the_rotary_embeddings_cos_and_sin(ops):
    """Row p = cos | sin of the fp32 angles RotaryEmbedding.forward computes at position p, bit for bit; checked
    once per positions tensor, grown by doubling, rebuilt for another inv_freq."""
    cfg = ModelConfig.from_hf(tiny_hf_config("llama", rope_theta=10000.0, head_dim=32))
    rotary = RotaryEmbedding(cfg)
    ops = CpuFusedOps(ops.lib, TorchOps)  # a fresh table
    positions = torch.tensor([0, 7, 255, 3, 100])
    table = ops.rope_table(positions, rotary)
    assert table.shape == (256, 32) and table.dtype == torch.float32
    cos, sin = rotary(positions, torch.float32)  # [T, 1, D], each half the same angles
    assert torch.equal(table[positions], torch.cat((cos[:, 0, :16], sin[:, 0, :16]), dim=-1))
    assert ops.rope_table(positions, rotary) is table  # the same forward: no check, no rebuild
    grown = ops.rope_table(torch.tensor([300]), rotary)
    assert grown.shape[0] == 512 and torch.equal(grown[:256], table)
    assert ops.rope_table(torch.tensor([5]), rotary) is grown  # smaller positions reuse it
    rotary.inv_freq = rotary.inv_freq * 0.5  # another tensor (a model with other RoPE scaling): rebuilt, same size
    rebuilt = ops.rope_table(torch.tensor([5]), rotary)
    cos, sin = rotary(torch.arange(512), torch.float32)
    assert torch.equal(rebuilt, torch.cat((cos[:, 0, :16], sin[:, 0, :16]), dim=-1))
    yarn = RotaryEmbedding(ModelConfig.from_hf(tiny_hf_config("llama", rope_scaling=YARN, head_dim=32)))
    assert yarn.attention_factor == pytest.approx(1.1386, abs=1e-4)  # 0.1 ln(4) + 1
    cos, sin = yarn(positions, torch.float32)  # scaled by the attention factor, in the table too
    assert torch.equal(ops.rope_table(positions, yarn)[positions], torch.cat((cos[:, 0, :16], sin[:, 0, :16]), -1))


def test_inputs_the_kernels_do_not_cover_take_the_fallback(ops):
    class Recorder:
        calls = []

        @staticmethod
        def silu_mul(gate, up):
            Recorder.calls.append("silu_mul")
            return TorchOps.silu_mul(gate, up)

    mixed = CpuFusedOps(ops.lib, Recorder)
    gate = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(mixed.silu_mul(gate, gate), TorchOps.silu_mul(gate, gate)) and Recorder.calls == ["silu_mul"]


def test_launchers_refuse_what_the_kernels_do_not_take(ops):
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, None, torch.ones(32).bfloat16(), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        ops.rms_norm(x, torch.randn(4, 32).bfloat16(), torch.ones(64).bfloat16(), 1e-5)
    with pytest.raises(ValueError, match="row contiguous"):
        ops.rms_norm(torch.randn(64, 4).bfloat16().T, None, torch.ones(64).bfloat16(), 1e-5)
    with pytest.raises(ValueError, match="silu_mul"):
        ops.silu_mul(x, x[:, :32])
    cfg = ModelConfig.from_hf(tiny_hf_config("llama", head_dim=32))
    q, k = torch.randn(4, 2, 64).bfloat16(), torch.randn(4, 1, 64).bfloat16()
    with pytest.raises(ValueError, match="rope"):  # the rotary embedding turns 32 dims, wider than the heads' 16
        ops.rope(q[..., :16].contiguous(), k[..., :16].contiguous(), torch.arange(4), RotaryEmbedding(cfg))
    k_cache = torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv_store"):
        ops.kv_store(k, k, k_cache, k_cache, torch.arange(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_store"):
        ops.kv_store(k.float(), k.float(), k_cache, k_cache, torch.arange(4))

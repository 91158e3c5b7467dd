"""kernels/cpu/gemm.py (AMX tile GEMMs) and serve/cpu_linear.py (PackedLinear, FusedLinear) against independent references.

Exactness: one-hot input rows select single weights; an fp32 sum of one bf16 product rounded back to bf16 is that
weight exactly, so the identity matrix through the GEMM must reproduce W.T bit for bit (every tile, padded last
row tile, row chunk and odd column block included). Random inputs are then held to the fp32 reference within bf16
output rounding plus fp32 accumulation error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantkit.config import QuantScheme
from quantkit.models.llama import Attention, LlamaForCausalLM, ModelConfig, TorchOps
from quantkit.quant.qlinear import _AMX_MIN_M, QLinear
from quantkit.quant.scheme import QTensor, dequantize, quantize_rtn
from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.kernels.cpu.fused import CpuFusedOps
from quantkit.serve.cpu_linear import FusedLinear, PackedLinear, pack_linears
from quantkit.serve.prepare import FusedAttention, FusedMLP, fuse_projections
from tests.conftest import tiny_hf_config

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="the CPU has no AMX (or Linux refused it)")

# N = 48: three 16-column blocks (a pair and a lone block); K = 320: ten 32-deep tile steps
N, K = 48, 320


def weight(n=N, k=K, seed=0) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()


def test_pack_round_trip_and_unfit_shapes():
    w = weight()
    packed = cpu_gemm.pack_bf16(w)
    assert packed.shape == (N // 16, K // 2, 16)
    assert torch.equal(cpu_gemm.unpack_bf16(packed), w)
    # element [b, r, n]: W[16b + n, 2r] in the low half, W[16b + n, 2r + 1] in the high half
    bits = w.view(torch.int16).to(torch.int32) & 0xFFFF
    assert int(packed[2, 5, 3]) & 0xFFFF == int(bits[35, 10]) and (int(packed[2, 5, 3]) >> 16) & 0xFFFF == int(bits[35, 11])
    assert cpu_gemm.pack_bf16(weight(40, K)) is None and cpu_gemm.pack_bf16(weight(N, 48)) is None


# rows: a padded single row, a partial second row tile, exact tiles, partial tiles across row chunks
@pytest.mark.parametrize("rows", [1, 17, 32, 40, 128, 161, 300])
def test_one_hot_rows_reproduce_the_weight_exactly(rows):
    w = weight()
    eye = torch.eye(K, dtype=torch.bfloat16)
    index = torch.arange(rows) % K
    y = cpu_gemm.matmul_bf16(eye[index].contiguous(), cpu_gemm.pack_bf16(w))
    assert torch.equal(y, w.T[index])


@pytest.mark.parametrize("rows", [3, 64, 257])
def test_random_rows_match_the_fp32_reference(rows):
    w = weight(seed=1)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).bfloat16()
    y = cpu_gemm.matmul_bf16(x, cpu_gemm.pack_bf16(w))
    ref = cpu_gemm.matmul_bf16_ref(x, w)
    # bf16 output rounding (2^-8 relative) + fp32 accumulation over K terms
    bound = 2**-8 * ref.abs() + K * 2**-23 * (x.float().abs() @ w.float().abs().T)
    assert bool(((y.float() - ref).abs() <= bound).all())


@pytest.mark.parametrize("act", [False, True])
def test_a_row_is_the_same_bits_in_every_batch_and_thread_count(act):
    """What batch-invariant serving relies on (serve/cpu_linear.py): row i of an M-row call equals row i computed
    alone and at another offset, for M across row tiles, padded tails and row chunks, at 1 and 2 threads."""
    w = weight(64, K, seed=2)  # four blocks: two gate/up pairs for act
    x = torch.randn(300, K, generator=torch.Generator().manual_seed(3)).bfloat16()
    packed = cpu_gemm.pack_bf16(w)
    alone = torch.cat([cpu_gemm.matmul_bf16(x[i:i + 1].contiguous(), packed, act) for i in range(x.shape[0])])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert cpu_gemm.matmul_bf16(x[:0], packed, act).shape == (0, 32 if act else 64)
            for m in (1, 2, 5, 16, 17, 33, 64, 129, 293):
                for start in (0, 7):
                    y = cpu_gemm.matmul_bf16(x[start:start + m].contiguous(), packed, act)
                    assert torch.equal(y, alone[start:start + m]), (threads, m, start)
    finally:
        torch.set_num_threads(before)


def test_packed_linear_matches_nn_linear():
    linear = nn.Linear(K, N, bias=True).bfloat16()
    x = torch.randn(2, 5, K).bfloat16()
    layer = PackedLinear(linear, batch_hint=64)
    assert layer.vnni is not None
    y = layer(x)
    ref = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    assert y.shape == (2, 5, N) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2**-7)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_paths_agree_bit_for_bit(bits):
    """Above _FUSED_MAX_M rows the whole weight is dequantized first; below, per block pair: the same bf16 weights
    and the same tile sums, so the outputs are equal."""
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (N, K), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(N, K // 32, generator=gen) * 0.01 + 0.001).half()
    zeros = torch.randint(0, 2**bits, (N, K // 32), generator=gen, dtype=torch.uint8)
    packed = cpu_gemm.pack_quantized(codes, scales, zeros, bits, 32)
    rows = cpu_gemm._FUSED_MAX_M + 20
    x = torch.randn(rows, K, generator=gen).bfloat16()
    whole = cpu_gemm.matmul_quantized(x, packed, bits)
    parts = torch.cat([cpu_gemm.matmul_quantized(part.contiguous(), packed, bits) for part in x.split(100)])
    assert torch.equal(whole, parts)


def tiny_model(quantized_bits: int | None):
    """The tiny llama (hidden 64, q/k/v 64/32/32, MLP 128: every N a multiple of 16) in bf16, its linears
    PackedLinear, or RTN-quantized QLinear (group 32)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(tiny_hf_config("llama"))).bfloat16().eval()
    if quantized_bits is None:
        pack_linears(model, batch_hint=64)
        return model
    scheme = QuantScheme(bits=quantized_bits, group_size=32, sym=False)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, QLinear.from_qtensor(quantize_rtn(child.weight.detach().float(), scheme)))
    return model


@pytest.mark.parametrize("bits", [None, 4, 8])
@pytest.mark.parametrize("tokens", [3, 21, 300])  # W4/W8 below _AMX_MIN_M rows: the parts' own kernels
@pytest.mark.parametrize("ops", ["torch", "fused"])
def test_fused_projections_give_the_unfused_outputs_bit_for_bit(bits, tokens, ops):
    """Column blocks of a GEMM are computed independently, so one GEMM over q|k|v equals the three separate ones
    exactly; the gate/up epilogue rounds both products to bf16 and applies the same SiLU code as kernels/cpu/fused.py's
    silu_mul. With the fused ops the model's logits must not move at all; with torch's SiLU (a different
    formula) the fused epilogue's is within bf16 rounding."""
    model = tiny_model(bits)
    if ops == "fused":
        model.set_ops(CpuFusedOps.load(TorchOps))
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    state_keys = list(model.state_dict())
    with torch.no_grad():
        before = model(ids)
        assert fuse_projections(model) == 4  # 2 layers x (qkv, gate/up-SiLU)
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert isinstance(attn, FusedAttention) and attn.fused_qkv.sizes == [64, 32, 32]
        assert isinstance(mlp, FusedMLP) and isinstance(mlp.fused_gate_up, FusedLinear) and mlp.fused_gate_up.act
        assert [k for k, _ in model.state_dict().items()] == state_keys  # the model's state stays as loaded
        after = model(ids)
        alone = model.model.layers[1].mlp.gate_proj(torch.randn(5, 64).bfloat16())  # parts still run on their own
    if ops == "fused" or (bits is not None and tokens < _AMX_MIN_M):
        assert torch.equal(after, before)
    else:
        torch.testing.assert_close(after, before, atol=0.05, rtol=0.02)
    assert alone.shape == (5, 128)


def test_projections_with_different_packings_stay_apart():
    model = tiny_model(4)
    attn = model.model.layers[0].self_attn
    scheme = QuantScheme(bits=8, group_size=32, sym=False)
    attn.v_proj = QLinear.from_qtensor(quantize_rtn(torch.randn(32, 64), scheme))
    fuse_projections(model)
    assert type(attn) is Attention and isinstance(model.model.layers[0].mlp, FusedMLP)


def test_gate_up_epilogue_matches_the_reference():
    """act: the weight's 16-row blocks alternate gate and up; y = silu(gate) * up, both products rounded to bf16."""
    gate, up = weight(32, K, seed=2), weight(32, K, seed=3)
    w = torch.stack([gate.view(2, 16, K), up.view(2, 16, K)], dim=1).reshape(64, K)  # g0 u0 g1 u1
    x = torch.randn(21, K, generator=torch.Generator().manual_seed(4)).bfloat16()
    y = cpu_gemm.matmul_bf16(x, cpu_gemm.pack_bf16(w), act=True)
    ref = cpu_gemm.matmul_bf16_ref(x, w, act=True)
    assert y.shape == (21, 32) and torch.allclose(ref, F.silu((x.float() @ gate.float().T).bfloat16().float())
                                                  * (x.float() @ up.float().T).bfloat16().float(), atol=1e-6)
    torch.testing.assert_close(y.float(), ref, atol=1e-3, rtol=2**-7)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [5, cpu_gemm._FUSED_MAX_M + 1])
def test_prepared_quantized_weight_matches_the_reference(bits, rows):
    """prepare(qt) (act-order permutation + packing) then matmul_packed, against the format's dequantization."""
    gen = torch.Generator().manual_seed(bits + rows)
    g_idx = (torch.randperm(K, generator=gen) % (K // 32)).to(torch.int32)  # act-order, ten groups of 32
    qt = quantize_rtn(torch.randn(N, K, generator=gen) * 0.05, QuantScheme(bits=bits, group_size=32, sym=False))
    qt = QTensor(qt.codes, qt.zeros, qt.scales, g_idx, bits, 32, False)
    perm, packed = cpu_gemm.prepare(qt)
    assert torch.equal(qt.g_idx[perm], torch.arange(K) // 32)
    x = torch.randn(rows, K, generator=gen).bfloat16()
    y = cpu_gemm.matmul_packed(x, perm, packed, bits)
    ref = cpu_gemm.matmul_quantized_ref(x, qt)
    w = dequantize(qt, torch.bfloat16).float()
    bound = 2**-8 * ref.abs() + K * 2**-23 * (x.float().abs() @ w.abs().T)
    assert bool(((y.float() - ref).abs() <= bound).all())


def test_prepare_declines_shapes_the_kernel_does_not_take():
    scheme = QuantScheme(bits=4, group_size=32, sym=False)
    assert cpu_gemm.prepare(quantize_rtn(torch.randn(40, K), scheme)) is None  # N % 16
    assert cpu_gemm.prepare(quantize_rtn(torch.randn(N, 48), QuantScheme(bits=4, group_size=16, sym=False))) is None


def test_launchers_refuse_what_the_kernels_do_not_take():
    w = weight()
    packed = cpu_gemm.pack_bf16(w)
    x = torch.randn(3, K).bfloat16()
    for bad in (x.float(), torch.randn(K, 3).bfloat16().T, x[:, :K - 32].contiguous(), x[None]):
        with pytest.raises(ValueError, match="x must be"):
            cpu_gemm.matmul_bf16(bad, packed)
    with pytest.raises(ValueError, match="pack_bf16"):
        cpu_gemm.matmul_bf16(x, packed.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="pairs"):
        cpu_gemm.matmul_bf16(x, packed, act=True)  # three blocks: no gate/up pairs
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.uint8)
    scales = torch.rand(N, K // 32, generator=gen).half()
    quantized = cpu_gemm.pack_quantized(codes, scales, torch.zeros(N, K // 32, dtype=torch.uint8), 4, 32)
    with pytest.raises(ValueError, match="8-bit"):
        cpu_gemm.matmul_quantized(x, quantized, 8)  # 4-bit codes
    with pytest.raises(ValueError, match="pack_quantized"):
        cpu_gemm.matmul_quantized(x, (quantized[0], quantized[1][:, :5], 32), 4)  # qparams of half the groups
    with pytest.raises(ValueError, match="x must be"):
        cpu_gemm.matmul_quantized(x[:, :K - 32].contiguous(), quantized, 4)

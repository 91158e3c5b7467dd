"""kernels/cpu/rowwise_gemm.py (the row-invariant bf16 GEMM) and its serving modules (PackedLinear(rowwise=True),
FusedLinear over them; on AMX CPUs those modules run AMX's tile GEMM, also row-invariant, and are tested on both
kernels) against independent references, and the property serving relies on: a row's output bits
depend on that row alone, not on how many rows share the call, where it sits among them, or the thread count.

Exactness: one-hot rows select single weights (one bf16 product summed in fp32 and rounded back is the weight), so
the identity through the GEMM reproduces W.T bit for bit. Random inputs are held to the fp32 reference within bf16
output rounding plus fp32 accumulation error. The portable C path (CPUs without AVX-512 BF16) is built here too,
with that extension switched off, and held to the same properties."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quantkit.kernels.cpu import rowwise_gemm
from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.kernels.cpu.fused import CpuFusedOps
from quantkit.kernels.cpu.gemm import pack_bf16
from quantkit.models.llama import LlamaForCausalLM, ModelConfig, TorchOps
from quantkit.kernels.cpu.capability import onednn_bf16
from quantkit.serve import cpu_linear
from quantkit.serve.cpu_linear import FusedLinear, PackedLinear, pack_linears
from quantkit.serve.prepare import FusedAttention, FusedMLP, fuse_projections
from tests.conftest import tiny_hf_config
from tests.kernels.cpu_builds import cpu_flags, narrower_library

# N = 80: one panel of four 16-column blocks and a lone fifth block; K = 96: 48 pairs
N, K = 80, 96
ROW_COUNTS = (1, 2, 3, 5, 17, 64, 65, 300)  # register-block tails (M % 4), one row chunk (64) and past it


@pytest.fixture(scope="module", autouse=True)
def built():
    if not rowwise_gemm.available():
        pytest.fail("the rowwise GEMM did not build: a C compiler (gcc) is expected on this machine")


@pytest.fixture(params=["rowwise", "amx"])
def invariant_kernel(request, monkeypatch) -> str:
    """The row-invariant kernel PackedLinear(rowwise=True) takes: the rowwise GEMM (AMX reported absent, as on CPUs
    without it) or AMX's tile GEMM (skipped without AMX)."""
    if request.param == "amx" and not cpu_gemm.available():
        pytest.skip("the CPU has no AMX (or Linux refused it)")
    if request.param == "rowwise":
        monkeypatch.setattr(cpu_gemm, "available", lambda: False)
    return request.param


def weight(n=N, k=K, seed=0) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()


def rows(m, k=K, seed=1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def within_bf16(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """|y - ref| within bf16 output rounding (2^-8 relative) plus fp32 accumulation over K terms."""
    bound = 2**-8 * ref.abs() + x.shape[1] * 2**-23 * (x.float().abs() @ w.float().abs().T) + 1e-30
    return bool(((y.float() - ref).abs() <= bound).all())


def test_the_build_runs_the_widest_chain_the_cpu_has():
    flags = cpu_flags()
    expected = "avx512_bf16" if "avx512_bf16" in flags else "avx2" if {"avx2", "fma"} <= set(flags) else "portable"
    assert rowwise_gemm.isa() == expected
    assert rowwise_gemm.vectorised() == (expected != "portable")


@pytest.mark.parametrize("m", [1, 5, 64, 300])
def test_one_hot_rows_reproduce_the_weight_exactly(m):
    w = weight()
    index = torch.arange(m) % K
    y = rowwise_gemm.matmul(torch.eye(K, dtype=torch.bfloat16)[index].contiguous(), pack_bf16(w))
    assert torch.equal(y, w.T[index])


@pytest.mark.parametrize("n,k", [(N, K), (16, 32), (192, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_random_rows_match_the_fp32_reference(n, k, bias):
    w, x = weight(n, k), rows(67, k)
    b = (torch.randn(n, generator=torch.Generator().manual_seed(2))).bfloat16() if bias else None
    y = rowwise_gemm.matmul(x, pack_bf16(w), b)
    assert y.shape == (67, n) and y.dtype == torch.bfloat16
    assert within_bf16(y, rowwise_gemm.matmul_ref(x, w, b), x, w)  # the bias joins the sum before its rounding


@pytest.mark.parametrize("bias", [False, True])
def test_a_row_is_the_same_bits_in_every_batch_and_thread_count(bias):
    """Row i of an M-row call equals row i computed alone and inside every other M, at 1 and 2 threads."""
    w, x = weight(), rows(max(ROW_COUNTS))
    b = torch.randn(N, generator=torch.Generator().manual_seed(3)).bfloat16() if bias else None
    packed = pack_bf16(w)
    alone = torch.cat([rowwise_gemm.matmul(x[i:i + 1].contiguous(), packed, b) for i in range(x.shape[0])])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in ROW_COUNTS:
                for start in (0, 7):  # the same rows at another offset in the call
                    if start + m <= x.shape[0]:
                        y = rowwise_gemm.matmul(x[start:start + m].contiguous(), packed, b)
                        assert torch.equal(y, alone[start:start + m]), (threads, m, start)
    finally:
        torch.set_num_threads(before)


def gate_up(k=K):
    """Two 32 x K weights and their fused form for act: 16-row blocks alternating gate, up (g0 u0 g1 u1)."""
    gate, up = weight(32, k, seed=4), weight(32, k, seed=5)
    return gate, up, torch.stack([gate.view(2, 16, k), up.view(2, 16, k)], dim=1).reshape(64, k)


def test_gate_up_epilogue_is_the_fused_silu_mul_of_the_two_products():
    """act: silu(bf16(gate)) * bf16(up) with fused.py's SiLU code: bit-identical to the products then silu_mul."""
    gate, up, w = gate_up()
    x = rows(21)
    y = rowwise_gemm.matmul(x, pack_bf16(w), act=True)
    ops = CpuFusedOps.load(TorchOps)
    assert ops is not None
    separate = ops.silu_mul(rowwise_gemm.matmul(x, pack_bf16(gate)), rowwise_gemm.matmul(x, pack_bf16(up)))
    assert y.shape == (21, 32) and torch.equal(y, separate)
    torch.testing.assert_close(y.float(), rowwise_gemm.matmul_ref(x, w, act=True), atol=1e-3, rtol=2**-7)


def test_launcher_refuses_what_the_kernel_does_not_take():
    packed = pack_bf16(weight())
    x = rows(3)
    for bad in (x.float(), rows(K, 3).T, x[:, :K - 32].contiguous(), x[None]):
        with pytest.raises(ValueError, match="x must be"):
            rowwise_gemm.matmul(bad, packed)
    with pytest.raises(ValueError, match="pack_bf16"):
        rowwise_gemm.matmul(x, packed.transpose(1, 2).contiguous().transpose(1, 2))
    for bias in (torch.zeros(N), torch.zeros(N - 16, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="bias must be"):
            rowwise_gemm.matmul(x, packed, bias)
    with pytest.raises(ValueError, match="pairs"):
        rowwise_gemm.matmul(x, packed, act=True)  # five blocks: no gate/up pairs
    assert rowwise_gemm.matmul(x[:0], packed).shape == (0, N)


NARROWER_BUILDS = {"avx2": ("-mno-avx512bf16",), "portable": ("-mno-avx512bf16", "-mno-avx2", "-mno-fma")}


@pytest.mark.parametrize("chain", sorted(NARROWER_BUILDS))
def test_narrower_builds_keep_the_order_and_the_invariance(chain, tmp_path):
    """rowwise_gemm.c built without AVX-512 BF16 (its AVX2 + FMA chain) or without AVX2 either (its plain C
    chain): within bf16 of the reference, one-hot exact, and a row's bits independent of the batch."""
    lib = narrower_library("rowwise_gemm", NARROWER_BUILDS[chain], tmp_path,
                           {"rowwise_gemm": rowwise_gemm.SIGNATURES["rowwise_gemm"]},
                           {"avx2", "fma"} if chain == "avx2" else set())
    assert rowwise_gemm.ISAS[lib.rowwise_gemm_isa()] == chain
    fn = lib.rowwise_gemm
    w, x = weight(), rows(70)
    b = torch.randn(N, generator=torch.Generator().manual_seed(6)).bfloat16()
    packed = pack_bf16(w)

    def run(xs):
        y = torch.empty(xs.shape[0], N, dtype=torch.bfloat16)
        fn(xs.data_ptr(), xs.shape[0], K, packed.data_ptr(), packed.stride(0), N, b.data_ptr(), y.data_ptr(), 2, 0)
        return y

    y = run(x)
    assert within_bf16(y, rowwise_gemm.matmul_ref(x, w, b), x, w)
    for m in (1, 3, 17, 65):
        assert torch.equal(run(x[:m].contiguous()), y[:m])
    eye, eye_out = torch.eye(K, dtype=torch.bfloat16), torch.empty(K, N, dtype=torch.bfloat16)
    fn(eye.data_ptr(), K, K, packed.data_ptr(), packed.stride(0), N, None, eye_out.data_ptr(), 2, 0)
    assert torch.equal(eye_out, w.T)


def test_packed_linear_rowwise_matches_nn_linear(invariant_kernel):
    linear = nn.Linear(K, N, bias=True).bfloat16()
    layer = PackedLinear(linear, batch_hint=64, rowwise=True)
    assert layer.kernel == invariant_kernel and layer.row_invariant and layer.vnni is not None
    x = rows(10).view(2, 5, K)
    torch.testing.assert_close(layer(x).float(), nn.functional.linear(x.float(), linear.weight.float(),
                                                                        linear.bias.float()), atol=2e-2, rtol=2**-7)


def test_unfit_shapes_keep_a_batch_dependent_kernel_with_a_warning(caplog):
    """A shape the VNNI layout does not take stays on oneDNN where it has bf16 kernels, else on torch's own linear
    (not packed); either way the warning says invariance does not hold for it."""
    holder = nn.Sequential(nn.Linear(K, 40).bfloat16())  # N % 16: the rowwise GEMM does not take it
    with caplog.at_level("WARNING", logger="quantkit.serve"):
        packed = pack_linears(holder, batch_hint=64, rowwise=True)
    if onednn_bf16():
        assert packed == 1 and holder[0].kernel == "onednn" and not holder[0].row_invariant
    else:
        assert packed == 0 and type(holder[0]) is nn.Linear
    assert "batch invariance does not hold" in caplog.text


def test_without_onednn_bf16_every_mode_packs_for_the_rowwise_gemm(monkeypatch):
    """CPUs whose oneDNN has no bf16 kernels (AVX2): torch's bf16 GEMM is a portable path there, so serving's
    default (non-invariant) packing takes the rowwise GEMM too; shapes it does not take stay nn.Linear."""
    monkeypatch.setattr(cpu_linear, "onednn_bf16", lambda: False)
    monkeypatch.setattr(cpu_gemm, "available", lambda: False)
    holder = nn.Sequential(nn.Linear(K, N, bias=True), nn.Linear(K, 40)).bfloat16()
    w, b = holder[0].weight.detach(), holder[0].bias.detach()
    assert pack_linears(holder, batch_hint=64) == 1
    assert holder[0].kernel == "rowwise" and holder[0].row_invariant and type(holder[1]) is nn.Linear
    x = rows(7)
    assert within_bf16(holder[0](x), rowwise_gemm.matmul_ref(x, w, b), x, w)


@pytest.mark.parametrize("model_type", ["llama", "olmo2"])
@pytest.mark.parametrize("tokens", [1, 3, 21, 300])
def test_fused_rowwise_projections_give_the_unfused_outputs_bit_for_bit(tokens, model_type, invariant_kernel):
    """The tiny llama (biased q/k/v, so the fused bias path runs) and OLMo 2 (q and k normed over the whole
    projection: strided views of the fused output) packed rowwise, with the fused ops: fusing q/k/v and
    gate/up(-SiLU) on the row-invariant GEMM leaves the logits' bits unchanged."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(tiny_hf_config(model_type, attention_bias=True))).bfloat16().eval()
    pack_linears(model, batch_hint=64, rowwise=True)
    model.set_ops(CpuFusedOps.load(TorchOps))
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        before = model(ids)
        assert fuse_projections(model) == 4  # 2 layers x (qkv, gate/up-SiLU)
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert isinstance(attn, FusedAttention) and attn.q_proj.bias is not None
        assert attn.fused_qkv.rowwise == (invariant_kernel == "rowwise")
        assert isinstance(mlp, FusedMLP) and isinstance(mlp.fused_gate_up, FusedLinear) and mlp.fused_gate_up.act
        assert torch.equal(model(ids), before)

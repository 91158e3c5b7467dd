"""kernels/cpu/rowwise_gemm.py's qmatmul (W4/W8 on gemm.py's packing, each panel dequantized to bf16, then the
rowwise chains) against independent references: the format's bf16 dequantization (dequantize(qt, bfloat16)) through
the bf16 rowwise GEMM, bit for bit, so every code, zero, scale and act-order permutation is checked and a row's bits
do not depend on the batch; and where QLinear, FusedLinear and the step plans take it (qlinear.packed_kernel)."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.kernels.cpu import rowwise_gemm
from quantkit.kernels.cpu.fused import CpuFusedOps
from quantkit.models.llama import TorchOps
from quantkit.quant.qlinear import QLinear, packed_kernel
from quantkit.quant.scheme import QTensor, dequantize
from tests.kernels.test_cpu_gemv import SCHEME_IDS, SCHEMES, SHAPES, gate_up, packed_case

pytestmark = pytest.mark.skipif(not rowwise_gemm.quantized_available(),
                                reason="neither AVX512-BF16 nor AVX2 here (or no compiler): no W4/W8 rowwise GEMM")
ROW_COUNTS = (1, 5, 17, 64, 65, 300)  # register-block tails (M % 4), the decode range, prefill sizes


def reference(x: torch.Tensor, qt: QTensor, perm, act: bool = False) -> torch.Tensor:
    """The bf16 rowwise GEMM of the format's bf16 dequantization, its columns in the packing's group order."""
    w = dequantize(qt, torch.bfloat16)
    xp, wp = (x, w) if perm is None else (x[:, perm].contiguous(), w[:, perm])
    return rowwise_gemm.matmul(xp, cpu_gemm.pack_bf16(wp), act=act)


@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_hot_rows_reproduce_the_dequantized_weight_exactly(shape, scheme):
    qt, perm, packed = packed_case(shape, scheme, seed=3)
    eye = torch.eye(qt.shape[1], dtype=torch.bfloat16)
    xp = eye if perm is None else eye[:, perm].contiguous()
    assert torch.equal(rowwise_gemm.qmatmul(xp, packed, qt.bits), dequantize(qt, torch.bfloat16).T)


@pytest.mark.parametrize("m", ROW_COUNTS)
@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_random_rows_are_the_bf16_gemm_of_the_dequantized_weight(scheme, m):
    qt, perm, packed = packed_case((80, 320, 32), scheme, seed=m)
    x = torch.randn(m, 320, generator=torch.Generator().manual_seed(m)).bfloat16()
    xp = x if perm is None else x[:, perm].contiguous()
    assert torch.equal(rowwise_gemm.qmatmul(xp, packed, qt.bits), reference(x, qt, perm))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_is_the_same_bits_in_every_batch_and_thread_count(bits, one_thread):
    qt, _, packed = packed_case((48, 64, 64), (bits, False, False), seed=9)
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    torch.set_num_threads(1)
    y = rowwise_gemm.qmatmul(x, packed, bits)
    torch.set_num_threads(2)  # the one_thread fixture restores the count after the module
    for m in (1, 6, 33):
        assert torch.equal(rowwise_gemm.qmatmul(x[-m:].contiguous(), packed, bits), y[-m:])


@pytest.mark.parametrize("bits", [4, 8])
def test_gate_up_epilogue_is_the_products_through_silu_mul(bits):
    gate, up, packed = gate_up(bits)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(bits)).bfloat16()
    codes, qparams, gs = packed
    parts = [rowwise_gemm.qmatmul(x, (codes[i::2], qparams[i::2], gs), bits) for i in range(2)]  # strided views
    for part, qt in zip(parts, (gate, up)):
        assert torch.equal(part, reference(x, qt, None))
    ops = CpuFusedOps.load(TorchOps)
    assert ops is not None
    assert torch.equal(rowwise_gemm.qmatmul(x, packed, bits, act=True), ops.silu_mul(*parts))


def test_launcher_refuses_what_the_kernel_does_not_take():
    qt, _, (codes, qparams, gs) = packed_case((48, 64, 64), (4, False, False), seed=0)
    x = torch.randn(3, 64).bfloat16()
    with pytest.raises(ValueError, match="x must be"):
        rowwise_gemm.qmatmul(x.float(), (codes, qparams, gs), 4)
    with pytest.raises(ValueError, match="pack_quantized's 8-bit"):
        rowwise_gemm.qmatmul(x, (codes, qparams, gs), 8)
    with pytest.raises(ValueError, match="pairs"):
        rowwise_gemm.qmatmul(x, (codes, qparams, gs), 4, act=True)  # three blocks: no gate/up pairs


@pytest.mark.skipif(cpu_gemm.available(), reason="with AMX, 5 rows and more take the AMX GEMM")
def test_qlinear_takes_it_from_five_rows_without_a_tinygemm_copy():
    qt, perm, packed = packed_case((80, 320, 32), (4, False, True), seed=4)
    layer = QLinear.from_qtensor(qt)
    x = torch.randn(2, 6, 320).bfloat16()
    assert packed_kernel(12) == "rowwise" and packed_kernel(4) == "gemv"
    assert torch.equal(layer(x), reference(x.view(12, 320), qt, perm).view(2, 6, 80))
    assert "tinygemm" not in layer._prepared

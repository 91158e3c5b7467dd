"""quant/qlinear.py: QLinear keeps the exact QTensor, its reference forward is dequantize-then-matmul, and every CPU
packed-kernel path (torch's per-row kernels, the AMX dequant-GEMM of kernels/cpu/gemm.py, the rowwise GEMM of
kernels/cpu/rowwise_gemm.py and the GEMV of kernels/cpu/gemv.py on the same packing) reproduces dequantize(qt) @ x.

Exactness of the fast paths: the kernels take bf16 inputs and bf16 scale/zero terms and return bf16, so with power-of-two
scales and one-hot inputs every product and sum is exact (|q - z| <= 255 fits bf16's 8 significant bits): feeding
the identity matrix through the kernel must reproduce W'.T bit for bit, which checks every code, zero, scale and the
act-order permutation. Realistic inputs are then checked with a tolerance derived from bf16 rounding (see below).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quantkit.config import QuantScheme
from quantkit.quant.qlinear import _AMX_MIN_M, QLinear, packed_kernel
from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.kernels.cpu import gemv as cpu_gemv
from quantkit.kernels.cpu import tinygemm
from quantkit.quant.scheme import QTensor, dequantize, fit_qparams, quantize, quantize_rtn


def make_qtensor(n, k, bits, group_size, sym, act_order=False, pow2_scales=False, seed=0) -> QTensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    scheme = QuantScheme(bits=bits, group_size=group_size, sym=sym, act_order=act_order)
    g_idx = None
    if act_order:
        order = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    scales, zeros = fit_qparams(w, scheme, g_idx)
    if pow2_scales:
        scales = torch.pow(2.0, torch.randint(-9, -4, scales.shape, generator=gen).float()).half()
    codes = quantize(w, scales, zeros, bits, group_size, g_idx)
    return QTensor(codes, zeros, scales, g_idx, bits, group_size, sym)


# (N, K, bits, group_size, sym, act_order, expected CPU kernel for bf16 inputs)
FAST = {
    "w4g32-sym": (64, 128, 4, 32, True, False, "int4"),
    "w4g64-asym": (48, 192, 4, 64, False, False, "int4"),
    "w4g128-asym-act": (32, 256, 4, 128, False, True, "int4"),
    "w4ch-asym": (32, 96, 4, -1, False, False, "int4"),  # per-channel: scale repeated over 32-column groups
    "w4g512-sym": (16, 1024, 4, 512, True, False, "int4"),  # group larger than tinygemm's 256
    "w8ch-sym": (32, 128, 8, -1, True, False, "int8"),
    "w8ch-asym": (32, 128, 8, -1, False, False, "int8"),
    "w8g64-asym": (32, 128, 8, 64, False, False, "int8_hilo"),
    "w8g32-sym-act": (48, 96, 8, 32, True, True, "int8_hilo"),
}


@pytest.mark.parametrize("case", list(FAST))
def test_qtensor_round_trips_exactly(case):
    n, k, bits, g, sym, act, _ = FAST[case]
    qt = make_qtensor(n, k, bits, g, sym, act)
    assert qt.equal(QLinear.from_qtensor(qt).qtensor())


def test_odd_in_features_round_trip_at_4_bit():
    qt = make_qtensor(8, 33, 4, -1, False)
    layer = QLinear.from_qtensor(qt)
    assert layer.qweight.shape == (8, 17)  # the last byte holds one code
    assert qt.equal(layer.qtensor())


@pytest.mark.parametrize("case", list(FAST))
def test_fp32_forward_is_dequantize_then_matmul(case):
    n, k, bits, g, sym, act, _ = FAST[case]
    qt = make_qtensor(n, k, bits, g, sym, act, seed=1)
    bias = torch.randn(n)
    layer = QLinear.from_qtensor(qt, bias)
    x = torch.randn(2, 3, k)
    assert torch.equal(layer(x), F.linear(x, dequantize(qt), bias))


needs_amx = pytest.mark.skipif(not cpu_gemm.available(), reason="the CPU has no AMX (or Linux refused it)")
# from _AMX_MIN_M rows: the AMX GEMM, or the rowwise GEMM on AVX512-BF16 CPUs without AMX
needs_gemm = pytest.mark.skipif(packed_kernel(_AMX_MIN_M) is None, reason="no AMX or AVX512-BF16 GEMM here")
GEMV = cpu_gemv.available()


def assert_backend(layer: QLinear, rows: int, kind: str) -> None:
    """The backends a forward of `rows` rows built: gemm.py's packing alone where packed_kernel(rows) runs on it
    (AMX GEMM, rowwise GEMM, GEMV), else torch's per-row kernel of `kind`."""
    if packed_kernel(rows) is not None:
        assert "tinygemm" not in layer._prepared and layer._prepared["amx"] is not None
    else:
        assert layer._prepared["tinygemm"][0] == kind


# rows per call: 1 and _AMX_MIN_M - 1 the GEMV (or torch's packed kernel of each kind); 24 the AMX dequant-GEMM
# (padded to 32: two AMX row tiles) or the rowwise GEMM
@pytest.mark.parametrize("chunk", [1, _AMX_MIN_M - 1, pytest.param(24, marks=needs_gemm)])
@pytest.mark.parametrize("case", list(FAST))
def test_cpu_kernel_reproduces_the_dequantized_weight_exactly(case, chunk):
    n, k, bits, g, sym, act, kind = FAST[case]
    qt = make_qtensor(n, k, bits, g, sym, act, pow2_scales=True, seed=2)
    layer = QLinear.from_qtensor(qt)
    eye = torch.eye(k, dtype=torch.bfloat16)
    rows = [layer(part) for part in eye.split(chunk)]
    assert_backend(layer, chunk, kind)
    assert torch.equal(torch.cat(rows).float(), dequantize(qt).T)


@pytest.mark.parametrize("case", list(FAST))
def test_torch_per_row_kernels_reproduce_the_dequantized_weight_exactly(case):
    """The fallback for CPUs without AMX or AVX512-BF16, called directly (QLinear takes the GEMV where it can)."""
    n, k, bits, g, sym, act, kind = FAST[case]
    qt = make_qtensor(n, k, bits, g, sym, act, pow2_scales=True, seed=2)
    packed = QLinear.from_qtensor(qt).prepared("tinygemm")
    assert packed[0] == kind
    eye = torch.eye(k, dtype=torch.bfloat16)
    rows = [tinygemm.matmul(part.contiguous(), packed) for part in eye.split(_AMX_MIN_M - 1)]
    assert torch.equal(torch.cat(rows).float(), dequantize(qt).T)


@pytest.mark.parametrize("rows", [1, 3, pytest.param(_AMX_MIN_M, marks=needs_gemm), pytest.param(70, marks=needs_gemm)])
@pytest.mark.parametrize("case", list(FAST))
def test_cpu_kernel_matches_reference_on_random_inputs(case, rows):
    """Tolerance: the kernels round scale and zero terms to bf16 (relative 2^-9 each) and the output to bf16
    (2^-9), so |y - ref| <= 2^-8 * (|x| @ (maxq * |S|).T) + 2^-8 * |ref|: a bound, not a typical error; a wrong
    code, zero or permutation moves outputs by O(s * |x|) on many rows and fails the 1%-of-range check too."""
    n, k, bits, g, sym, act, kind = FAST[case]
    qt = make_qtensor(n, k, bits, g, sym, act, seed=3)
    bias = torch.randn(n).bfloat16()
    layer = QLinear.from_qtensor(qt, bias)
    x = torch.randn(rows, k).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert_backend(layer, rows, kind)
    w = dequantize(qt)
    ref = x.float() @ w.T + bias.float()
    s_full = qt.scales.float()[:, qt.group_index()]
    bound = 2**-8 * (x.float().abs() @ (qt.maxq * s_full).T) + 2**-8 * ref.abs() + 2**-8 * bias.float().abs()
    err = (y.float() - ref).abs()
    assert bool((err <= bound).all())
    assert float(err.max()) <= 0.01 * float(ref.abs().max())


@needs_amx
@pytest.mark.parametrize("case", ["w4g64-asym", "w8g32-sym-act", "w8ch-asym"])
def test_amx_prefill_rows_use_a_bit_identical_dequantization(case):
    """Prefill-sized calls dequantize the whole weight (C) and run the bf16 AMX GEMM on it: the weight equals
    dequantize(qt, bf16) and the output equals that GEMM on the reference weight."""
    n, k, bits, g, sym, act, _ = FAST[case]
    qt = make_qtensor(n, k, bits, g, sym, act, seed=8)
    layer = QLinear.from_qtensor(qt)
    x = torch.randn(cpu_gemm._FUSED_MAX_M + 1, k).bfloat16()
    perm, packed = layer.prepared("amx")
    w = cpu_gemm.unpack_bf16(cpu_gemm.dequantize_vnni(packed, bits))
    reference = dequantize(qt, torch.bfloat16)
    reference = reference if perm is None else reference[:, perm]
    assert torch.equal(w, reference)
    xp = x if perm is None else x[:, perm].contiguous()
    assert torch.equal(layer(x), cpu_gemm.matmul_bf16(xp, cpu_gemm.pack_bf16(reference)))


def test_fp32_many_rows_take_the_dequantize_path():
    qt = make_qtensor(64, 128, 4, 32, False, seed=4)
    layer = QLinear.from_qtensor(qt)
    x = torch.randn(100, 128)
    assert torch.equal(layer(x), F.linear(x, dequantize(qt)))


def random_qtensor(n, k, g, g_idx=None, seed=5) -> QTensor:
    gen = torch.Generator().manual_seed(seed)
    groups = k // g
    return QTensor(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                   torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8),
                   (torch.rand(n, groups, generator=gen) * 0.01 + 0.001).half(), g_idx, 4, g, False)


def unequal_g_idx(k=128) -> torch.Tensor:
    """Act-order g_idx whose 4 groups hold 40, 24, 32 and 32 columns (no permutation makes equal runs)."""
    sizes = [40, 24, 32, 32]
    g_idx = torch.cat([torch.full((s,), i, dtype=torch.int32) for i, s in enumerate(sizes)])
    return g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize("qt", [random_qtensor(24, 128, 32), random_qtensor(32, 128, 32, unequal_g_idx()),
                                random_qtensor(32, 96, 16)], ids=["N%16", "unequal-act-groups", "g16"])
def test_layers_no_kernel_fits_use_the_reference(qt):
    """No torch per-row kernel takes these; the AMX packing takes group 16 (any even group), so there the GEMV
    runs where it can."""
    layer = QLinear.from_qtensor(qt)
    x = torch.randn(3, qt.shape[1]).bfloat16()
    ref = F.linear(x, dequantize(qt, torch.bfloat16))
    if GEMV and qt.group_size == 16:
        torch.testing.assert_close(layer(x), ref, atol=1e-2, rtol=2**-7)
        assert layer._prepared["amx"] is not None
    else:
        assert torch.equal(layer(x), ref)
    assert layer.prepared("tinygemm") is None


def test_each_backends_copy_is_built_once_per_device():
    layer = QLinear.from_qtensor(make_qtensor(32, 64, 4, 32, False, seed=6))
    packed = layer.prepared("tinygemm")
    assert packed[0] == "int4" and layer.prepared("tinygemm") is packed
    layer.to(torch.bfloat16)  # a move or cast drops the copies
    assert layer._prepared == {}
    with pytest.raises(ValueError, match="unknown QLinear backend"):
        layer.prepared("marlin")


def test_model_dtype_casts_leave_the_quantized_weight_untouched():
    qt = make_qtensor(32, 64, 4, 32, False, seed=6)
    bias = torch.randn(32)
    layer = QLinear.from_qtensor(qt, bias)
    layer.to(torch.bfloat16)
    assert qt.equal(layer.qtensor())
    assert layer.bias.dtype == torch.bfloat16
    layer.float()
    assert qt.equal(layer.qtensor())


def test_storage_is_the_packed_size():
    """4-bit: K/2 bytes per row; 8-bit: K bytes; plus 2 + 1 bytes per (row, group) of scales and zeros."""
    for bits in (4, 8):
        n, k, g = 64, 256, 64
        layer = QLinear.from_qtensor(make_qtensor(n, k, bits, g, False))
        nbytes = sum(b.numel() * b.element_size() for b in layer.buffers())
        assert nbytes == n * k * bits // 8 + n * (k // g) * 3
    per_channel = QLinear.from_qtensor(make_qtensor(32, 128, 8, -1, True))
    per_channel(torch.randn(1, 128).bfloat16())
    kind, tensors = per_channel.prepared("tinygemm")
    assert kind == "int8" and tensors[1] is per_channel.qweight  # shared, not copied


def test_rtn_layer_output_close_to_float_linear():
    lin = torch.nn.Linear(256, 64)
    x = torch.randn(4, 256)
    qt = quantize_rtn(lin.weight.detach(), QuantScheme(bits=8, group_size=64, sym=True))
    layer = QLinear.from_qtensor(qt, lin.bias.detach())
    ref = lin(x).detach()
    assert float((layer(x) - ref).abs().max()) < 0.01 * float(ref.abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["w4g128-asym-act", "w8g64-asym"])
def test_cuda_forward_matches_reference_and_keeps_the_qtensor(case):
    """On CUDA QLinear calls quantkit.kernels.triton.qgemm; fp16 tolerance as in tests/kernels/test_kernels_qgemm.py."""
    n, k, bits, g, sym, act, _ = FAST[case]
    qt = make_qtensor(n, k, bits, g, sym, act, seed=7)
    bias = torch.randn(n)
    layer = QLinear.from_qtensor(qt, bias).to("cuda", torch.float16)
    x = torch.randn(3, k, device="cuda", dtype=torch.float16)
    y = layer(x)
    ref = x.float() @ dequantize(qt).cuda().T + bias.cuda()
    assert y.dtype == torch.float16 and layer.prepared("triton") is not None
    torch.testing.assert_close(y.float(), ref, rtol=4e-3, atol=2e-2)
    assert qt.equal(layer.cpu().qtensor())

"""Dequant-GEMM kernels (repack, dequantize, split-K GEMV, tiled GEMM, qgemm dispatch) against torch references.

Runs the Triton kernels under TRITON_INTERPRET=1 on CPU (tests/kernels/triton_env.py); with a GPU and
TRITON_INTERPRET=0 the same tests run compiled on CUDA. The references are checked against quantkit's format
spec (scheme.pack / scheme.dequantize) so they are independent of the kernels.

Tolerances: the reference multiplies exact fp32 weights; a K tile inside one group multiplies exact integers and
scales once, but a tile across groups rounds each dequantized weight to x's dtype first (relative error u =
2^-11 fp16, 2^-8 bf16), which moves an output by about
u * sqrt(K / 3) * rms(x) * rms(w') (3 sigma <= 0.015 fp16, 0.12 bf16 at K <= 256 with unit-variance x and w'),
plus one rounding of the output (rtol 2 ulps):
  fp16 rtol 4e-3 atol 2e-2,  bf16 rtol 1.6e-2 atol 1.5e-1.
A wrong code, group, scale, zero or column shifts outputs by O(1) and fails these.
"""

from __future__ import annotations

from tests.kernels.triton_env import DEVICE  # first: sets TRITON_INTERPRET before triton loads

import pytest
import torch

from quantkit.config import QuantScheme
from quantkit.errors import QuantkitError
from quantkit.kernels.triton import dequant_gemm, dequant_gemv, dequantize, qgemm, repack
from quantkit.quant import scheme

TOL = {torch.float16: dict(rtol=4e-3, atol=2e-2), torch.bfloat16: dict(rtol=1.6e-2, atol=1.5e-1)}

# (N, K, bits, group_size, sym, act_order): N and K off the 32/64 tiles, per-channel with K % p != 0, group 32
# under a 128-row tile (scales gathered per word), groups 64 and 128 (one or two groups per 128- or 256-row tile:
# the exact integer path, sym and asym), act-order permutations.
WEIGHTS = {
    "w4g32-sym": (40, 96, 4, 32, True, False),
    "w8g64-asym-act": (37, 128, 8, 64, False, True),
    "w4ch-asym-oddK": (33, 76, 4, -1, False, False),
    "w4g128-asym-act": (50, 256, 4, 128, False, True),
    "w8ch-sym-oddK": (24, 98, 8, -1, True, False),
    "w4g32-sym-act": (48, 96, 4, 32, True, True),
    "w4g128-sym": (64, 256, 4, 128, True, False),
    "w4g64-sym": (40, 256, 4, 64, True, False),
}


def make_qtensor(n, k, bits, group_size, sym, act_order, seed=0) -> scheme.QTensor:
    """A random weight quantized with scheme's own min/max quantizer (GPTQ-style g_idx for act-order)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    q = QuantScheme(bits=bits, group_size=group_size, sym=sym)
    g_idx = None
    if act_order and group_size != -1:
        order = torch.randperm(k, generator=gen)  # visiting order; the i-th visited column joins group i // g
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    scales, zeros = scheme.fit_qparams(w, q, g_idx)
    codes = scheme.quantize(w, scales, zeros, bits, group_size, g_idx)
    return scheme.QTensor(codes, zeros, scales, g_idx, bits, group_size, sym).to(DEVICE)


@pytest.fixture(scope="module", params=list(WEIGHTS), ids=list(WEIGHTS))
def weight(request):
    qt = make_qtensor(*WEIGHTS[request.param])
    return qt, repack.repack(qt)


def test_repack_matches_reference_and_format(weight):
    qt, pw = weight
    ref = repack.repack_ref(qt)
    assert torch.equal(pw.qweight, ref.qweight)
    assert (pw.perm is None) == (ref.perm is None) and (pw.perm is None or torch.equal(pw.perm, ref.perm))
    # the reference is the format's sequential packing of the (group-sorted) codes along K
    codes = qt.codes if ref.perm is None else qt.codes[:, ref.perm.long()]
    assert torch.equal(ref.qweight, scheme.pack(codes.t(), qt.bits, dim=0))
    assert pw.sym == (qt.sym and bool((qt.zeros == (1 << (qt.bits - 1))).all()))


def test_dequantize_exact(weight):
    qt, pw = weight
    expected = scheme.dequantize(qt).t()  # [K, N] fp32
    assert torch.equal(dequantize.dequantize_ref(pw), expected)
    assert torch.equal(dequantize.dequantize(pw, torch.float32, block_k=32, block_n=32), expected)
    half = dequantize.dequantize(pw, torch.float16, block_k=64, block_n=32)
    assert torch.equal(half, expected.half())


# (M, config, bias): split-K of 1, 2 and an uneven 3 (past K = 256: empty splits), 64-, 128- and 256-row K tiles
# (one group or several per tile), M = 1 / 3 / 16 / 20 / 64 (16-, 32- and 64-row tiles; 64 x 4 splits fills the
# workspace); each in fp16 and bf16
GEMV_CASES = {
    "m1-k1": (1, {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1}, False),
    "m1-k3": (1, {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 3}, True),
    "m3-k2": (3, {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2}, False),
    "m16-k1": (16, {"BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": 1}, True),
    "m20-k2": (20, {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2}, True),
    "m64-k4": (64, {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4}, False),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("m,config,bias", list(GEMV_CASES.values()), ids=list(GEMV_CASES))
def test_gemv_matches_reference(weight, m, dtype, config, bias):
    qt, pw = weight
    n, k = qt.shape
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    out = dequant_gemv.dequant_gemv(x, pw, b, config=config)
    torch.testing.assert_close(out, dequant_gemv.dequant_gemv_ref(x, pw, b), **TOL[dtype])
    _, counters = dequant_gemv.reserve_workspace(x.device, n)
    assert not counters.any(), "split-K arrival counters must be left all zero"


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="compiled kernels on a real shape: needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 64])
def test_gemv_every_tuned_config_on_a_real_shape(m):
    """Each tile and split the autotuner may pick for M rows, 5 launches in a row, on Llama-3-8B's gate/up shape:
    the kernel's former atomic split-K reduction lost whole rows at M = 16 on an H200 in 16 of 24 configs, and
    the small-shape cases above (one config each) passed all the same."""
    qt = make_qtensor(14336, 4096, 4, 128, True, False)
    pw = repack.repack(qt)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 4096, generator=gen).to(DEVICE, torch.float16)
    ref = dequant_gemv.dequant_gemv_ref(x, pw)
    configs = dequant_gemv._prune(dequant_gemv._configs(), {"N": 14336, "K": 4096},
                                  BLOCK_M=dequant_gemv.block_m(m), GROUP_K=pw.group_k, BITS=pw.bits)
    for c in configs:
        for _ in range(5):
            out = dequant_gemv.dequant_gemv(x, pw, config=dict(c.kwargs))
            torch.testing.assert_close(out, ref, **TOL[torch.float16], msg=lambda e: f"{c}: {e}")


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("m,config", [
    (17, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 2}),
    (127, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 2}),
    (127, {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 2}),  # 64-row tiles: the transposed dot
], ids=["m17", "m127", "m127-bm64"])
def test_gemm_matches_reference(weight, m, dtype, config):
    qt, pw = weight
    n, k = qt.shape
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype)
    out = dequant_gemm.dequant_gemm(x, pw, b, config=config)
    torch.testing.assert_close(out, dequant_gemm.dequant_gemm_ref(x, pw, b), **TOL[dtype])


def test_references_match_scheme_dequantize(weight):
    qt, pw = weight
    x = torch.randn(5, qt.shape[1]).to(DEVICE)  # fp32: compare before any output rounding
    expected = x @ scheme.dequantize(qt).t()
    torch.testing.assert_close(dequant_gemv.dequant_gemv_ref(x, pw), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qgemm.matmul_ref(x[None], pw)[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 3, 16, 17, 127, qgemm.DEQUANT_MIN_M])
def test_matmul_dispatch(m):
    qt = make_qtensor(*WEIGHTS["w4g128-asym-act"], seed=m)
    prepared = qgemm.prepare(qt)
    x = torch.randn(m, qt.shape[1]).to(DEVICE, torch.float16).reshape(1, m, -1)  # [..., K] with a batch dim
    out = qgemm.matmul(x, prepared)
    assert out.shape == (1, m, qt.shape[0]) and out.dtype == torch.float16
    expected = (x.float() @ scheme.dequantize(qt).t()).half()
    torch.testing.assert_close(out, expected, **TOL[torch.float16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_matmul_with_bias(dtype):
    qt = make_qtensor(*WEIGHTS["w8g64-asym-act"], seed=7)
    prepared = qgemm.prepare(qt)
    x = torch.randn(2, qt.shape[1]).to(DEVICE, dtype)
    bias = torch.randn(qt.shape[0]).to(DEVICE, dtype)
    expected = (x.float() @ scheme.dequantize(qt).t() + bias.float()).to(dtype)
    tol = TOL.get(dtype, dict(rtol=1e-5, atol=1e-5))
    torch.testing.assert_close(qgemm.matmul(x, prepared, bias), expected, **tol)


def test_kernel_for_boundaries():
    top = dequant_gemv.GEMV_MAX_M
    assert [qgemm.kernel_for(m) for m in (1, top, top + 1, qgemm.DEQUANT_MIN_M - 1, qgemm.DEQUANT_MIN_M)] == \
        ["gemv", "gemv", "gemm", "gemm", "dequant"]
    assert qgemm.kernel_for(1, torch.float32) == "dequant"


def test_unequal_act_order_groups_are_refused():
    qt = make_qtensor(16, 64, 4, 32, True, False)
    qt.g_idx = torch.tensor([0] * 40 + [1] * 24, dtype=torch.int32, device=DEVICE)
    with pytest.raises(QuantkitError, match="exactly 32 columns"):
        repack.repack(qt)


@pytest.mark.parametrize("name,block_k", [("w4g128-sym", 128), ("w4g64-sym", 128), ("w8g64-asym-act", 128),
                                          ("w4g32-sym", 64)])
def test_tiles_within_groups_round_only_the_output(name, block_k):
    """A K tile inside one or two groups multiplies x by exact integers and scales the sums (dequant_dot), so an fp16
    output is the fp32 reference rounded once: equal in nearly every element, never a whole ulp off. Rounding each
    weight to fp16 first (the tiles across more groups, and the first kernels) moves about a quarter of them, some by
    hundreds of ulps near 0."""
    qt = make_qtensor(*WEIGHTS[name], seed=11)
    pw = repack.repack(qt)
    x = torch.randn(16, qt.shape[1], generator=torch.Generator().manual_seed(11)).to(DEVICE, torch.float16)
    out = dequant_gemv.dequant_gemv(x, pw, config={"BLOCK_N": 32, "BLOCK_K": block_k, "SPLIT_K": 1}).float()
    exact = x.float() @ dequantize.dequantize_ref(pw)  # fp32, unrounded
    # an fp16 ulp at each output, or more; near 0 at least 2^-19, the fp32 sums' own error there
    ulp = torch.finfo(torch.float16).eps * exact.abs().clamp_min(2 ** -9)
    assert ((out - exact).abs() <= 0.51 * ulp).float().mean() >= 0.97
    assert ((out - exact).abs() <= ulp).all()

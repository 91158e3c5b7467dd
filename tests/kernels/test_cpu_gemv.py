"""kernels/cpu/gemv.py (the W4/W8 GEMV for 1-4 rows) against the format's dequantization.

Exactness: a one-hot row x = e_k makes every product and sum of the kernel exact (U * (1 + q / U) - (U + z) * 1 =
q - z), so y = fl(s * (q - z)) rounded to bf16: the identity through the GEMV must reproduce
dequantize(qt, bfloat16).T bit for bit (every code, zero, scale, group, block and the act-order permutation).

Random inputs: the kernel's fp32 result differs from the fp32 reference x @ dequantize(qt, float32)^T by fp32
accumulation alone; a bound on both (u = 2^-24, U = 16 / 256 for 4 / 8 bits, S the scale of each weight):
  e = u * (gs + G + 4) * 4U * (|x| @ S^T) + u * K * (|x| @ |W|^T)
(chains of gs / 2 FMAs over terms x * (1 + q / U) < 2|x|, scaled by U; the group sum of x times U + z < 2U; G
groups summed; the reference's own K-term sum). The output, rounded once to nearest even, must lie between
bf16(ref - e) and bf16(ref + e); and as e is a bound, not a typical error, nearly every output equals bf16(ref).
"""

from __future__ import annotations

import pytest
import torch

from quantkit.config import QuantScheme
from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.kernels.cpu import gemv as cpu_gemv
from quantkit.kernels.cpu.fused import CpuFusedOps
from quantkit.models.llama import TorchOps
from quantkit.quant.scheme import QTensor, dequantize, quantize_rtn
from tests.kernels.cpu_builds import NARROWER, narrower_library

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="the CPU has no AVX2 + FMA + F16C (or no compiler)")


def make_qtensor(n, k, bits, g, sym, act_order=False, seed=0) -> QTensor:
    gen = torch.Generator().manual_seed(seed)
    qt = quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, QuantScheme(bits=bits, group_size=g, sym=sym))
    if not act_order:
        return qt
    gs = k if g == -1 else g
    g_idx = (torch.randperm(k, generator=gen) % (k // gs)).to(torch.int32)  # equal-sized groups, shuffled
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    return QTensor(codes, qt.zeros, qt.scales, g_idx, bits, g, sym)


# (N, K, group): one lone block; a pair and a lone block with K = one group; 5 blocks, 10 groups; per-channel
SHAPES = [(16, 64, 32), (48, 64, 64), (80, 320, 32), (32, 96, -1)]
SCHEMES = [(4, True, False), (4, False, False), (8, True, False), (8, False, False), (4, False, True),
           (8, True, True)]
SCHEME_IDS = ["w4-sym", "w4-asym", "w8-sym", "w8-asym", "w4-asym-act", "w8-sym-act"]


def packed_case(shape, scheme, seed):
    """(QTensor of SHAPES' shape and SCHEMES' scheme, gemm.prepare's perm and packed weight)."""
    n, k, g = shape
    bits, sym, act_order = scheme
    qt = make_qtensor(n, k, bits, g, sym, act_order, seed=seed)
    return (qt, *cpu_gemm.prepare(qt))


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_hot_rows_reproduce_the_dequantized_weight_exactly(shape, scheme, rows):
    qt, perm, packed = packed_case(shape, scheme, seed=rows)
    k, bits = qt.shape[1], qt.bits
    eye = torch.eye(k, dtype=torch.bfloat16)
    y = torch.cat([cpu_gemv.matmul(part, perm, packed, bits) for part in eye.split(rows)])
    assert torch.equal(y, dequantize(qt, torch.bfloat16).T)


def accumulation_bound(x: torch.Tensor, qt: QTensor) -> torch.Tensor:
    """e of the module docstring, [M, N]."""
    k = qt.shape[1]
    gs = k if qt.group_size == -1 else qt.group_size
    unit = 16 if qt.bits == 4 else 256
    s_full = qt.scales.float()[:, qt.group_index()]  # [N, K]
    ax = x.float().abs()
    return 2**-24 * ((gs + k // gs + 4) * 4 * unit * (ax @ s_full.T) + k * (ax @ dequantize(qt).abs().T))


def assert_rounded_reference(y: torch.Tensor, ref: torch.Tensor, e: torch.Tensor) -> None:
    y = y.float()
    assert bool(((ref - e).bfloat16().float() <= y).all() and (y <= (ref + e).bfloat16().float()).all())
    assert float((y == ref.bfloat16().float()).float().mean()) >= 0.95


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_random_rows_are_the_fp32_reference_rounded_once(shape, scheme, rows):
    qt, perm, packed = packed_case(shape, scheme, seed=10 + rows)
    x = torch.randn(rows, qt.shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
    y = cpu_gemv.matmul(x, perm, packed, qt.bits)
    assert y.shape == (rows, qt.shape[0]) and y.dtype == torch.bfloat16
    assert_rounded_reference(y, cpu_gemv.qgemv_ref(x, qt), accumulation_bound(x, qt))


@pytest.mark.parametrize("bits", [4, 8])
def test_outputs_do_not_depend_on_the_thread_count(bits):
    """Threads split whole column blocks: each output is one thread's sum in a fixed order."""
    qt = make_qtensor(160, 256, bits, 64, False, seed=3)
    _, packed = cpu_gemm.prepare(qt)
    x = torch.randn(3, 256).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemv.qgemv(x, packed, bits)
        torch.set_num_threads(max(2, threads))
        many = cpu_gemv.qgemv(x, packed, bits)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("act", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_avx2_build_gives_the_native_builds_bits(bits, act, tmp_path):
    """gemv.c built without AVX-512 (its AVX2 path) against the build this CPU runs: the same bits for every row
    count (on an AVX-512 BF16 CPU, two different code paths; on an AVX2 one, the same path twice)."""
    flags, needs = NARROWER["avx2"]
    avx2 = narrower_library("gemv", flags, tmp_path, {"qgemv": cpu_gemv.SIGNATURES["qgemv"]}, needs).qgemv
    _, _, packed = gate_up(bits, seed=5)
    for rows in range(1, cpu_gemv.MAX_ROWS + 1):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert torch.equal(cpu_gemm.run_quantized(avx2, x, packed, bits, act), cpu_gemv.qgemv(x, packed, bits, act))


def gate_up(bits: int, seed: int = 0):
    """Two 48 x 128 QTensors and the packed weight FusedLinear builds of them: blocks alternating gate, up."""
    gate, up = (make_qtensor(48, 128, bits, 32, False, seed=seed + i) for i in range(2))
    packs = [cpu_gemm.prepare(q)[1] for q in (gate, up)]
    codes = torch.stack([packs[0][0], packs[1][0]], dim=1).flatten(0, 1)
    qparams = torch.stack([packs[0][1], packs[1][1]], dim=1).flatten(0, 1)
    return gate, up, (codes, qparams, 32)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("bits", [4, 8])
def test_gate_up_epilogue_is_the_products_through_silu_mul(bits, rows):
    """act: silu(bf16(gate)) * bf16(up), rounded, with fused.py's silu_mul arithmetic: bit-identical to the GEMV of
    each part followed by CpuFusedOps.silu_mul, and within bf16 rounding of the torch reference."""
    gate, up, packed = gate_up(bits)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(bits)).bfloat16()
    y = cpu_gemv.qgemv(x, packed, bits, act=True)
    assert y.shape == (rows, 48)
    codes, qparams, gs = packed
    parts = [cpu_gemv.qgemv(x, (codes[i::2], qparams[i::2], gs), bits) for i in range(2)]  # strided block views
    for part, qt in zip(parts, (gate, up)):
        assert_rounded_reference(part, cpu_gemv.qgemv_ref(x, qt), accumulation_bound(x, qt))
    ops = CpuFusedOps.load(TorchOps)
    if ops is not None:
        assert torch.equal(y, ops.silu_mul(*parts))
    both = QTensor(*(torch.stack([a.view(3, 16, -1), b.view(3, 16, -1)], dim=1).reshape(96, -1)
                     for a, b in zip((gate.codes, gate.zeros, gate.scales), (up.codes, up.zeros, up.scales))),
                   None, bits, 32, False)
    torch.testing.assert_close(y.float(), cpu_gemv.qgemv_ref(x, both, act=True), atol=1e-3, rtol=2**-7)


def test_launcher_refuses_what_the_kernel_does_not_take():
    qt = make_qtensor(48, 128, 4, 32, False)
    _, packed = cpu_gemm.prepare(qt)
    x = torch.randn(2, 128).bfloat16()
    for bad in (torch.randn(5, 128).bfloat16(), torch.randn(0, 128).bfloat16()):
        with pytest.raises(ValueError, match="1 to 4 rows"):
            cpu_gemv.qgemv(bad, packed, 4)
    for bad in (x.float(), torch.randn(128, 2).bfloat16().T, x[:, :96].contiguous()):
        with pytest.raises(ValueError, match="x must be"):
            cpu_gemv.qgemv(bad, packed, 4)
    with pytest.raises(ValueError, match="8-bit"):
        cpu_gemv.qgemv(x, packed, 8)
    with pytest.raises(ValueError, match="pairs"):
        cpu_gemv.qgemv(x, packed, 4, act=True)  # three blocks: no gate/up pairs

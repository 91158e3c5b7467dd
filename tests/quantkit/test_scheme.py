"""quant/scheme.py: the canonical format. Quantizer conventions against hand-computed numbers, pack/unpack against a
bit-by-bit Python reference, act-order g_idx against the same weights with permuted columns."""

from __future__ import annotations

import pytest
import torch

from quantkit.config import QuantScheme
from quantkit.errors import QuantkitError
from quantkit.quant.scheme import (
    SCALE_FLOOR,
    QTensor,
    contiguous_groups,
    dequantize,
    fit_qparams,
    pack,
    quantize,
    quantize_rtn,
    unpack,
)


def python_pack_along_last(rows: list[list[int]], bits: int) -> list[list[int]]:
    """Reference packing in plain Python ints: element i of each run of p at bits [bits*i, bits*(i+1))."""
    p = 32 // bits
    out = []
    for row in rows:
        row = row + [0] * (-len(row) % p)
        words = []
        for w in range(len(row) // p):
            word = sum(row[w * p + i] << (bits * i) for i in range(p))
            words.append(word - (1 << 32) if word >= 1 << 31 else word)  # the same 32 bits as int32
        out.append(words)
    return out


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("size", [16, 24, 13])  # a multiple of p, a multiple of 8 only, padding needed
def test_pack_matches_bitwise_reference_and_round_trips(bits, dim, size):
    gen = torch.Generator().manual_seed(bits * 100 + size)
    other = 5
    shape = (size, other) if dim == 0 else (other, size)
    codes = torch.randint(0, 1 << bits, shape, generator=gen, dtype=torch.uint8)
    words = pack(codes, bits, dim)
    along_last = codes.T if dim == 0 else codes
    expected = torch.tensor(python_pack_along_last(along_last.tolist(), bits), dtype=torch.int32)
    assert torch.equal(words, expected.T if dim == 0 else expected)
    assert words.dtype == torch.int32
    assert torch.equal(unpack(words, bits, dim, size), codes)


def test_pack_puts_the_lowest_index_in_the_lowest_bits():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]], dtype=torch.uint8)
    assert pack(codes, 4, dim=1).item() == (0xF7654321 - (1 << 32))
    assert pack(torch.tensor([[0x12, 0x34, 0x56, 0x78]], dtype=torch.uint8), 8, dim=1).item() == 0x78563412


def test_asymmetric_qparams_follow_the_convention():
    # one row, one group: min -1.0, max 2.0 -> scale 3/15 = 0.2, zero round(1 / 0.2) = 5
    w = torch.tensor([[-1.0, 0.5, 2.0, 0.1]])
    scales, zeros = fit_qparams(w, QuantScheme(bits=4, group_size=-1, sym=False))
    assert scales.dtype == torch.float16 and zeros.dtype == torch.uint8
    assert scales.item() == torch.tensor(0.2).half().item()
    assert zeros.item() == 5
    # an all-positive group widens its min to 0: scale = max / 15, zero 0, and 0.0 is exact
    w = torch.tensor([[1.5, 3.0, 0.75, 0.0]])
    scales, zeros = fit_qparams(w, QuantScheme(bits=4, group_size=-1, sym=False))
    assert scales.item() == torch.tensor(0.2).half().item() and zeros.item() == 0
    codes = quantize(w, scales, zeros, 4, -1)
    assert codes.tolist() == [[round(1.5 / scales.item()), 15, round(0.75 / scales.item()), 0]]


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_qparams_follow_the_convention(bits):
    w = torch.tensor([[-3.0, 1.0, 2.0, 0.5]])  # absmax 3
    scales, zeros = fit_qparams(w, QuantScheme(bits=bits, group_size=-1, sym=True))
    half_range = ((1 << bits) - 1) / 2  # 7.5 at 4 bit, 127.5 at 8 bit
    assert scales.item() == torch.tensor(3.0 / half_range).half().item()
    assert zeros.item() == 1 << (bits - 1)


def test_codes_are_computed_from_the_fp16_rounded_scale():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    scheme = QuantScheme(bits=4, group_size=32, sym=False)
    qt = quantize_rtn(w, scheme)
    s = qt.scales.float().repeat_interleave(32, dim=1)
    z = qt.zeros.float().repeat_interleave(32, dim=1)
    expected = torch.clamp(torch.round(w / s) + z, 0, 15)
    assert torch.equal(qt.codes.float(), expected)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, -1])
def test_rtn_error_is_at_most_half_a_step(bits, sym, group_size):
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(2))
    qt = quantize_rtn(w, QuantScheme(bits=bits, group_size=group_size, sym=sym))
    step = qt.scales.float().repeat_interleave(128 // qt.scales.shape[1], dim=1)
    err = (dequantize(qt) - w).abs()
    # half a step, plus the fp16 rounding of the scale (relative 2^-11) accumulated over at most maxq steps at the
    # clamped edge of the range
    bound = step * (0.5 + ((1 << bits) - 1) * 2**-11)
    assert bool((err <= bound).all()), float((err / step).max())


def test_all_zero_groups_get_a_floor_scale_and_dequantize_to_zero():
    w = torch.zeros(4, 64)
    w[0, 32:] = torch.linspace(-1, 1, 32)  # one live group next to empty ones
    for sym in (True, False):
        qt = quantize_rtn(w, QuantScheme(bits=4, group_size=32, sym=sym))
        assert bool((qt.scales.float() > 0).all()) and bool(torch.isfinite(qt.scales.float()).all())
        assert qt.scales[1, 0].item() == torch.tensor(SCALE_FLOOR).half().item()
        out = dequantize(qt)
        assert bool(torch.isfinite(out).all())
        assert bool((out[1:] == 0).all()) and bool((out[0, :32] == 0).all())


def test_group_size_that_does_not_divide_in_features_names_the_layer():
    w = torch.randn(8, 576)
    with pytest.raises(QuantkitError, match=r"group_size=128 does not divide in_features=576 of layer model\.layers\.0\.mlp\.up_proj"):
        quantize_rtn(w, QuantScheme(bits=4, group_size=128), layer="model.layers.0.mlp.up_proj")


def test_non_finite_weights_are_refused_naming_the_layer():
    w = torch.randn(4, 32)
    w[1, 3] = float("nan")
    with pytest.raises(QuantkitError, match="layer blk.q: weight has NaN"):
        fit_qparams(w, QuantScheme(bits=4, group_size=32), layer="blk.q")


@pytest.mark.parametrize("sym", [True, False])
def test_act_order_g_idx_equals_contiguous_groups_of_permuted_columns(sym):
    gen = torch.Generator().manual_seed(3)
    n, k, g = 8, 96, 32
    w = torch.randn(n, k, generator=gen)
    order = torch.randperm(k, generator=gen)  # the i-th visited column joins group i // g
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).to(torch.int32)
    scheme = QuantScheme(bits=4, group_size=g, sym=sym, act_order=True)

    scales, zeros = fit_qparams(w, scheme, g_idx)
    codes = quantize(w, scales, zeros, 4, g, g_idx)
    # the same quantization done on columns laid out in visiting order, with ordinary contiguous groups
    ref = quantize_rtn(w[:, order], QuantScheme(bits=4, group_size=g, sym=sym))
    assert torch.equal(scales, ref.scales) and torch.equal(zeros, ref.zeros)
    assert torch.equal(codes[:, order], ref.codes)
    act = QTensor(codes, zeros, scales, g_idx, 4, g, sym)
    assert torch.equal(dequantize(act)[:, order], dequantize(ref))


def test_contiguous_groups_put_act_order_columns_into_group_order():
    gen = torch.Generator().manual_seed(4)
    n, k, g = 4, 96, 32
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    zeros, scales = torch.zeros(n, k // g, dtype=torch.uint8), torch.ones(n, k // g, dtype=torch.float16)
    g_idx = (torch.randperm(k, generator=gen) % (k // g)).to(torch.int32)
    perm, size, permuted = contiguous_groups(QTensor(codes, zeros, scales, g_idx, 4, g, False))
    assert size == g and torch.equal(g_idx[perm], torch.arange(k) // g) and torch.equal(permuted, codes[:, perm])
    plain = contiguous_groups(QTensor(codes, zeros, scales, None, 4, g, False))
    assert plain[:2] == (None, g) and plain[2] is codes
    per_channel = contiguous_groups(QTensor(codes, zeros[:, :1], scales[:, :1], None, 4, -1, False))
    assert per_channel[:2] == (None, k)
    unequal = torch.cat([torch.zeros(40), torch.ones(24), torch.full((32,), 2)]).to(torch.int32)
    assert contiguous_groups(QTensor(codes, zeros, scales, unequal, 4, g, False)) is None


def test_qtensor_rejects_mismatched_shapes_and_dtypes():
    codes = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(QuantkitError, match=r"do not match \[4, 2\]"):
        QTensor(codes, torch.zeros(4, 1, dtype=torch.uint8), torch.ones(4, 1, dtype=torch.float16), None, 4, 32, True)
    with pytest.raises(QuantkitError, match="scales must be float16"):
        QTensor(codes, torch.zeros(4, 2, dtype=torch.uint8), torch.ones(4, 2), None, 4, 32, True)


def test_qtensor_equal_compares_every_field():
    qt = quantize_rtn(torch.randn(4, 64), QuantScheme(bits=4, group_size=32, sym=False))
    same = QTensor(qt.codes.clone(), qt.zeros.clone(), qt.scales.clone(), None, 4, 32, False)
    assert qt.equal(same)
    zeros = qt.zeros.clone()
    zeros[0, 0] ^= 1
    assert not qt.equal(QTensor(qt.codes, zeros, qt.scales, None, 4, 32, False))
    assert not qt.equal(QTensor(qt.codes, qt.zeros, qt.scales, (torch.arange(64) // 32).to(torch.int32), 4, 32, False))
    assert not qt.equal(QTensor(qt.codes, qt.zeros, qt.scales, None, 4, 32, True))

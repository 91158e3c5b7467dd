"""GPTQ math on tiny cases: a hand-solved answer, never worse than RTN, the dampening escalation, act-order."""

from __future__ import annotations

import pytest
import torch

from quantkit.config import QuantScheme
from quantkit.quant.gptq import group_aware_order, gptq_quantize, hessian, output_error
from quantkit.quant.scheme import dequantize, quantize_rtn


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


def correlated_inputs(t: int, k: int, seed: int = 0) -> torch.Tensor:
    """x [t, k] with correlated channels of unequal scale (what makes GPTQ's updates matter)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5
    return (torch.randn(t, k, generator=g) @ mix + 0.3 * torch.randn(t, k, generator=g)) * torch.rand(k, generator=g).add(0.2)


@pytest.mark.parametrize("k", [16, 1100])  # 1100: the block-triangular accumulation with a ragged last block
def test_hessian_is_mean_outer_product_with_mask(k):
    x = torch.randn(3, 40, k, dtype=torch.float64)
    mask = torch.rand(3, 40) > 0.4
    ref = x[mask].T @ x[mask] / int(mask.sum())
    torch.testing.assert_close(hessian(x.float(), mask).double(), ref, rtol=1e-5, atol=1e-6)
    flat = x.reshape(-1, k)
    torch.testing.assert_close(hessian(x.float()).double(), flat.T @ flat / 120, rtol=1e-5, atol=1e-6)


def test_hand_solved_two_correlated_columns():
    # per-channel asym 4-bit on the row [-8, 7, 0.4, 0.35]: scale 1, zero 8 (exact for columns 0 and 1).
    # H = diag(I2, [[1, .5], [.5, 1]]) and no dampening: quantizing column 2 (error 0.4) moves column 3 by
    # c * 0.4 = 0.2 to 0.55, which rounds to 1 where RTN rounds 0.35 to 0.
    w = torch.tensor([[-8.0, 7.0, 0.4, 0.35]])
    h = torch.eye(4)
    h[2, 3] = h[3, 2] = 0.5
    scheme = QuantScheme(bits=4, group_size=-1, sym=False)
    qt, stats = gptq_quantize(w, h, scheme, damp=0.0)
    assert qt.codes.tolist() == [[0, 15, 8, 9]]
    assert dequantize(qt).tolist() == [[-8.0, 7.0, 0.0, 1.0]]
    assert stats.damp == 0.0 and not stats.fallback
    assert stats.loss == pytest.approx(0.16 + 0.4225 - 0.26, abs=1e-6)  # dW H dW^T with dW = [0, 0, .4, -.65]
    rtn = quantize_rtn(w, scheme)
    assert rtn.codes.tolist() == [[0, 15, 8, 8]]
    assert output_error(w, dequantize(rtn), h) == pytest.approx(0.4225, abs=1e-6)


@pytest.mark.parametrize("scheme", [
    QuantScheme(4, 32, True), QuantScheme(4, 32, False), QuantScheme(8, 32, True), QuantScheme(4, -1, True),
    QuantScheme(4, 64, True, act_order=True), QuantScheme(4, 32, True, act_order=True, static_groups=True),
    QuantScheme(4, 96, False, act_order=True),
], ids=lambda s: s.name() + ("-static" if s.static_groups else ""))
def test_no_worse_than_rtn_on_random_weights(scheme):
    torch.manual_seed(1)
    w = torch.randn(48, 192)
    h = hessian(correlated_inputs(1024, 192))
    qt, stats = gptq_quantize(w, h, scheme, block_size=64)
    rtn_loss = output_error(w, dequantize(quantize_rtn(w, scheme)), h)
    assert stats.loss == pytest.approx(output_error(w, dequantize(qt), h), rel=1e-5)  # the report is the truth
    assert stats.loss < 0.8 * rtn_loss
    assert qt.codes.shape == (48, 192) and int(qt.codes.max()) <= scheme.maxq


def test_singular_hessian_escalates_dampening():
    h = torch.ones(16, 16)  # rank 1: the undamped factorisation hits an exact zero pivot
    assert torch.linalg.cholesky_ex(h)[1] != 0
    qt, stats = gptq_quantize(torch.randn(8, 16), h, QuantScheme(4, -1, True), damp=0.0)
    assert stats.damp == 0.01 and not stats.fallback
    assert torch.isfinite(dequantize(qt)).all()


def test_unfactorisable_hessian_falls_back_to_rtn():
    w = torch.randn(8, 32)
    scheme = QuantScheme(4, 16, True)
    qt, stats = gptq_quantize(w, -torch.eye(32), scheme)  # negative definite: no dampening level helps
    assert stats.fallback and stats.damp is None
    assert torch.equal(qt.codes, quantize_rtn(w, scheme).codes)


def test_dead_column_is_zeroed():
    x = correlated_inputs(256, 32)
    x[:, 5] = 0.0
    qt, stats = gptq_quantize(torch.randn(16, 32), hessian(x), QuantScheme(4, 16, True))
    assert stats.dead_columns == 1
    assert (dequantize(qt)[:, 5] == 0).all()


def test_act_order_groups_follow_descending_diagonal():
    x = correlated_inputs(512, 64, seed=3)
    h = hessian(x)
    qt, _ = gptq_quantize(torch.randn(16, 64), h, QuantScheme(4, 16, True, act_order=True))
    order = torch.argsort(h.diagonal(), descending=True, stable=True)
    expected = torch.empty(64, dtype=torch.int32)
    expected[order] = torch.arange(64, dtype=torch.int32) // 16
    assert qt.g_idx is not None and torch.equal(qt.g_idx, expected)
    assert torch.bincount(qt.g_idx.long()).tolist() == [16] * 4

    static, _ = gptq_quantize(torch.randn(16, 64), h, QuantScheme(4, 16, True, act_order=True, static_groups=True))
    assert static.g_idx is None  # static groups keep k // g: no runtime reorder


def test_group_aware_order_known_answer():
    # groups of 2: maxima 5, 2, 9, 4 -> groups 2, 0, 3, 1; inside each, descending diag
    diag = torch.tensor([1.0, 5.0, 2.0, 0.0, 9.0, 3.0, 4.0, 4.0])
    assert group_aware_order(diag, 2).tolist() == [4, 5, 1, 0, 6, 7, 2, 3]


def test_group_aware_reordering_keeps_plain_groups_and_beats_rtn():
    """GAR changes the processing order only: no g_idx on disk, qparams per original group, error below RTN and
    no worse than without it on inputs whose importance varies across groups."""
    torch.manual_seed(0)
    k, n = 256, 64
    x = correlated_inputs(4096, k) * torch.linspace(0.1, 3.0, k)[torch.randperm(k)]
    w = torch.randn(n, k)
    h = hessian(x)
    scheme = QuantScheme(bits=4, group_size=32, sym=True)
    plain, plain_stats = gptq_quantize(w, h, scheme, group_aware=False)
    gar, gar_stats = gptq_quantize(w, h, scheme, group_aware=True)
    assert gar.g_idx is None and gar.scales.shape == plain.scales.shape
    assert gar_stats.loss < output_error(w, dequantize(quantize_rtn(w, scheme)), h)
    assert gar_stats.loss <= plain_stats.loss * 1.01


def brute_force_clip(w: torch.Tensor, scheme: QuantScheme, shrinks) -> torch.Tensor:
    """The least squared rounding error per group [N, G] over every range shrink p, in float64, written out from the
    format's conventions (quant/scheme.py docstring) without its functions: the reference for the clip search."""
    n, k = w.shape
    g = scheme.group_of(k)
    wg = w.double().reshape(n, k // g, g)
    best = torch.full((n, k // g), float("inf"), dtype=torch.float64)
    for p in shrinks:
        lo, hi = p * wg.amin(2, keepdim=True), p * wg.amax(2, keepdim=True)
        if scheme.sym:
            scale = (torch.maximum(lo.abs(), hi.abs()) / (scheme.maxq / 2)).half().double()
            zero = torch.full_like(scale, 2 ** (scheme.bits - 1))
        else:
            lo, hi = lo.clamp(max=0), hi.clamp(min=0)
            scale = ((hi - lo) / scheme.maxq).half().double()
            zero = torch.round(-lo / scale).clamp(0, scheme.maxq)
        q = (torch.round(wg / scale) + zero).clamp(0, scheme.maxq)
        best = torch.minimum(best, (wg - scale * (q - zero)).square().sum(2))
    return best


@pytest.mark.parametrize("scheme", [QuantScheme(4, 32, True), QuantScheme(4, 32, False), QuantScheme(8, 64, True),
                                    QuantScheme(4, -1, True)], ids=lambda s: s.name())
def test_clip_search_minimises_each_groups_squared_error_over_the_grid(scheme):
    from quantkit.quant.scheme import CLIP_SHRINKS, fit_qparams, group_sq_error

    torch.manual_seed(2)
    w = torch.randn(24, 128) * torch.rand(24, 1).add(0.1)
    w[3, 5], w[7, 40], w[11, 100] = 6.0, -9.0, 4.0  # outliers: where clipping pays most
    scales, zeros = fit_qparams(w, scheme, clip=True)
    got = group_sq_error(w, scales, zeros, scheme).double()
    reference = brute_force_clip(w, scheme, (1.0, *CLIP_SHRINKS))
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-7)
    minmax = group_sq_error(w, *fit_qparams(w, scheme), scheme)
    assert (got <= minmax.double() + 1e-7).all()
    assert got.sum() < (0.97 if scheme.bits == 4 else 1.0) * minmax.sum()  # 8 bits: little left to gain
    assert CLIP_SHRINKS[0] == 0.99 and min(CLIP_SHRINKS) == 0.5


def test_clip_search_with_g_idx_equals_the_contiguous_search_on_permuted_columns():
    from quantkit.quant.scheme import fit_qparams

    torch.manual_seed(4)
    w, scheme = torch.randn(8, 64), QuantScheme(4, 16, True, act_order=True)
    perm = torch.randperm(64)
    g_idx = torch.empty(64, dtype=torch.int32)
    g_idx[perm] = torch.arange(64, dtype=torch.int32) // 16  # column perm[j] is in group j // 16
    got = fit_qparams(w, scheme, g_idx, clip=True)
    want = fit_qparams(w[:, perm], QuantScheme(4, 16, True), clip=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_gptq_with_clip_search_fits_clipped_qparams_and_lowers_the_error():
    from quantkit.quant.scheme import fit_qparams

    torch.manual_seed(5)
    w = torch.randn(48, 192)
    w[torch.rand(48, 192) < 0.01] *= 6  # a few outliers per row
    h = hessian(correlated_inputs(1024, 192))
    scheme = QuantScheme(4, 32, True, act_order=True, static_groups=True)  # qparams fit up front on W
    plain, plain_stats = gptq_quantize(w, h, scheme)
    clipped, clip_stats = gptq_quantize(w, h, scheme, clip=True)
    assert torch.equal(clipped.scales, fit_qparams(w, scheme, clip=True)[0])
    assert torch.equal(plain.scales, fit_qparams(w, scheme)[0])
    assert clip_stats.loss < plain_stats.loss
    gar, gar_stats = gptq_quantize(w, h, QuantScheme(4, 32, True), group_aware=True, clip=True)
    assert gar_stats.loss < gptq_quantize(w, h, QuantScheme(4, 32, True), group_aware=True)[1].loss
    assert gar.g_idx is None and int(gar.codes.max()) <= 15

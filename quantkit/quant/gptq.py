"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"), Algorithm 1, as pure tensor functions. The driver (quant/calibrate.py) collects the inputs.

Per Linear W [N, K] with calibration inputs X [T, K]:
  H = X^T X / T                                  (fp32, `hessian`)
  H += damp * mean(diag H) * I                   (escalated while the Cholesky factorisation fails)
  U = chol(H^-1) upper                           (row i of U holds the OBS update for column i)
  for each column i in processing order (blocks of B columns, updates to later blocks applied lazily):
      q_i = quant(w_i);  err = (w_i - q_i) / U[i, i];  w_{i+1:} -= err * U[i, i+1:]
Act-order processes columns by descending diag(H); groups are formed in processing order (g_idx non-monotonic)
unless static groups fit every group's qparams up front on the original column order. Without act-order,
group-aware reordering (Gafni et al. 2025, "Dual Precision Quantization", GAR) processes the groups by their
largest diag(H) and each group's columns by descending diag(H): every group stays contiguous in processing
order, so groups are the original k // g (no g_idx) and their qparams are still fit on updated columns.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from quantkit.config import QuantScheme
from quantkit.quant.scheme import QTensor, canonical_g_idx, dequantize, fit_qparams, quantize, quantize_rtn

# Dampening fractions tried, in order, after the requested one when the factorisation fails.
DAMP_LADDER = (0.01, 0.03, 0.1, 0.3, 1.0)
_CHUNK = 8192  # rows of X multiplied at once when accumulating H
_HBLOCK = 512  # column block of the triangular H accumulation


@dataclass
class GPTQStats:
    damp: Optional[float]  # fraction of mean(diag H) actually added (None: RTN fallback)
    loss: float  # tr(dW H dW^T) / N: mean squared output error per output element on the calibration inputs
    fallback: bool  # every dampening level failed to factorise: the layer was rounded to nearest instead
    dead_columns: int  # input columns never activated by the calibration data (diag H == 0)


def hessian_block(k: int) -> int:
    """Column block of the triangular accumulation: _HBLOCK for wide inputs, else all K at once."""
    return _HBLOCK if k >= 2 * _HBLOCK else k


def accumulate_hessian(h_sum: torch.Tensor, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> int:
    """h_sum [K, K] fp32 += X^T X over the tokens of x [..., K] (any float dtype) where mask [...] (bool) is True,
    upper block triangle only for wide inputs (symmetric: `finish_hessian` mirrors it, a third fewer FLOPs at
    K = 3 * 512). Returns the number of tokens added."""
    x = x.reshape(-1, x.shape[-1]) if mask is None else x[mask]
    k = x.shape[-1]
    step = hessian_block(k)
    for start in range(0, x.shape[0], _CHUNK):
        xc = x[start:start + _CHUNK].float()  # [t, K]
        for i in range(0, k, step):
            h_sum[i:i + step, i:].addmm_(xc[:, i:i + step].T, xc[:, i:])
    return x.shape[0]


def finish_hessian(h_sum: torch.Tensor, tokens: int) -> torch.Tensor:
    """The accumulated upper block triangle -> the full symmetric H = X^T X / T."""
    k = h_sum.shape[0]
    step = hessian_block(k)
    upper = torch.ones(k // step + 1, k // step + 1, dtype=torch.bool, device=h_sum.device).triu()
    blocks = upper.repeat_interleave(step, 0)[:k].repeat_interleave(step, 1)[:, :k]  # [K, K] True on the blocks
    h = torch.where(blocks, h_sum, h_sum.T)
    return h / max(tokens, 1)


def hessian(x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K], mask [...] bool or None -> H = X^T X / T, fp32 [K, K]."""
    h = torch.zeros(x.shape[-1], x.shape[-1], dtype=torch.float32, device=x.device)
    return finish_hessian(h, accumulate_hessian(h, x, mask))


def output_error(weight: torch.Tensor, approx: torch.Tensor, h: torch.Tensor) -> float:
    """tr(dW H dW^T) / N with dW = W - W' [N, K], H [K, K] = mean x x^T: mean squared output error per element."""
    dw = weight.float() - approx.float()
    return float(((dw @ h) * dw).sum() / dw.shape[0])


def inverse_cholesky(h: torch.Tensor, damp: float) -> tuple[Optional[torch.Tensor], Optional[float]]:
    """H [K, K] -> (U upper [K, K] with U^T U = (H + d mean(diag H) I)^-1, d used), escalating d along
    DAMP_LADDER while a factorisation fails; (None, None) when every level fails."""
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    mean_diag = h.diagonal().mean()
    for d in (damp, *(x for x in DAMP_LADDER if x > damp)):
        lower, info = torch.linalg.cholesky_ex(h + d * mean_diag * eye)
        if info != 0:
            continue
        h_inv = torch.cholesky_solve(eye, lower)  # (10x faster than cholesky_inverse on CPU)
        upper, info = torch.linalg.cholesky_ex(h_inv, upper=True)
        if info == 0 and torch.isfinite(upper).all():
            return upper, d
    return None, None


def group_aware_order(diag: torch.Tensor, g: int) -> torch.Tensor:
    """diag [K] of H -> permutation [K]: groups of g columns by descending largest diag, each group's columns by
    descending diag (ties keep the original order)."""
    k = diag.numel()
    inside = torch.argsort(diag.view(k // g, g), dim=1, descending=True, stable=True)  # [G, g] local order
    groups = torch.argsort(diag.view(k // g, g).amax(dim=1), descending=True, stable=True)  # [G]
    return (inside[groups] + groups[:, None] * g).reshape(k)


def gptq_quantize(weight: torch.Tensor, h: torch.Tensor, scheme: QuantScheme, damp: float = 0.01,
                  block_size: int = 128, layer: str = "", group_aware: bool = False,
                  clip: bool = False) -> tuple[QTensor, GPTQStats]:
    """weight [N, K], h [K, K] (from `hessian`) -> (QTensor, GPTQStats). group_aware: GAR when not act-order.
    clip: every group's qparams by the squared-error clip search of fit_qparams instead of plain min/max."""
    n, k = weight.shape
    g = scheme.group_of(k)
    scheme.groups(k, layer)  # validates that g divides K
    w = weight.detach().float().clone()
    h = h.detach().float().clone()
    h_orig = h.clone()

    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    up_front = scheme.static_groups or g == k  # qparams fit once on the original column order
    if up_front:
        scales, zeros = fit_qparams(w, scheme, layer=layer, clip=clip)  # [N, G]
    else:
        scales = torch.empty(n, k // g, dtype=torch.float16, device=w.device)
        zeros = torch.empty(n, k // g, dtype=torch.uint8, device=w.device)

    perm = None
    gar = group_aware and not scheme.act_order and g < k
    if scheme.act_order:
        perm = torch.argsort(h.diagonal(), descending=True, stable=True)
    elif gar:
        perm = group_aware_order(h.diagonal(), g)
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    # group of each column in processing order: static groups and GAR keep the original k // g
    order = perm if perm is not None else torch.arange(k, device=w.device)
    group_of_step = (order // g) if up_front or gar else (torch.arange(k, device=w.device) // g)

    u, damp_used = inverse_cholesky(h, damp)
    if u is None:
        qt = quantize_rtn(weight.detach().float(), dataclasses.replace(scheme, act_order=False), layer=layer)
        return qt, GPTQStats(None, output_error(weight, dequantize(qt), h_orig), True, int(dead.sum()))

    # blocks hold whole groups, so every group's qparams are fit on fully updated columns
    bs = block_size if up_front else max(g, block_size // g * g)
    with one_cpu_thread(w.device):
        codes = _sweep(w, u, scales, zeros, group_of_step.tolist(), g, bs, up_front, scheme, layer, clip)

    g_idx = None
    if perm is not None:
        inverse = torch.argsort(perm)
        codes = codes[:, inverse]
        g_idx = canonical_g_idx(group_of_step[inverse].to(torch.int32), k, scheme.group_size)
    qt = QTensor(codes.contiguous(), zeros, scales, g_idx, scheme.bits, scheme.group_size, scheme.sym)
    return qt, GPTQStats(damp_used, output_error(weight, dequantize(qt), h_orig), False, int(dead.sum()))


def _sweep(w, u, scales, zeros, group_list, g, bs, up_front, scheme, layer, clip=False) -> torch.Tensor:
    """The column sweep of Algorithm 1 on w [N, K] (processing order) with U [K, K]; fills scales/zeros [N, G]
    as groups are reached (unless fit up front) and returns codes uint8 [N, K] in processing order."""
    n, k = w.shape
    column = scheme_for_columns(scheme)
    wt = w.T.contiguous()  # [K, N]: row i is column i (contiguous rank-1 updates)
    codes = torch.empty(k, n, dtype=torch.uint8, device=w.device)
    for i1 in range(0, k, bs):
        i2 = min(i1 + bs, k)
        w1 = wt[i1:i2].clone()  # [B, N] this block's columns, updated as the sweep goes
        u1 = u[i1:i2, i1:i2]
        u1_diag = u1.diagonal().tolist()
        err1 = torch.zeros_like(w1)  # [B, N]
        for i in range(i2 - i1):
            step, grp = i1 + i, group_list[i1 + i]
            if not up_front and step % g == 0:
                scales[:, grp:grp + 1], zeros[:, grp:grp + 1] = fit_qparams(w1[i:i + g].T, column, layer=layer,
                                                                            clip=clip)
            if i == 0 or grp != group_list[step - 1]:
                s, z = scales[:, grp:grp + 1], zeros[:, grp:grp + 1]  # [N, 1]
                s32, z32 = s[:, 0].float(), z[:, 0].float()
            q = quantize(w1[i][:, None], s, z, scheme.bits, -1)[:, 0]  # [N]
            codes[step] = q
            err = (w1[i] - s32 * (q.float() - z32)) / u1_diag[i]  # [N]
            w1[i:].addr_(u1[i, i:], err, alpha=-1.0)
            err1[i] = err
        wt[i2:].addmm_(u[i1:i2, i2:].T, err1, alpha=-1.0)
    return codes.T


@contextlib.contextmanager
def one_cpu_thread(device: torch.device):
    """The sweep is thousands of tiny ops: on CPU, intra-op threads only add synchronisation (20x slower on a
    busy machine), so it runs on one."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def scheme_for_columns(scheme: QuantScheme) -> QuantScheme:
    """The same bits/symmetry with one group spanning whatever columns it is given."""
    return dataclasses.replace(scheme, group_size=-1, act_order=False, static_groups=False)


def rtn_fallback(weight: torch.Tensor, scheme: QuantScheme, layer: str) -> tuple[QTensor, dict]:
    """A Linear without calibration inputs (an MoE expert no token reached, the forced-routing pass turned off:
    quant/moe_calibration.py): round to nearest, reported as a fallback with no loss (no inputs to measure it on)."""
    qt = quantize_rtn(weight.detach().float(), dataclasses.replace(scheme, act_order=False), layer=layer)
    return qt, {"damp": None, "loss": None, "fallback": True, "dead_columns": weight.shape[1], "no_tokens": True}


class GPTQ:
    """GPTQ as a calibration method of the driver (quant/calibrate.py): one Hessian per distinct input."""

    name = "gptq"
    needs = ("hessian",)
    true_sequential = True

    def __init__(self, scheme: QuantScheme, damp: float = 0.01, block_size: int = 128, group_aware: bool = True,
                 clip: bool = False):
        self.scheme, self.damp, self.block_size, self.group_aware = scheme, damp, block_size, group_aware
        self.clip = clip

    def quantize_stage(self, block, names, stats, prefix) -> Iterator[tuple[str, QTensor, dict]]:
        hessians: dict[int, torch.Tensor] = {}  # id(stats) -> H: q, k and v share one input
        for name in names:
            st = stats.get(name)
            if st is None:  # an expert no calibration token reached (forced pass off): no error to minimise
                yield name, *rtn_fallback(block.get_submodule(name).weight, self.scheme, prefix + name)
                continue
            if id(st) not in hessians:
                hessians[id(st)] = st.hessian()
            yield name, *self.quantize_linear(block.get_submodule(name).weight, hessians[id(st)], prefix + name)

    def quantize_linear(self, weight: torch.Tensor, h: torch.Tensor, layer: str) -> tuple[QTensor, dict]:
        """One Linear's weight [N, K] on its input Hessian h [K, K] (AWQ's rounding of its scaled weights too)."""
        qt, s = gptq_quantize(weight, h, self.scheme, self.damp, self.block_size, layer, self.group_aware, self.clip)
        return qt, dataclasses.asdict(s)

"""THE format: what a quantized weight is inside quantkit, in pure torch.

A Linear has weight W [N, K] (N = out_features, K = in_features, y = x @ W.T). Quantized with b bits
(maxq = 2^b - 1) and group size g (-1: one group spanning all of K), it becomes a QTensor:

    codes  uint8   [N, K]  unsigned integer codes in [0, maxq]
    zeros  uint8   [N, G]  unsigned zero points in [0, maxq]          (G = K / g, or 1 for per-channel)
    scales float16 [N, G]
    g_idx  int32   [K]     group of each input column, or None meaning grp(k) = k // g (act-order makes it
                           non-monotonic: columns are grouped in the order GPTQ visited them)

    W'[n, k] = scales[n, grp(k)] * (codes[n, k] - zeros[n, grp(k)])

Every on-disk layout (quantkit/formats/) stores exactly these integers; every kernel is tested against
`dequantize` below. Quantizer conventions (FORMATS.md), chosen so the codes mean the same to every reader:
  asymmetric  min/max of the group widened to include 0; scale = (max - min) / maxq;
              zero = clamp(round(-min / scale), 0, maxq)
  symmetric   zero = 2^(b-1) (8 at 4 bit, 128 at 8 bit); scale = absmax / (maxq / 2)   (absmax / 7.5 at 4 bit)
  both        q = clamp(round(w / scale) + zero, 0, maxq)
Optionally (`fit_qparams(clip=True)`, GPTQ's `clip_search`) each group's range is first shrunk to the p * [min, max]
with the least squared rounding error; codes and zeros still mean the same. The scale is rounded to float16 *before*
the codes are computed, so the codes are optimal for the scale that is
stored on disk and memory and disk agree exactly. Empty (all-zero) groups get the floor scale SCALE_FLOOR, never 0
or NaN.

Packing (`pack` / `unpack`): p = 32 / b codes per int32 word along one dimension, sequential, the lowest index in
the lowest bits: element i of a run of p sits at bits [b*i, b*(i+1)). The AWQ interleave is a column permutation
applied before this sequential packing (quantkit/formats/awq.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch

from quantkit.config import QuantScheme
from quantkit.errors import QuantkitError

# Smallest scale a group may get (all-zero groups); representable in float16 (subnormal), so never rounds to 0.
SCALE_FLOOR = 1e-6
_FP16_MAX = 65504.0


@dataclass
class QTensor:
    """The canonical quantized weight of one Linear (see the module docstring for the meaning of each field)."""

    codes: torch.Tensor  # uint8 [N, K]
    zeros: torch.Tensor  # uint8 [N, G]
    scales: torch.Tensor  # float16 [N, G]
    g_idx: Optional[torch.Tensor]  # int32 [K] or None (= k // g)
    bits: int
    group_size: int  # -1 = per-channel (G = 1)
    sym: bool

    def __post_init__(self):
        n, k = self.codes.shape
        groups = num_groups(k, self.group_size)
        if self.codes.dtype != torch.uint8 or self.zeros.dtype != torch.uint8:
            raise QuantkitError(f"QTensor codes/zeros must be uint8, got {self.codes.dtype}/{self.zeros.dtype}")
        if self.scales.dtype != torch.float16:
            raise QuantkitError(f"QTensor scales must be float16, got {self.scales.dtype}")
        if tuple(self.zeros.shape) != (n, groups) or tuple(self.scales.shape) != (n, groups):
            raise QuantkitError(
                f"QTensor zeros {tuple(self.zeros.shape)} / scales {tuple(self.scales.shape)} do not match "
                f"[{n}, {groups}] for codes [{n}, {k}] at group_size {self.group_size}"
            )
        if self.g_idx is not None and (self.g_idx.dtype != torch.int32 or tuple(self.g_idx.shape) != (k,)):
            raise QuantkitError(f"QTensor g_idx must be int32 [{k}], got {self.g_idx.dtype} {tuple(self.g_idx.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) = (out_features, in_features)."""
        return tuple(self.codes.shape)

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def group_index(self) -> torch.Tensor:
        """grp(k) int64 [K]: g_idx if present, else k // g."""
        return group_index(self.codes.shape[1], self.group_size, self.g_idx, self.codes.device)

    def equal(self, other: "QTensor") -> bool:
        """Bit-exact equality of every field (what a save/load or pack/unpack round trip must preserve)."""
        same_g_idx = (self.g_idx is None and other.g_idx is None) or (
            self.g_idx is not None and other.g_idx is not None and torch.equal(self.g_idx, other.g_idx))
        return (torch.equal(self.codes, other.codes) and torch.equal(self.zeros, other.zeros)
                and self.scales.dtype == other.scales.dtype and torch.equal(self.scales, other.scales) and same_g_idx
                and (self.bits, self.group_size, self.sym) == (other.bits, other.group_size, other.sym))

    def to(self, device) -> "QTensor":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QTensor(move(self.codes), move(self.zeros), move(self.scales), move(self.g_idx), self.bits,
                       self.group_size, self.sym)


def num_groups(in_features: int, group_size: int) -> int:
    """G for K columns at group size g (-1 -> 1). Callers validate divisibility via QuantScheme.groups."""
    return 1 if group_size == -1 else -(-in_features // group_size)


def group_index(in_features: int, group_size: int, g_idx: Optional[torch.Tensor], device=None) -> torch.Tensor:
    """grp(k) int64 [K]."""
    if g_idx is not None:
        return g_idx.to(device=device, dtype=torch.int64)
    if group_size == -1:
        return torch.zeros(in_features, dtype=torch.int64, device=device)
    return torch.arange(in_features, device=device) // group_size


def canonical_g_idx(g_idx: Optional[torch.Tensor], in_features: int, group_size: int) -> Optional[torch.Tensor]:
    """None when g_idx is the default k // g (so equal weights compare equal), else int32 [K]."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int32)
    default = group_index(in_features, group_size, None, g_idx.device).to(torch.int32)
    return None if torch.equal(g_idx, default) else g_idx


def contiguous_groups(qt: QTensor) -> Optional[tuple[Optional[torch.Tensor], int, torch.Tensor]]:
    """(perm int64 [K] or None, g, codes[:, perm] uint8 [N, K]) such that the input columns x[:, perm] fall in
    contiguous groups of g columns in group order (what the CPU kernels take); perm None without act-order, g = K
    per-channel. None when act-order groups differ in size (no permutation makes them runs of one length)."""
    k = qt.shape[1]
    g = k if qt.group_size == -1 else qt.group_size
    if qt.g_idx is None:
        return None, g, qt.codes
    counts = torch.bincount(qt.g_idx.to(torch.int64), minlength=num_groups(k, qt.group_size))
    if not bool((counts == g).all()):
        return None
    perm = torch.argsort(qt.g_idx, stable=True)
    return perm, g, qt.codes[:, perm]


# in_group_order - x [M, K], contiguous_groups' perm int64 [K] or None -> x[:, perm] [M, K] contiguous
def in_group_order(x: torch.Tensor, perm: Optional[torch.Tensor]) -> torch.Tensor:
    """x's columns in the group order the CPU kernels' packed weights take (act-order; None: as they are)."""
    return (x if perm is None else x.index_select(1, perm)).contiguous()


def fit_qparams(w: torch.Tensor, scheme: QuantScheme, g_idx: Optional[torch.Tensor] = None, layer: str = "",
                clip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (scales float16 [N, G], zeros uint8 [N, G]) by min/max per group (module docstring).

    g_idx [K] (optional) assigns columns to groups (act-order); otherwise groups are contiguous runs of g.
    clip: search each group's range shrink p in CLIP_SHRINKS (1 and 0.99 down to 0.50; min and max both times p)
    for the least squared rounding error sum (w - W')^2 over the group (`clip_search`), instead of plain min/max.
    Raises QuantkitError naming `layer` when the group size does not divide K.
    """
    n, k = w.shape
    groups = scheme.groups(k, layer)
    w = w.float()
    if g_idx is None:
        wmin, wmax = torch.aminmax(w.reshape(n, groups, k // groups), dim=2)  # [N, G] each
    else:
        index = g_idx.to(device=w.device, dtype=torch.int64).expand(n, k)
        wmin = torch.zeros(n, groups, device=w.device).scatter_reduce(1, index, w, "amin", include_self=False)
        wmax = torch.zeros(n, groups, device=w.device).scatter_reduce(1, index, w, "amax", include_self=False)
    if not (torch.isfinite(wmin).all() and torch.isfinite(wmax).all()):  # min/max propagate NaN and inf
        raise QuantkitError(f"layer {layer or '?'}: weight has NaN/inf values; fix the model before quantizing")
    scales, zeros = _range_qparams(wmin, wmax, scheme)
    if clip:
        scales, zeros = clip_search(w, wmin, wmax, scales, zeros, scheme, g_idx)
    return scales, zeros


# Range shrinks the clip search tries after 1 (GPTQ's reference quantizer and GPTQModel/llm-compressor's MSE observers
# search the same kind of grid, 1 - i/100)
CLIP_SHRINKS = tuple(1 - i / 100 for i in range(1, 51))


def _range_qparams(wmin: torch.Tensor, wmax: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min/max [N, G] fp32 -> (scales float16, zeros uint8) [N, G] by the conventions above."""
    maxq = scheme.maxq
    if scheme.sym:
        absmax = torch.maximum(wmin.abs(), wmax.abs())
        scales = _round_scale(absmax / (maxq / 2))
        zeros = torch.full_like(scales, float(1 << (scheme.bits - 1)))
    else:
        wmin, wmax = wmin.clamp(max=0), wmax.clamp(min=0)  # the range always contains 0 (exact zeros stay exact)
        scales = _round_scale((wmax - wmin) / maxq)
        zeros = torch.round(-wmin / scales.float()).clamp(0, maxq)
    return scales, zeros.to(torch.uint8)


def group_sq_error(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, scheme: QuantScheme,
                   g_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """w [N, K] fp32 with qparams [N, G] -> sum over each group's columns of (w - W')^2, fp32 [N, G]."""
    n, k = w.shape
    q = quantize(w, scales, zeros, scheme.bits, scheme.group_size, g_idx)
    grp = group_index(k, scheme.group_size, g_idx, w.device)
    err = (w - scales.float()[:, grp] * (q.float() - zeros.float()[:, grp])).square_()  # [N, K]
    if g_idx is None and k % scales.shape[1] == 0:
        return err.view(n, scales.shape[1], -1).sum(2)
    return torch.zeros_like(scales, dtype=torch.float32).scatter_add_(1, grp.expand(n, k), err)


def clip_search(w: torch.Tensor, wmin: torch.Tensor, wmax: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                scheme: QuantScheme, g_idx: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, the qparams of the range p * [min, max], p in (1, *CLIP_SHRINKS), with the least squared rounding
    error (group_sq_error; the first p wins a tie, so a group no shrink improves keeps its min/max qparams)."""
    best = group_sq_error(w, scales, zeros, scheme, g_idx)  # [N, G]
    scales, zeros = scales.clone(), zeros.clone()
    for p in CLIP_SHRINKS:
        s, z = _range_qparams(wmin * p, wmax * p, scheme)
        err = group_sq_error(w, s, z, scheme, g_idx)
        better = err < best
        best = torch.where(better, err, best)
        scales, zeros = torch.where(better, s, scales), torch.where(better, z, zeros)
    return scales, zeros


def _round_scale(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scale -> float16, floored (never 0, never NaN) and kept finite."""
    return torch.nan_to_num(scale, nan=SCALE_FLOOR).clamp(SCALE_FLOOR, _FP16_MAX).to(torch.float16)


def quantize(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
             g_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """w [N, K] float, scales [N, G], zeros [N, G] -> codes uint8 [N, K] = clamp(round(w / s) + z, 0, maxq)."""
    n, k = w.shape
    groups = scales.shape[1]
    if g_idx is None and k % groups == 0:  # contiguous groups: broadcast [N, G, 1] over [N, G, g]
        q = w.float().reshape(n, groups, k // groups) / scales.float().unsqueeze(2)
        q.round_().add_(zeros.float().unsqueeze(2))
    else:
        grp = group_index(k, group_size, g_idx, w.device)
        q = (w.float() / scales.float()[:, grp]).round_().add_(zeros.float()[:, grp])
    return q.clamp_(0, (1 << bits) - 1).reshape(n, k).to(torch.uint8)


def dequantize(qt: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """QTensor -> W' [N, K] in `dtype` (computed in fp32): scales[n, grp(k)] * (codes[n, k] - zeros[n, grp(k)])."""
    n, k = qt.shape
    w = qt.codes.float()  # [N, K]; updated in place below (same fp32 ops as s * (q - z), fewer allocations)
    if qt.g_idx is None and k % qt.scales.shape[1] == 0:  # contiguous groups: broadcast instead of gathering
        groups = qt.scales.shape[1]
        w.view(n, groups, k // groups).sub_(qt.zeros.float().unsqueeze(2)).mul_(qt.scales.float().unsqueeze(2))
    else:
        grp = qt.group_index()
        w.sub_(qt.zeros.float()[:, grp]).mul_(qt.scales.float()[:, grp])
    return w.to(dtype)


def quantize_rtn(w: torch.Tensor, scheme: QuantScheme, layer: str = "", clip: bool = False) -> QTensor:
    """Round-to-nearest: w [N, K] -> QTensor with min/max (clip: searched, fit_qparams) qparams per contiguous group
    (no act-order)."""
    scales, zeros = fit_qparams(w, scheme, layer=layer, clip=clip)
    codes = quantize(w, scales, zeros, scheme.bits, scheme.group_size)
    return QTensor(codes, zeros, scales, None, scheme.bits, scheme.group_size, scheme.sym)


def pack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """codes [..] integers in [0, 2^bits - 1] -> int32 words, p = 32 / bits codes per word along `dim`.

    Sequential: code i of a run of p sits at bits [bits*i, bits*(i+1)) of its word (lowest index lowest bits).
    A dim whose size is not a multiple of p is zero-padded (unpack takes the true size back).
    Built bytewise: on a little-endian host byte j of a word holds its bits [8j, 8j + 8), so 4-bit codes are paired
    into bytes (pack_nibbles) and every 4 consecutive bytes are reinterpreted as one int32.
    """
    _check_bits(bits)
    x = codes.movedim(dim, -1).to(torch.uint8)  # [..., S]
    pad = -x.shape[-1] % (32 // bits)
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    if bits == 4:
        x = pack_nibbles(x)  # [..., S/2]
    words = x.contiguous().flatten().view(torch.int32).reshape(*x.shape[:-1], -1)  # [..., S/p]
    return words.movedim(-1, dim).contiguous()


def unpack(words: torch.Tensor, bits: int, dim: int, size: int) -> torch.Tensor:
    """int32 words -> uint8 codes with `size` entries along `dim` (inverse of `pack`)."""
    _check_bits(bits)
    words = words.to(torch.int32).movedim(dim, -1)  # [..., W]
    x = words.contiguous().flatten().view(torch.uint8).reshape(*words.shape[:-1], -1)  # [..., 4W] bytes, lowest first
    if bits == 4:
        x = unpack_nibbles(x, 2 * x.shape[-1])
    return x[..., :size].movedim(-1, dim).contiguous()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., S] (values < 16, S even) -> uint8 [..., S/2]: code 2j in the low nibble of byte j, 2j+1 high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 [..., B] -> uint8 [..., size] (size <= 2B), inverse of pack_nibbles."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)[..., :size]


def _check_bits(bits: int) -> None:
    if bits not in (4, 8) or sys.byteorder != "little":
        raise QuantkitError(f"packing supports 4 or 8 bits on little-endian hosts (bits={bits}, {sys.byteorder}-endian)")

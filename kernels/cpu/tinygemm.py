"""torch's packed CPU kernels for W4/W8 weights and bf16 inputs (pure torch, no C of our own): a repack of the
QTensor once per device (`prepare`), then one or two kernel calls per forward (`matmul`). torch vectorizes these for
bfloat16 only, and they beat one dequantization only for few rows (QLinear's thresholds).

Kinds, and the identities that map the format's w = s * (q - z) onto each kernel:
  int4       _weight_int4pack_mm_for_cpu (tinygemm): w = s * (q - 8) + zf with zf = s * (8 - z); its group size
             tg (one of TINYGEMM_GROUPS) divides ours, so each of our groups spans g / tg of its groups
  int8       (per-channel only) _weight_int8pack_mm on (q - 128) int8 [N, K]: y = s * (x @ (q - 128)^T), plus
             x.sum(-1) * s * (128 - z) when asymmetric
  int8_hilo  (8-bit with groups) two tinygemm calls on the high and low nibbles, q = 16 * hi + lo:
             s * (q - z) = 16s * (hi - 8) + s * (lo - 8) + s * (136 - z)
Act-order weights first permute x's columns into contiguous groups (scheme.contiguous_groups). The copies cost
~0.56 B/weight at 4 bit and ~1.1 for int8_hilo; the int8 kind reuses the caller's (q - 128) weight when given.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from quantkit.quant.scheme import QTensor, contiguous_groups, in_group_order

TINYGEMM_GROUPS = (256, 128, 64, 32)  # group sizes _weight_int4pack_mm_for_cpu accepts


def _tinygemm_group(g: int, k: int) -> Optional[int]:
    """Largest tinygemm group size dividing both our group length g and K."""
    return next((tg for tg in TINYGEMM_GROUPS if g % tg == 0 and k % tg == 0), None)


def _scale_zero(scale: torch.Tensor, zero_float: torch.Tensor, repeat: int) -> torch.Tensor:
    """scale, zero_float [N, G] -> tinygemm's qScaleAndZeros bf16 [K / tg, N, 2] (w = scale * (q - 8) + zero_float),
    each of our groups repeated over its `repeat` tinygemm groups."""
    rep = lambda t: t.repeat_interleave(repeat, dim=1).T  # noqa: E731  [K/tg, N]
    return torch.stack([rep(scale), rep(zero_float)], dim=-1).to(torch.bfloat16).contiguous()


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] in [0, 15] -> tinygemm's packed int4 weight."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


# prepare - QTensor [N, K] 4/8-bit (int8_weight: its codes - 128, int8 [N, K], or None) -> (kind, tensors) or None
def prepare(qt: QTensor, int8_weight: Optional[torch.Tensor] = None) -> Optional[tuple[str, Any]]:
    """The kernel tensors for bf16 inputs (module docstring: kind "int4", "int8" or "int8_hilo"), or None where no
    kernel fits (act-order groups of unequal sizes, no tinygemm group size divides ours, N % 16, odd K)."""
    n, k = qt.shape
    s = qt.scales.float()  # [N, G]
    z = qt.zeros.float()  # [N, G]
    if qt.bits == 8 and s.shape[1] == 1:  # one group: column order does not matter, no permutation
        w8 = int8_weight if int8_weight is not None else (qt.codes.to(torch.int16) - 128).to(torch.int8)
        correction = None if bool((qt.zeros == 128).all()) else (s[:, 0] * (128 - z[:, 0]))  # [N] fp32
        return "int8", (None, w8, s[:, 0].to(torch.bfloat16), correction)
    layout = contiguous_groups(qt)
    if layout is None:
        return None
    perm, g, codes = layout  # codes [N, K], groups now contiguous in order
    tg = _tinygemm_group(g, k)
    if tg is None or n % 16 or k % 2:
        return None
    repeat = g // tg  # tinygemm groups per group of ours
    if qt.bits == 4:
        return "int4", (perm, tg, [(_pack4(codes), _scale_zero(s, s * (8 - z), repeat))])
    hi = (_pack4(codes >> 4), _scale_zero(16 * s, s * (136 - z), repeat))
    lo = (_pack4(codes & 0xF), _scale_zero(s, torch.zeros_like(s), repeat))
    return "int8_hilo", (perm, tg, [hi, lo])


# matmul - x2 [M, K] bf16, prepare's (kind, tensors) -> [M, N] bf16
def matmul(x2: torch.Tensor, prepared: tuple[str, Any]) -> torch.Tensor:
    """y = x2 @ W'^T through torch's kernel of this kind (the aten ops check the shapes against the weight)."""
    if x2.dtype != torch.bfloat16 or x2.dim() != 2:
        raise ValueError(f"x2 must be [M, K] bfloat16, got {tuple(x2.shape)} {x2.dtype}")
    kind, tensors = prepared
    x2 = in_group_order(x2, tensors[0])  # act-order: columns into group order
    if kind == "int8":
        _, w8, scale, correction = tensors
        y = torch.ops.aten._weight_int8pack_mm(x2, w8, scale)
        if correction is not None:
            y = (y.float() + x2.float().sum(dim=1, keepdim=True) * correction).to(x2.dtype)
        return y
    _, tg, parts = tensors
    y = None
    for w4, sz in parts:
        part = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w4, tg, sz).float()
        y = part if y is None else y + part
    return y.to(x2.dtype)

"""Serving-time linears for CPU bf16.

PackedLinear: the weight reordered once for the matmul kernel, instead of on every call as aten's mm does; its
`kernel` says which:
  "amx"      CPUs with AMX: the VNNI layout of kernels/cpu/gemm.py, its tile GEMM (1.5x oneDNN's at decode batch
             sizes, 0.7-1.1x the rowwise GEMM at 1-4 rows and 5-7x faster at 16-64: bench/rowwise_gemm.py). Row m
             depends only on x's row m (threads split columns; every row sums K in one order), so it serves
             batch-invariant serving as well; bias added in bf16 after the product's rounding
  "rowwise"  batch-invariant serving (rowwise=True) without AMX, and every mode on CPUs without oneDNN's bf16
             kernels (AVX2: torch's bf16 GEMM there is a portable path, 2.5-8x slower): the same VNNI layout
             through kernels/cpu/rowwise_gemm.py, also row-invariant, bias added in fp32 before the one rounding
  "onednn"   otherwise, and for shapes the VNNI layout does not take (N % 16, K % 32): oneDNN's blocked layout,
             whose kernel and K blocking depend on the row count (without oneDNN's bf16 kernels such a shape is not
             packed: it stays an nn.Linear)
Same products and fp32 accumulation as nn.Linear.

FusedLinear (bf16 on the AMX or the rowwise GEMM, W4/W8 on any kernel of qlinear.packed_kernel): the linears that
read one input (q/k/v, gate/up) as one GEMM on their weights concatenated along N; one call instead of three per
layer, and the small k/v projections no longer leave a thread idle. Columns are computed independently by every
kernel, so the fused outputs are the parts' own bit for bit.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from quantkit.quant.qlinear import QLinear, matmul_packed, packed_kernel
from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.kernels.cpu import rowwise_gemm
from quantkit.kernels.cpu.capability import onednn_bf16
from quantkit.kernels.cpu.fused import CpuFusedOps

log = logging.getLogger("quantkit.serve")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int, rowwise: bool = False):
        """rowwise: a row-invariant kernel (batch-invariant serving): AMX's where it runs, else the rowwise GEMM; a
        shape neither takes keeps oneDNN (`row_invariant` is then False)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        amx = cpu_gemm.available()
        self.vnni = cpu_gemm.pack_bf16(weight) if rowwise or amx or not onednn_bf16() else None  # [N/16, K/2, 16]
        self.kernel = "onednn" if self.vnni is None else "amx" if amx else "rowwise"
        self.onednn = None if self.vnni is not None else torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).contiguous()

    @property
    def row_invariant(self) -> bool:
        return self.kernel != "onednn"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in_features] bf16 -> [..., out_features]
        if self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")
        x2 = x.reshape(-1, self.in_features).contiguous()
        if self.kernel == "rowwise":
            return rowwise_gemm.matmul(x2, self.vnni, self.bias).view(*x.shape[:-1], self.out_features)
        y = cpu_gemm.matmul_bf16(x2, self.vnni)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether serving packs bf16 Linears here: oneDNN has bf16 kernels, or the rowwise GEMM runs a SIMD build."""
    return device.type == "cpu" and dtype == torch.bfloat16 and (onednn_bf16() or rowwise_gemm.vectorised())


def pack_linears(model: nn.Module, batch_hint: int, rowwise: bool = False) -> int:
    """Replace every plain nn.Linear of `model` (not QLinear) by a PackedLinear, in place (rowwise: on a
    row-invariant kernel; a layer neither takes is logged; without oneDNN's bf16 kernels only the shapes the VNNI
    layout takes); returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    packed = 0
    for parent, name, child in swaps:
        fits = cpu_gemm.vnni_fits(child.out_features, child.in_features)
        if rowwise and not fits:
            log.warning("%s.%s (%d x %d) runs on %s: batch invariance does not hold for it (the VNNI layout needs "
                        "out_features %% 16 == 0 and in_features %% 32 == 0)", type(parent).__name__, name,
                        child.out_features, child.in_features, "oneDNN" if onednn_bf16() else "torch's bf16 linear")
        if fits or onednn_bf16():
            setattr(parent, name, PackedLinear(child, batch_hint, rowwise))
            packed += 1
    return packed


class FusedLinear(nn.Module):
    """Parts that read one input (all PackedLinear on the VNNI layout, or all QLinear with the same AMX packing) as
    one GEMM on their weights concatenated along N, its output split back into one [..., N_i] view per part. Each
    part's own kernel weight becomes a view into the concatenation, so the parts still run alone and nothing is
    stored twice.

    Given the MLP that owns them (its gate and up, no bias): the blocks alternate gate, up and the GEMM's epilogue
    returns silu(gate) * up [..., I] itself, so the two [M, I] products are never written out; the few-row
    fallback through the parts applies the MLP's own ops.silu_mul."""

    def __init__(self, parts: list[nn.Module], weight, bits: int, perm: Optional[torch.Tensor],
                 mlp: Optional[nn.Module], rowwise: bool = False):
        super().__init__()
        self.parts = tuple(parts)  # a tuple: not registered as submodules again
        self.in_features = parts[0].in_features
        self.sizes = [p.out_features for p in parts]
        self.weight, self.bits, self.perm = weight, bits, perm  # bits 16: bf16 VNNI
        self.rowwise = rowwise  # bf16 parts on the rowwise GEMM (PackedLinear.kernel "rowwise")
        object.__setattr__(self, "mlp", mlp)  # a plain reference back to the owner, not a submodule
        self.act = mlp is not None
        self.bias = stacked_bias(parts, torch.bfloat16)

    @classmethod
    def of(cls, parts: list[nn.Module], mlp: Optional[nn.Module] = None) -> Optional["FusedLinear"]:
        """The fused module, or None when the parts do not share one packing (AMX, or the rowwise GEMM's) (or,
        given the MLP, they are not two bias-free parts of one width)."""
        interleave = mlp is not None
        if interleave and not gate_up_pair(parts):
            return None
        if all(isinstance(p, PackedLinear) and p.vnni is not None for p in parts):
            if len({p.kernel for p in parts}) != 1:
                return None
            weight = _concat([p.vnni for p in parts], interleave)
            for p, view in zip(parts, _split(weight, [p.vnni.shape[0] for p in parts], interleave)):
                p.vnni = view
            return cls(parts, weight, 16, None, mlp, parts[0].kernel == "rowwise")
        if not all(isinstance(p, QLinear) for p in parts):
            return None
        kernels = [p.prepared("amx") for p in parts]  # (perm, (codes, qparams, gs)) or None
        if any(k is None for k in kernels):
            return None
        perms = [k[0] for k in kernels]
        packs = [k[1] for k in kernels]
        same_pack = len({(p.bits, pk[2], pk[1].shape[1]) for p, pk in zip(parts, packs)}) == 1
        if not (one_permutation(perms) and same_pack):
            return None
        codes = _concat([pk[0] for pk in packs], interleave)
        qparams = _concat([pk[1] for pk in packs], interleave)
        blocks = [pk[0].shape[0] for pk in packs]
        gs = packs[0][2]
        for p, perm, c, q in zip(parts, perms, _split(codes, blocks, interleave), _split(qparams, blocks, interleave)):
            p._prepared["amx"] = (perm, (c, q, gs))
        return cls(parts, (codes, qparams, gs), parts[0].bits, perms[0], mlp)

    def forward(self, x: torch.Tensor):
        """x [..., K] bf16 -> one [..., N_i] view per part; with act, silu(gate) * up [..., I]."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        if self.rowwise:  # the bias in the kernel, in fp32, as each part's own call adds it
            y = rowwise_gemm.matmul(x2.contiguous(), self.weight, None if self.act else self.bias, self.act)
            return y.view(*lead, self.sizes[0]) if self.act else y.view(*lead, sum(self.sizes)).split(self.sizes, -1)
        kind = None if self.bits == 16 else packed_kernel(m)
        if self.bits == 16 or kind == "amx":
            y = cpu_gemm.matmul_packed(x2, self.perm, self.weight, self.bits, self.act)
        elif kind is not None and (not self.act or isinstance(self.mlp.ops, CpuFusedOps)):
            # the GEMV or the rowwise GEMM on the fused weight; their act epilogue is CpuFusedOps.silu_mul's
            # arithmetic, so with other ops the parts run alone and the MLP's own silu_mul follows
            y = matmul_packed(kind, x2, self.perm, self.weight, self.bits, self.act)
        else:  # the parts' own per-row kernels
            outs = tuple(p(x) for p in self.parts)
            return self.mlp.ops.silu_mul(*outs) if self.act else outs
        if self.act:
            return y.view(*lead, self.sizes[0])
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, sum(self.sizes)).split(self.sizes, dim=-1)


def gate_up_pair(parts: list[nn.Module]) -> bool:
    """Whether an MLP's parts fuse with its SiLU-and-multiply: two bias-free projections (gate, up) of one width."""
    return len(parts) == 2 and parts[0].out_features == parts[1].out_features and all(p.bias is None for p in parts)


def one_permutation(perms: list[Optional[torch.Tensor]]) -> bool:
    """Whether parts' act-order permutations are one: none has one, or all hold the same."""
    return all(q is None for q in perms) or all(q is not None and torch.equal(q, perms[0]) for q in perms)


def stacked_bias(parts: list[nn.Module], dtype: torch.dtype, device=None) -> Optional[torch.Tensor]:
    """The parts' biases concatenated in `dtype` on `device` (zeros for a part without one; None when none has
    one): the bias of their outputs stacked along N."""
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([torch.zeros(p.out_features, dtype=dtype, device=device) if p.bias is None
                      else p.bias.detach().to(dtype) for p in parts])


def _concat(tensors: list[torch.Tensor], interleave: bool) -> torch.Tensor:
    """Blocks [B_i, ...] along dim 0, or alternating a0, b0, a1, b1, ... (two tensors of equal shape)."""
    return torch.stack(tensors, dim=1).flatten(0, 1) if interleave else torch.cat(tensors)


def _split(t: torch.Tensor, blocks: list[int], interleave: bool) -> tuple[torch.Tensor, ...]:
    """Each part's blocks of _concat's result, as views (strided every other block when interleaved)."""
    return (t[0::2], t[1::2]) if interleave else t.split(blocks)


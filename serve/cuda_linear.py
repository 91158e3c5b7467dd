"""q/k/v and gate/up as one matmul each on CUDA (the stacking vLLM's QKVParallelLinear and MergedColumnParallelLinear
load), where each part was a launch of its own: serve/prepare.py turns the Attention and MLP modules into
FusedAttention and FusedMLP over a StackedLinear, as it does on CPU over cpu_linear.FusedLinear.

A k or v projection of a GQA model is a quarter of q's width or less: alone, its GEMV leaves most of the GPU idle
while its latency is the whole layer's (kernels/triton/dequant_gemv.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.quant.qlinear import QLinear
from quantkit.serve.cpu_linear import gate_up_pair, one_permutation, stacked_bias


class StackedLinear(nn.Module):
    """Parts that read one input, all nn.Linear of one dtype and device or all QLinear of one packing (bits, group,
    symmetry, act-order permutation), as one matmul over their weights concatenated along N: F.linear, or the
    Triton dequant-GEMM on the concatenated PackedWeight. The output is split back into one [..., N_i] view per
    part; given the MLP that owns them (its gate and up), silu(gate) * up through the MLP's ops. Each part's weight
    becomes a view into the concatenation (its Parameter's data, or its PackedWeight's tensors), so the parts still
    run alone and nothing is stored twice."""

    def __init__(self, parts: list[nn.Module], weight: Optional[torch.Tensor], packed, bias: Optional[torch.Tensor],
                 mlp: Optional[nn.Module]):
        super().__init__()
        self.parts = tuple(parts)  # a tuple: not registered as submodules again
        self.in_features = parts[0].in_features
        self.sizes = [p.out_features for p in parts]
        self.weight, self.packed, self.bias = weight, packed, bias  # weight [N, K] (float) or packed (QLinear)
        object.__setattr__(self, "mlp", mlp)  # a plain reference back to the owner, not a submodule

    @classmethod
    def of(cls, parts: list[nn.Module], mlp: Optional[nn.Module] = None) -> Optional["StackedLinear"]:
        """The stacked module, or None when the parts do not share one kind and packing (or, given the MLP, are not
        two bias-free parts of one width)."""
        if mlp is not None and not gate_up_pair(parts):
            return None
        if all(type(p) is nn.Linear for p in parts):
            if len({(p.weight.dtype, p.weight.device) for p in parts}) != 1:
                return None
            weight = torch.cat([p.weight.detach() for p in parts])
            for p, view in zip(parts, weight.split([p.out_features for p in parts])):
                p.weight.data = view
            return cls(parts, weight, None, stacked_bias(parts, weight.dtype, weight.device), mlp)
        if not all(isinstance(p, QLinear) for p in parts):
            return None
        packs = [p.prepared("triton") for p in parts]
        first = packs[0]
        if (not one_permutation([pw.perm for pw in packs])
                or len({(pw.bits, pw.group_k, pw.sym, pw.in_features) for pw in packs}) != 1):
            return None
        stacked = {name: torch.cat([getattr(pw, name) for pw in packs], dim=1)
                   for name in ("qweight", "scales", "zeros")}
        packed = dataclasses.replace(first, **stacked, out_features=sum(pw.out_features for pw in packs))
        start = 0
        for p, pw in zip(parts, packs):  # column slices: the kernels take a row stride, columns contiguous
            cols = slice(start, start + pw.out_features)
            p._prepared["triton"] = dataclasses.replace(pw, **{k: v[:, cols] for k, v in stacked.items()})
            start += pw.out_features
        from quantkit.kernels.triton.dequant_gemv import reserve_workspace  # imports triton: CUDA only

        reserve_workspace(packed.device, packed.out_features)
        # fp32 holds every part's bias exactly; forward casts it to x's dtype, as each part's own call does
        return cls(parts, None, packed, stacked_bias(parts, torch.float32, packed.device), mlp)

    def forward(self, x: torch.Tensor):
        """x [..., K] -> one [..., N_i] view per part; with the MLP, silu(gate) * up [..., I]."""
        if self.packed is None:
            y = F.linear(x, self.weight, self.bias)
        else:
            from quantkit.kernels.triton import qgemm

            bias = None if self.bias is None else self.bias.to(x.dtype)
            y = qgemm.matmul(x.reshape(-1, self.in_features), self.packed, bias).view(*x.shape[:-1], sum(self.sizes))
        outs = y.split(self.sizes, dim=-1)
        return self.mlp.ops.silu_mul(*outs) if self.mlp is not None else outs


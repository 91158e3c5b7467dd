"""Serving-time nn.Linear for CPU bf16: the weight reordered once for the matmul kernel, instead of on every call as
aten's mm does. On CPUs with AMX the VNNI layout of serve/cpu_gemm.py (its tile GEMM: 1.5x oneDNN's at decode
batch sizes), otherwise oneDNN's blocked layout (AMX/AVX-512 BF16 kernels). Same products and fp32 accumulation
as nn.Linear."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.serve import cpu_gemm


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.vnni = cpu_gemm.pack_bf16(weight) if cpu_gemm.available() else None  # [N/16, K/2, 16] or None
        self.onednn = None if self.vnni is not None else torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in_features] bf16 -> [..., out_features]
        if self.vnni is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")
        y = cpu_gemm.matmul_bf16(x.reshape(-1, self.in_features).contiguous(), self.vnni)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Replace every plain nn.Linear of `model` (not QLinear) by a PackedLinear, in place; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, batch_hint))
    return len(swaps)

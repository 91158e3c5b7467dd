"""Serving-time nn.Linear for CPU bf16: the weight reordered once into oneDNN's blocked layout (AMX/AVX-512 BF16
kernels), instead of on every call as aten's mm does. Same products and fp32 accumulation as nn.Linear."""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)  # opaque layout
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in_features] bf16 -> [..., out_features]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Replace every plain nn.Linear of `model` (not QLinear) by a PackedLinear, in place; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, batch_hint))
    return len(swaps)

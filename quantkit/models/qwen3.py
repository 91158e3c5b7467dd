"""Qwen3: Qwen2's windows, q and k RMSNormed over head_dim before RoPE, biases as config.attention_bias (q/k/v/o)."""

from __future__ import annotations

from quantkit.models.family import Family, register
from quantkit.models.qwen2 import qwen_windows

def parse(hf: dict, where: str) -> dict:
    return qwen_windows(hf)


QWEN3 = register(Family("Qwen3", ("qwen3",), parse=parse, qk_norm=True))

"""Qwen2 / Qwen2.5: Llama with a bias on q/k/v always and never on o; with use_sliding_window, the layers from
max_window_layers on slide (or as config.layer_types says)."""

from __future__ import annotations

from quantkit.models.config import FULL, SLIDING, windowed
from quantkit.models.family import Family, register


def qwen_windows(hf: dict) -> dict:
    """Qwen2/Qwen3's sliding layers: config.layer_types, else those at index >= max_window_layers."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    n = hf["num_hidden_layers"]
    first = hf.get("max_window_layers", 28)
    return windowed(hf.get("layer_types") or [SLIDING if i >= first else FULL for i in range(n)], window)


def parse(hf: dict, where: str) -> dict:
    return {"qkv_bias": True, "o_bias": False, **qwen_windows(hf)}


QWEN2 = register(Family("Qwen2", ("qwen2",), parse=parse))

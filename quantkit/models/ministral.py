"""Ministral (model_type ministral; Ministral-8B-Instruct-2410): Mistral with no bias anywhere and per-layer
attention types: config.layer_types, else every layer slides over config.sliding_window when it is set."""

from __future__ import annotations

from quantkit.models.config import FULL, SLIDING, windowed
from quantkit.models.family import Family, register


def parse(hf: dict, where: str) -> dict:
    window = hf.get("sliding_window")
    types = hf.get("layer_types") or [SLIDING if window is not None else FULL] * hf["num_hidden_layers"]
    return {"qkv_bias": False, "o_bias": False, **windowed(types, window)}


MINISTRAL = register(Family("Ministral", ("ministral",), parse=parse))

"""Mistral: Llama whose every layer slides over config.sliding_window tokens when it is set (v0.1: 4096; v0.2+,
Nemo: null, full attention). HF ignores a Mistral config's layer_types, and so does this."""

from __future__ import annotations

from quantkit.models.config import windowed_everywhere
from quantkit.models.family import Family, register


def parse(hf: dict, where: str) -> dict:
    return windowed_everywhere(hf, hf.get("sliding_window"))


MISTRAL = register(Family("Mistral", ("mistral",), parse=parse))

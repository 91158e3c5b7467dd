"""Gemma (1): Llama's pre-norm block with RMSNorm scaled by (1 + w), GeGLU (gelu's tanh approximation), embeddings
times sqrt(hidden) and tied embeddings by default; attention scale 1 / sqrt(head_dim), no soft-caps, no sliding
window. Gemma 2 and 3 (gemma2.py, gemma3.py) change the block and the attention."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.models.family import Family, register
from quantkit.models.layers import GeGLUMLP, OffsetRMSNorm

# config.hidden_act values transformers runs as GeGLUMLP's gelu: it reads the legacy "gelu" of Gemma's configs as
# the tanh approximation
TANH_GELU = ("gelu_pytorch_tanh", "gelu")


def refuse_bidirectional(hf: dict, where: str) -> None:
    """Every Gemma's config may ask for attention over the whole sequence (an encoder variant): not supported."""
    if hf.get("use_bidirectional_attention"):
        raise QuantkitError(f"{where}: use_bidirectional_attention (an encoder variant) is not supported")


def parse(hf: dict, where: str) -> dict:
    refuse_bidirectional(hf, where)
    act = hf.get("hidden_act", TANH_GELU[0])
    if act not in TANH_GELU:
        raise QuantkitError(f"{where}: hidden_act {act!r} is not supported (Gemma's GeGLU: {TANH_GELU[0]!r})")
    return {}


GEMMA = register(Family("Gemma", ("gemma",), parse=parse, norm=OffsetRMSNorm, mlp=GeGLUMLP, embed_scale=True,
                        tied=True))

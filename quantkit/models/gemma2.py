"""Gemma 2: the sandwich block (post-attention and pre/post-feedforward norms), RMSNorm scaled by (1 + w), GeGLU,
embeddings times sqrt(hidden), attention scale query_pre_attn_scalar ** -0.5, attention logits and final logits
soft-capped (cap * tanh(x / cap)), and every other layer sliding (layers 0, 2, ... unless config.layer_types)."""

from __future__ import annotations

from quantkit.models.blocks import SandwichDecoderLayer
from quantkit.models.config import every_nth_full, windowed
from quantkit.models.family import Family, register
from quantkit.models.gemma import GEMMA, refuse_bidirectional


def gemma_fields(hf: dict, where: str, pattern: int) -> dict:
    """What Gemma 2 and 3 share: layer i slides unless (i + 1) % pattern == 0 (or as config.layer_types says), the
    attention scale's scalar (HF default 256), the final soft-cap; refuses bidirectional attention."""
    refuse_bidirectional(hf, where)
    types = every_nth_full(hf, pattern)
    return {"query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256)),
            "final_logit_softcapping": hf.get("final_logit_softcapping"),
            **windowed(types, hf.get("sliding_window", 4096))}


def parse(hf: dict, where: str) -> dict:
    return {**gemma_fields(hf, where, pattern=2), "final_logit_softcapping": hf.get("final_logit_softcapping", 30.0),
            "attn_logit_softcapping": hf.get("attn_logit_softcapping", 50.0)}


GEMMA2 = register(Family("Gemma 2", ("gemma2",), parse=parse, decoder=SandwichDecoderLayer, norm=GEMMA.norm,
                         mlp=GEMMA.mlp, embed_scale=True, tied=True))

"""Gemma 3 (text: model_type gemma3_text): Gemma 2 without attention soft-capping (HF ignores
attn_logit_softcapping here), with q/k RMSNorm before RoPE, five sliding layers to one global
(sliding_window_pattern 6, or config.layer_types), and the sliding layers on their own RoPE base
(rope_local_base_freq, default 10000) while the global ones use rope_theta (default 1e6) with its scaling."""

from __future__ import annotations

from quantkit.models.config import per_layer_type_rope
from quantkit.models.family import Family, register
from quantkit.models.gemma2 import GEMMA2, gemma_fields


def parse(hf: dict, where: str) -> dict:
    return {**gemma_fields(hf, where, pattern=hf.get("sliding_window_pattern", 6)),
            **per_layer_type_rope(hf, where, default_theta=1e6, local_default=10000.0)}


GEMMA3 = register(Family("Gemma 3", ("gemma3_text",), parse=parse, decoder=GEMMA2.decoder, norm=GEMMA2.norm,
                         mlp=GEMMA2.mlp, qk_norm=True, embed_scale=True, tied=True))

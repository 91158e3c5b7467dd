"""Gemma 3 (text: model_type gemma3_text): Gemma 2 without attention soft-capping (HF ignores
attn_logit_softcapping here), with q/k RMSNorm before RoPE, five sliding layers to one global
(sliding_window_pattern 6, or config.layer_types), and the sliding layers on their own RoPE base
(rope_local_base_freq, default 10000) while the global ones use rope_theta (default 1e6) with its scaling."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.models.config import FULL, SLIDING, parse_rope, rope_parameters
from quantkit.models.family import Family, register
from quantkit.models.gemma2 import GEMMA2, gemma_fields


def parse(hf: dict, where: str) -> dict:
    rope = rope_parameters(hf)
    if FULL in rope or SLIDING in rope:  # transformers 5: one dict per layer type
        theta, scaling = parse_rope(dict(rope.get(FULL) or {}), {}, where, default_theta=1e6)
        local, local_scaling = parse_rope(dict(rope.get(SLIDING) or {}), {}, where)
    else:  # 4.x: rope_theta / rope_scaling for the global layers, rope_local_base_freq for the local ones
        theta, scaling = parse_rope(rope, hf, where, default_theta=1e6)
        local, local_scaling = float(hf.get("rope_local_base_freq", 10000.0)), None
    if local_scaling is not None:
        raise QuantkitError(f"{where}: RoPE scaling on the sliding layers is not supported")
    return {**gemma_fields(hf, where, pattern=hf.get("sliding_window_pattern", 6)), "rope_theta": theta,
            "rope_scaling": scaling, "rope_local_theta": local}


GEMMA3 = register(Family("Gemma 3", ("gemma3_text",), parse=parse, decoder=GEMMA2.decoder, norm=GEMMA2.norm,
                         mlp=GEMMA2.mlp, qk_norm=True, embed_scale=True, tied=True))

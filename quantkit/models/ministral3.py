"""Ministral 3 (model_type ministral3; the text decoder of Ministral-3-3B/8B/14B-2512, inside their mistral3
vision-language checkpoints): Mistral without any bias, YaRN RoPE, and queries scaled after RoPE by
1 + llama_4_scaling_beta * ln(1 + floor(position / original_max_position_embeddings)) (ModelConfig.query_scale;
exactly 1 below that length). Where config.json is silent, transformers' Ministral3Config defaults: DEFAULT_ROPE,
head_dim 128, RMSNorm epsilon 1e-5."""

from __future__ import annotations

from quantkit.models.config import (class_head_dim, parse_rope, position_query_scale, rope_parameters,
                                    windowed_everywhere)
from quantkit.models.family import Family, register

DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16384,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}


def parse(hf: dict, where: str) -> dict:
    fields = {"qkv_bias": False, "o_bias": False, "head_dim": class_head_dim(hf, 128),
              "rms_norm_eps": hf.get("rms_norm_eps", 1e-5), **windowed_everywhere(hf, hf.get("sliding_window"))}
    if rope_parameters(hf) or hf.get("rope_theta") is not None:
        return fields
    rope = dict(DEFAULT_ROPE)
    query_scale = position_query_scale(rope, where)
    theta, scaling = parse_rope(rope, hf, where)
    return {**fields, "rope_theta": theta, "rope_scaling": scaling, "query_scale": query_scale}


MINISTRAL3 = register(Family("Ministral 3", ("ministral3",), parse=parse))

"""Phi-3 / Phi-3.5 (model_type phi3): Llama without biases whose checkpoints fuse q/k/v into qkv_proj and
gate/up into gate_up_proj (split at load into the usual names, keys.py); every layer slides when
config.sliding_window is set (Phi-3-mini-4k: 2047); RoPE default or longrope (Phi-3-128k, Phi-3.5)."""

from __future__ import annotations

from quantkit.models.config import windowed_everywhere
from quantkit.models.family import Family, register
from quantkit.models.keys import split_rows


def parse(hf: dict, where: str) -> dict:
    return {"qkv_bias": False, "o_bias": False, **windowed_everywhere(hf, hf.get("sliding_window"))}


def split(state: dict, cfg) -> dict:
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    state = split_rows(state, "qkv_proj", {"q_proj": q, "k_proj": kv, "v_proj": kv})
    return split_rows(state, "gate_up_proj", {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size})


PHI3 = register(Family("Phi-3", ("phi3",), parse=parse, split=split))

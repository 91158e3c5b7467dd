"""ERNIE 4.5 dense (model_type ernie4_5; ERNIE-4.5-0.3B): Llama whose RoPE turns interleaved pairs of each head's
dims (q/k rows reordered at load, models/keys.py), one switch (config.use_bias) for every Linear's bias, tied
embeddings, and transformers' defaults where config.json is silent: RoPE base 5e5, head_dim 128, 2 KV heads."""

from __future__ import annotations

from quantkit.models.config import class_head_dim
from quantkit.models.family import Family, register


def parse(hf: dict, where: str) -> dict:
    bias = bool(hf.get("use_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bias, "rms_norm_eps": hf.get("rms_norm_eps", 1e-5),
            "head_dim": class_head_dim(hf, 128),
            "num_key_value_heads": hf.get("num_key_value_heads", 2) or hf["num_attention_heads"]}


ERNIE4_5 = register(Family("ERNIE 4.5", ("ernie4_5",), parse=parse, rope_pairs=True, tied=True, rope_theta=5e5))

"""Helium (model_type helium; Kyutai Helium-1): Llama whose RoPE turns interleaved pairs of each head's dims (q/k
rows reordered at load, models/keys.py), RoPE base 1e5, RMSNorm epsilon 1e-8 and head_dim 128 by default; q/k/v bias as
config.attention_bias, o_proj never biased."""

from __future__ import annotations

from quantkit.models.config import class_head_dim
from quantkit.models.family import Family, register


def parse(hf: dict, where: str) -> dict:
    return {"o_bias": False, "rms_norm_eps": hf.get("rms_norm_eps", 1e-8), "head_dim": class_head_dim(hf, 128)}


HELIUM = register(Family("Helium", ("helium",), parse=parse, rope_pairs=True, rope_theta=1e5))

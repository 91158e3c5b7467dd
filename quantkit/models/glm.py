"""GLM-4 (model_type glm: glm-4-9b-chat-hf) and GLM-4-0414 (model_type glm4: GLM-4-9B/32B-0414, GLM-Z1): RoPE on
the first half of each head's dims (partial_rotary_factor 0.5 by default) turning interleaved pairs (q/k rows
reordered at load, models/keys.py), checkpoints fusing gate/up into one gate_up_proj (rows gate | up; split at load,
fused again at write, formats/fused.py), q/k/v bias as config.attention_bias (default true), o_proj never biased,
head_dim 128 where config.json is silent. GLM-4-0414 norms each sublayer's output too (Glm4DecoderLayer)."""

from __future__ import annotations

from quantkit.models.blocks import Glm4DecoderLayer
from quantkit.models.config import class_head_dim, rope_parameters
from quantkit.models.family import Family, register
from quantkit.models.keys import split_rows


def parse(hf: dict, where: str) -> dict:
    partial = rope_parameters(hf).get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 0.5
    return {"qkv_bias": bool(hf.get("attention_bias", True)), "o_bias": False, "partial_rotary_factor": float(partial),
            "rms_norm_eps": hf.get("rms_norm_eps", 1.5625e-7),
            "head_dim": class_head_dim(hf, 128)}


def split(state: dict, cfg) -> dict:
    return split_rows(state, "gate_up_proj", {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size})


GLM = register(Family("GLM-4", ("glm",), parse=parse, split=split, rope_pairs=True))
GLM4 = register(Family("GLM-4-0414", ("glm4",), parse=parse, split=split, rope_pairs=True, decoder=Glm4DecoderLayer))

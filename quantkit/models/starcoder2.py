"""StarCoder2 (model_type starcoder2; 3B, 7B, 15B): Llama's pre-norm block with torch's LayerNorm (its bias;
epsilon config.norm_epsilon), an MLP without gate (c_fc, gelu's tanh approximation, c_proj; renamed up_proj and
down_proj at load, back at write), every Linear but lm_head biased when config.use_bias (default true), every
layer sliding over config.sliding_window when set, tied embeddings by default."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.models.config import windowed_everywhere
from quantkit.models.family import Family, register
from quantkit.models.layers import GeluTanhMLP, LayerNorm


def parse(hf: dict, where: str) -> dict:
    act = hf.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise QuantkitError(f"{where}: hidden_act {act!r} is not supported (StarCoder2's: 'gelu_pytorch_tanh')")
    bias = bool(hf.get("use_bias", True))
    return {"rms_norm_eps": hf.get("norm_epsilon", 1e-5), "qkv_bias": bias, "o_bias": bias, "mlp_bias": bias,
            **windowed_everywhere(hf, hf.get("sliding_window"))}


STARCODER2 = register(Family("StarCoder2", ("starcoder2",), parse=parse, norm=LayerNorm, mlp=GeluTanhMLP, tied=True,
                             renames=((".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))))

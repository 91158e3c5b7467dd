"""Nemotron (model_type nemotron: Nemotron-3, Nemotron-4 Minitron 4B / 8B, Mistral-NeMo-Minitron): Llama's
pre-norm block with LayerNorm1P (torch's LayerNorm, scale 1 + w, a bias; epsilon config.norm_eps), an MLP without
gate (up_proj, relu(x)^2, down_proj), RoPE on the first half of each head by default
(config.partial_rotary_factor, 0.5), q/k/v/o biased when config.attention_bias, the MLP when config.mlp_bias."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.models.config import rope_parameters
from quantkit.models.family import Family, register
from quantkit.models.layers import LayerNorm1P, Relu2MLP


def relu2_only(hf: dict, where: str) -> None:
    act = hf.get("hidden_act", "relu2")
    if act != "relu2":
        raise QuantkitError(f"{where}: hidden_act {act!r} is not supported (this family's MLP: 'relu2')")


def parse(hf: dict, where: str) -> dict:
    relu2_only(hf, where)
    partial = rope_parameters(hf).get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 0.5
    return {"rms_norm_eps": hf.get("norm_eps", 1e-5), "partial_rotary_factor": float(partial)}


NEMOTRON = register(Family("Nemotron", ("nemotron",), parse=parse, norm=LayerNorm1P, mlp=Relu2MLP))

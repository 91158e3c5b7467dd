"""Hunyuan dense (model_type hunyuan_v1_dense: Hunyuan-0.5B/1.8B/4B/7B): Llama with q and k RMSNormed over head_dim
after RoPE (query_layernorm / key_layernorm in its checkpoints, q_norm / k_norm here), and its "dynamic" RoPE with a
fixed `alpha`, which only stretches the base: theta * alpha ** (D / (D - 2)), the same at every length."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.models.config import class_head_dim, parse_rope, rope_parameters
from quantkit.models.family import Family, register


def parse(hf: dict, where: str) -> dict:
    rope = rope_parameters(hf)
    kind = rope.get("rope_type") or rope.get("type")
    fields = {"rms_norm_eps": hf.get("rms_norm_eps", 1e-5)}
    if kind != "dynamic":
        return fields
    alpha = rope.get("alpha")
    if not alpha:
        raise QuantkitError(f"{where}: rope_type 'dynamic' without an alpha (length-dependent NTK) is not supported")
    theta, _ = parse_rope({"rope_theta": rope.get("rope_theta")}, hf, where)
    head_dim = class_head_dim(hf, None)
    return {**fields, "rope_theta": theta * float(alpha) ** (head_dim / (head_dim - 2)), "rope_scaling": None}


HUNYUAN = register(Family("Hunyuan", ("hunyuan_v1_dense",), parse=parse, qk_norm=True, qk_norm_after_rope=True,
                          renames=((".self_attn.query_layernorm.", ".self_attn.q_norm."),
                                   (".self_attn.key_layernorm.", ".self_attn.k_norm."))))

"""Hunyuan MoE (model_type hunyuan_v1_moe: Hunyuan-A13B): Hunyuan dense's attention (q/k norms after RoPE, its
fixed-alpha RoPE) with a MoE block in every layer: top moe_topk of num_experts by softmax, renormalised, plus one
always-on shared expert (`shared_mlp` in its checkpoints, shared_experts here); every expert of intermediate_size.
The router is `mlp.gate.wg` in its checkpoints (`mlp.gate` here). Per-layer lists of num_experts or moe_topk are
refused unless every layer has the same value."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.models.family import Family, register
from quantkit.models.hunyuan import HUNYUAN
from quantkit.models.hunyuan import parse as parse_dense
from quantkit.models.layers import MLP
from quantkit.models.moe import MoE
from quantkit.models.qwen2_moe import qwen_experts, split


def uniform(hf: dict, key: str, default: int, where: str) -> int:
    """config[key], an int or a per-layer list whose values are all one."""
    value = hf.get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise QuantkitError(f"{where}: {key} {value} differs between layers: not supported")
        value = value[0]
    return int(value)


def parse(hf: dict, where: str) -> dict:
    inter = hf.get("intermediate_size", 11008)
    return {**parse_dense(hf, where), "num_experts": uniform(hf, "num_experts", 1, where),
            "num_experts_per_tok": uniform(hf, "moe_topk", 1, where), "moe_intermediate_size": inter,
            "shared_expert_intermediate_size": inter, "sparse_layers": tuple(range(hf["num_hidden_layers"]))}


def moe(cfg, linear_cls) -> MoE:
    return MoE(cfg.hidden_size, qwen_experts(cfg, linear_cls), cfg.num_experts_per_tok, normalize=True,
               fp32_weights=False, shared_experts=MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, linear_cls))


HUNYUAN_MOE = register(Family("Hunyuan MoE", ("hunyuan_v1_moe",), parse=parse, moe=moe, split=split, qk_norm=True,
                              qk_norm_after_rope=True,
                              renames=HUNYUAN.renames + ((".mlp.gate.wg.", ".mlp.gate."),
                                                         (".mlp.shared_mlp.", ".mlp.shared_experts."))))

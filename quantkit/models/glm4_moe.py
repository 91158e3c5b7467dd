"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (model_type glm4_moe): Llama's pre-norm block with RoPE on the first half of each
head by default (config.partial_rotary_factor 0.5, rotate-half), q/k/v biased as config.attention_bias (o never),
per-head q/k RMSNorms when config.use_qk_norm, and from layer config.first_k_dense_replace on a MoE block
(GroupedTopKMoE: sigmoid scores with a correction bias, n_group groups of which topk_group are eligible, top-k of
n_routed_experts weighted by routed_scaling_factor, plus n_shared_experts always-on experts as one MLP). Releases
carry num_nextn_predict_layers multi-token-prediction layers after the decoder's: never read (a quantized folder
has none)."""

from __future__ import annotations

import re

from quantkit.errors import QuantkitError
from quantkit.models.config import need, rope_parameters
from quantkit.models.family import Family, register
from quantkit.models.keys import split_experts
from quantkit.models.layers import MLP
from quantkit.models.moe import GroupedTopKMoE
from quantkit.models.qwen2_moe import qwen_experts

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def parse(hf: dict, where: str) -> dict:
    experts, shared = need(hf, "n_routed_experts", where), hf.get("n_shared_experts", 1)
    groups, inter = hf.get("n_group") or 1, need(hf, "moe_intermediate_size", where)
    if not shared:
        raise QuantkitError(f"{where}: n_shared_experts 0 (a MoE block without shared experts) is not supported")
    if experts % groups:
        raise QuantkitError(f"{where}: n_routed_experts {experts} do not fall in n_group {groups} equal groups")
    partial = rope_parameters(hf).get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 0.5
    n = hf["num_hidden_layers"]
    return {"num_experts": experts, "num_experts_per_tok": need(hf, "num_experts_per_tok", where),
            "moe_intermediate_size": inter, "shared_expert_intermediate_size": inter * shared,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)), "router_groups": groups,
            "router_topk_groups": hf.get("topk_group") or 1,
            "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
            "sparse_layers": tuple(range(hf.get("first_k_dense_replace", 1), n)), "o_bias": False,
            "qk_norm": bool(hf.get("use_qk_norm", False)), "partial_rotary_factor": float(partial)}


def moe(cfg, linear_cls) -> GroupedTopKMoE:
    return GroupedTopKMoE(cfg.hidden_size, qwen_experts(cfg, linear_cls), cfg.num_experts_per_tok,
                          cfg.norm_topk_prob, cfg.router_groups, cfg.router_topk_groups, cfg.routed_scaling_factor,
                          MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, linear_cls))


def split(state: dict, cfg) -> dict:
    """The decoder's tensors (the multi-token-prediction layers past num_hidden_layers dropped), experts split."""
    decoder = {k: t for k, t in state.items()
               if (m := _LAYER.match(k)) is None or int(m.group(1)) < cfg.num_hidden_layers}
    return split_experts(decoder, cfg, "mlp", "gate_proj", "up_proj", "down_proj")


GLM4_MOE = register(Family("GLM-4.5", ("glm4_moe",), parse=parse, moe=moe, split=split,
                           fp32_tensors=(".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")))

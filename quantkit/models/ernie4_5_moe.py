"""ERNIE 4.5 MoE (model_type ernie4_5_moe: ERNIE-4.5-21B-A3B, 300B-A47B): ERNIE 4.5 dense's attention (RoPE turning
interleaved pairs, tied embeddings, transformers' defaults) with a MoE block (CorrectedSoftmaxMoE: top
moe_k of moe_num_experts, chosen by softmax + e_score_correction_bias, plus moe_num_shared_experts always-on experts
as one MLP) in the layers from moe_layer_start_index to moe_layer_end_index every moe_layer_interval-th; dense MLPs
elsewhere. The router weight and correction bias stay fp32 (Family.fp32_tensors). config.use_bias is refused (no
released MoE checkpoint sets it)."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.models.ernie4_5 import parse as parse_dense
from quantkit.models.family import Family, register
from quantkit.models.keys import split_experts
from quantkit.models.layers import MLP
from quantkit.models.moe import CorrectedSoftmaxMoE
from quantkit.models.qwen2_moe import qwen_experts


def parse(hf: dict, where: str) -> dict:
    if hf.get("use_bias"):
        raise QuantkitError(f"{where}: use_bias (biased Linears and experts) is not supported")
    n, interval = hf["num_hidden_layers"], hf.get("moe_layer_interval", 1)
    start, end = hf.get("moe_layer_start_index", 1), hf.get("moe_layer_end_index", -1)
    end = n - 1 if end == -1 else end
    inter = hf.get("moe_intermediate_size", 1536)
    return {**parse_dense(hf, where), "num_experts": hf.get("moe_num_experts", 64),
            "num_experts_per_tok": hf.get("moe_k", 6), "moe_intermediate_size": inter,
            "shared_expert_intermediate_size": inter * hf.get("moe_num_shared_experts", 2),
            "router_norm_min": float(hf.get("moe_norm_min", 1e-12)),
            "sparse_layers": tuple(i for i in range(n) if (i + 1) % interval == 0 and start <= i <= end)}


def moe(cfg, linear_cls) -> CorrectedSoftmaxMoE:
    shared = cfg.shared_expert_intermediate_size
    return CorrectedSoftmaxMoE(cfg.hidden_size, qwen_experts(cfg, linear_cls), cfg.num_experts_per_tok,
                               cfg.router_norm_min, MLP(cfg.hidden_size, shared, linear_cls) if shared else None)


def split(state: dict, cfg) -> dict:
    return split_experts(state, cfg, "mlp", "gate_proj", "up_proj", "down_proj")


ERNIE4_5_MOE = register(Family("ERNIE 4.5 MoE", ("ernie4_5_moe",), parse=parse, moe=moe, split=split,
                               rope_pairs=True, tied=True, rope_theta=5e5,
                               renames=((".mlp.moe_statics.e_score_correction_bias",
                                         ".mlp.gate.e_score_correction_bias"),),
                               fp32_tensors=(".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")))

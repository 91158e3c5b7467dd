"""OLMoE (model_type olmoe: OLMoE-1B-7B): Llama's pre-norm block with OLMo 2's q/k RMSNorms over the whole
projection (Llama's rounding) and a sparse MoE block in every layer: top-k of a softmax over config.num_experts
experts of config.intermediate_size, renormalised only with norm_topk_prob, no shared expert. config.clip_qkv (q,
k and v clamped) is refused."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.models.config import need
from quantkit.models.family import Family, register
from quantkit.models.moe import MoE
from quantkit.models.qwen2_moe import qwen_experts, split


def parse(hf: dict, where: str) -> dict:
    if hf.get("clip_qkv") is not None:
        raise QuantkitError(f"{where}: clip_qkv (q, k and v clamped) is not supported")
    return {"num_experts": hf.get("num_experts", 64), "num_experts_per_tok": need(hf, "num_experts_per_tok", where),
            "moe_intermediate_size": need(hf, "intermediate_size", where),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "sparse_layers": tuple(range(hf["num_hidden_layers"]))}


def moe(cfg, linear_cls) -> MoE:
    return MoE(cfg.hidden_size, qwen_experts(cfg, linear_cls), cfg.num_experts_per_tok,
               normalize=cfg.norm_topk_prob, fp32_weights=False)


OLMOE = register(Family("OLMoE", ("olmoe",), parse=parse, moe=moe, qk_norm=True, qk_norm_whole=True, split=split))

"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm, biases as config.attention_bias) with Qwen2-MoE's sparse layers and
routing but no shared expert; with use_sliding_window every layer slides."""

from __future__ import annotations

from quantkit.models.config import windowed_everywhere
from quantkit.models.family import Family, register
from quantkit.models.moe import MoE
from quantkit.models.qwen2_moe import qwen_experts, qwen_moe_fields, split


def parse(hf: dict, where: str) -> dict:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return {**qwen_moe_fields(hf, where), **windowed_everywhere(hf, window)}


def moe(cfg, linear_cls) -> MoE:
    return MoE(cfg.hidden_size, qwen_experts(cfg, linear_cls), cfg.num_experts_per_tok,
               normalize=cfg.norm_topk_prob, fp32_weights=False)


QWEN3_MOE = register(Family("Qwen3-MoE", ("qwen3_moe",), parse=parse, moe=moe, qk_norm=True, split=split))

"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias unless config.qkv_bias is false) with a
sparse MoE block in the layers decoder_sparse_step and mlp_only_layers select (a dense MLP elsewhere): top-k of a
softmax over num_experts, renormalised only with norm_topk_prob, plus an always-on shared expert weighted by
sigmoid(shared_expert_gate(x)). The experts are per-expert `mlp.experts.{e}.{gate,up,down}_proj` Linears."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.models.config import FULL, SLIDING, need, windowed
from quantkit.models.family import Family, register
from quantkit.models.keys import split_experts
from quantkit.models.layers import MLP
from quantkit.models.moe import MoE


def qwen_moe_fields(hf: dict, where: str) -> dict:
    """What Qwen2-MoE and Qwen3-MoE share: expert counts and sizes, and which layers are sparse."""
    experts = hf.get("num_experts") or need(hf, "num_local_experts", where)
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    return {"num_experts": experts, "num_experts_per_tok": need(hf, "num_experts_per_tok", where),
            "moe_intermediate_size": need(hf, "moe_intermediate_size", where),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "sparse_layers": tuple(i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)}


def qwen_experts(cfg, linear_cls) -> list[nn.Module]:
    return [MLP(cfg.hidden_size, cfg.moe_intermediate_size, linear_cls) for _ in range(cfg.num_experts)]


def split(state: dict, cfg) -> dict:
    return split_experts(state, cfg, "mlp", "gate_proj", "up_proj", "down_proj")


class SharedExpertMoE(MoE):
    """MoE + sigmoid(shared_expert_gate(x)) * shared_expert(x); the gate [1, H] is a plain nn.Linear (never
    quantized, like the router)."""

    def __init__(self, cfg, linear_cls):
        super().__init__(cfg.hidden_size, qwen_experts(cfg, linear_cls), cfg.num_experts_per_tok,
                         normalize=cfg.norm_topk_prob, fp32_weights=False)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, linear_cls)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def parse(hf: dict, where: str) -> dict:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    first = hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or [SLIDING if (i + 1) % 2 and i < first else FULL
                                      for i in range(hf["num_hidden_layers"])]
    return {**qwen_moe_fields(hf, where), "qkv_bias": bool(hf.get("qkv_bias", True)), "o_bias": False,
            "shared_expert_intermediate_size": need(hf, "shared_expert_intermediate_size", where),
            **windowed(types, window)}


QWEN2_MOE = register(Family("Qwen2-MoE", ("qwen2_moe",), parse=parse, moe=SharedExpertMoE, split=split))

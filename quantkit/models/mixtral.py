"""Mixtral: Mistral's attention with every MLP a sparse MoE block (`block_sparse_moe`: router `gate`, experts
w1 = gate, w3 = up, w2 = down, SwiGLU), top-k of num_local_experts, the k weights renormalised (a softmax over the
top-k logits) and kept in fp32."""

from __future__ import annotations

from torch import nn

from quantkit.models.config import need, windowed_everywhere
from quantkit.models.family import Family, register
from quantkit.models.keys import split_experts
from quantkit.models.layers import MLP
from quantkit.models.moe import MoE


class MixtralExpert(MLP):
    """A SwiGLU expert under Mixtral's checkpoint names (w1 = gate, w3 = up, w2 = down)."""

    def __init__(self, hidden: int, intermediate: int, linear_cls):
        nn.Module.__init__(self)
        self.w1 = linear_cls(hidden, intermediate, bias=False)
        self.w3 = linear_cls(hidden, intermediate, bias=False)
        self.w2 = linear_cls(intermediate, hidden, bias=False)

    gate_proj = property(lambda self: self.w1)
    up_proj = property(lambda self: self.w3)
    down_proj = property(lambda self: self.w2)


def parse(hf: dict, where: str) -> dict:
    return {"num_experts": hf.get("num_local_experts") or need(hf, "num_experts", where),
            "num_experts_per_tok": need(hf, "num_experts_per_tok", where),
            "sparse_layers": tuple(range(hf["num_hidden_layers"])), "qkv_bias": False, "o_bias": False,
            **windowed_everywhere(hf, hf.get("sliding_window"))}


def moe(cfg, linear_cls) -> MoE:
    experts = [MixtralExpert(cfg.hidden_size, cfg.intermediate_size, linear_cls) for _ in range(cfg.num_experts)]
    return MoE(cfg.hidden_size, experts, cfg.num_experts_per_tok, normalize=True, fp32_weights=True)


def split(state: dict, cfg) -> dict:
    return split_experts(state, cfg, "block_sparse_moe", "w1", "w3", "w2")


MIXTRAL = register(Family("Mixtral", ("mixtral",), parse=parse, moe=moe, ffn_name="block_sparse_moe", split=split))

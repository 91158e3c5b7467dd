"""The decoder blocks: Llama's pre-norm block and Gemma's sandwich, each built from a Family's norm, MLP and MoE."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from quantkit.models.attention import Attention, AttentionBackend


class DecoderLayer(nn.Module):
    """Pre-norm block (Llama): x += attn(norm(x)); x += ffn(norm(x)). The ffn is the family's MLP, or its MoE block
    in cfg.sparse_layers, under the family's attribute name (`mlp`; Mixtral: `block_sparse_moe`)."""

    def __init__(self, cfg, layer_idx: int, linear_cls: Callable[..., nn.Module], family):
        super().__init__()
        norm = family.norm
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, linear_cls, norm if family.qk_norm else None)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_name = family.ffn_name
        if family.moe is not None and layer_idx in cfg.sparse_layers:
            ffn = family.moe(cfg, linear_cls)
        else:
            ffn = family.mlp(cfg.hidden_size, cfg.intermediate_size, linear_cls, cfg.mlp_bias)
        setattr(self, self.ffn_name, ffn)
        self.rotary = None  # set by DecoderModel: the layer's shared RotaryEmbedding (not a submodule)

    @property
    def ffn(self) -> nn.Module:
        return self._modules[self.ffn_name]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: Optional[AttentionBackend] = None):
        """x [B, L, H] (dense) or [T, H] (paged); positions [L], [B, L] or [T]."""
        h = self.self_attn(self.input_layernorm(x), positions, self.rotary, attn)
        h, x = self.post_attention_layernorm.add_and_norm(h, x)
        return x + self.ffn(h)


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2/3: each sublayer's output is normed before the residual add, and the MLP has its own input norm:
    x += post_attention_layernorm(attn(input_layernorm(x))); x += post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, cfg, layer_idx: int, linear_cls: Callable[..., nn.Module], family):
        super().__init__(cfg, layer_idx, linear_cls, family)
        self.pre_feedforward_layernorm = family.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = family.norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: Optional[AttentionBackend] = None):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, self.rotary, attn))
        return x + self.post_feedforward_layernorm(self.ffn(self.pre_feedforward_layernorm(x)))

"""The decoder blocks: Llama's pre-norm block, Gemma's and GLM-4-0414's sandwich, Cohere's parallel block and OLMo
2's post-norm block, each built from a Family's norm, MLP and MoE."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from quantkit.models.attention import Attention, AttentionBackend


class DecoderLayer(nn.Module):
    """Pre-norm block (Llama): x += attn(input_layernorm(x)); x += ffn(post_attention_layernorm(x)), each sublayer's
    output times cfg.residual_multiplier before its add (Granite; 1 elsewhere). The ffn is the family's MLP, or its
    MoE block in cfg.sparse_layers, under the family's attribute name (`mlp`; Mixtral: `block_sparse_moe`). A
    subclass changes `sublayer_norms` and forward, which follows it (the CPU decode step plans record a block from
    it: serve/cpu_step_plans.py)."""

    # the checkpoint names of the family norms over hidden the block holds, by where they act: the attention's
    # input, its output (before the residual add), the MLP's input (fused with that add), its output; None: no norm
    sublayer_norms = ("input_layernorm", None, "post_attention_layernorm", None)
    parallel = False  # the MLP reads the attention's normed input, not the residual stream after attention (Cohere)

    def __init__(self, cfg, layer_idx: int, linear_cls: Callable[..., nn.Module], family):
        super().__init__()
        for name in filter(None, self.sublayer_norms):
            setattr(self, name, family.norm(cfg.hidden_size, cfg.rms_norm_eps))
        self.self_attn = Attention(cfg, layer_idx, linear_cls, family.norm if family.qk_norm or cfg.qk_norm else None,
                                   family.qk_norm_whole, family.qk_norm_after_rope)
        self.residual_multiplier = cfg.residual_multiplier
        self.ffn_name = family.ffn_name
        if family.moe is not None and layer_idx in cfg.sparse_layers:
            ffn = family.moe(cfg, linear_cls)
        else:
            ffn = family.mlp(cfg.hidden_size, cfg.intermediate_size, linear_cls, cfg.mlp_bias)
        setattr(self, self.ffn_name, ffn)
        self.rotary = None  # set by DecoderModel: the layer's shared RotaryEmbedding (not a submodule), or None (NoPE)

    @property
    def ffn(self) -> nn.Module:
        return self._modules[self.ffn_name]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: Optional[AttentionBackend] = None):
        """x [B, L, H] (dense) or [T, H] (paged); positions [L], [B, L] or [T]."""
        h = self.self_attn(self.input_layernorm(x), positions, self.rotary, attn)
        h, x = self.post_attention_layernorm.add_and_norm(self.residual(h), x)
        return x + self.residual(self.ffn(h))

    def residual(self, h: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as it joins the residual stream: times residual_multiplier, rounded to h's dtype (HF's
        Granite product)."""
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2/3: each sublayer's output is normed before the residual add, and the MLP has its own input norm:
    x += post_attention_layernorm(attn(input_layernorm(x))); x += post_ff_norm(mlp(pre_ff_norm(x)))."""

    sublayer_norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: Optional[AttentionBackend] = None):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, self.rotary, attn))
        return x + self.post_feedforward_layernorm(self.ffn(self.pre_feedforward_layernorm(x)))


class Glm4DecoderLayer(DecoderLayer):
    """GLM-4-0414: Gemma 2's sandwich under GLM's checkpoint names (post_attention_layernorm is the MLP's input norm):
    x += post_self_attn_layernorm(attn(input_layernorm(x)));
    x += post_mlp_layernorm(mlp(post_attention_layernorm(x)))."""

    sublayer_norms = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: Optional[AttentionBackend] = None):
        x = x + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), positions, self.rotary, attn))
        return x + self.post_mlp_layernorm(self.ffn(self.post_attention_layernorm(x)))


class ParallelDecoderLayer(DecoderLayer):
    """Cohere: attention and MLP read the same normed input, side by side: h = input_layernorm(x);
    x += attn(h) + mlp(h) (summed in that order, as transformers does)."""

    sublayer_norms = ("input_layernorm", None, None, None)
    parallel = True

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: Optional[AttentionBackend] = None):
        h = self.input_layernorm(x)
        return x + self.self_attn(h, positions, self.rotary, attn) + self.ffn(h)


class PostNormDecoderLayer(DecoderLayer):
    """OLMo 2: no input norms; each sublayer's output is normed before the residual add:
    x += post_attention_layernorm(attn(x)); x += post_feedforward_layernorm(ffn(x))."""

    sublayer_norms = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: Optional[AttentionBackend] = None):
        x = x + self.post_attention_layernorm(self.self_attn(x, positions, self.rotary, attn))
        return x + self.post_feedforward_layernorm(self.ffn(x))

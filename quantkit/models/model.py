"""The decoder every family builds: embeddings -> blocks -> final norm -> lm_head, shaped by its Family's data.

Module names mirror Hugging Face's checkpoints, so state-dict keys are the HF tensor names (fused checkpoint tensors
are split at load, quantkit/models/keys.py). The Linear class is a constructor argument; the model never knows about
quantization (QLinear replaces modules after construction) or serving (an AttentionBackend is an argument), see
docs/CONTRACTS.md.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from quantkit.models.attention import Attention, AttentionBackend, AttentionSpec
from quantkit.models.family import family_of
from quantkit.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, UpDownMLP


class DecoderModel(nn.Module):
    """`model.*` of the checkpoint: embed_tokens, layers, norm, and the rotary embeddings (no weights)."""

    def __init__(self, cfg, linear_cls: Callable[..., nn.Module], family):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(family.decoder(cfg, i, linear_cls, family) for i in range(cfg.num_hidden_layers))
        self.norm = family.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)
        if cfg.rope_local_theta is not None:  # Gemma 3: the sliding layers' own base
            self.rotary_emb_local = RotaryEmbedding(cfg, sliding=True)
        for i, layer in enumerate(self.layers):
            local = cfg.rope_local_theta is not None and cfg.window(i) is not None
            rotary = None if i in cfg.nope_layers else self.rotary_emb_local if local else self.rotary_emb
            object.__setattr__(layer, "rotary", rotary)  # shared; None: a NoPE layer (SmolLM3), no RoPE at all


class CausalLM(nn.Module):
    """Any supported family, chosen by cfg.model_type (the families registered in quantkit/models/family.py)."""

    def __init__(self, cfg, linear_cls: Callable[..., nn.Module] = nn.Linear):
        super().__init__()
        self.config = cfg
        self.family = family_of(cfg.model_type)
        self.model = DecoderModel(cfg, linear_cls, self.family)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_specs(self) -> list[AttentionSpec]:
        """Per layer: scale, sliding window, logit soft-cap (what an AttentionBackend must implement)."""
        return [layer.self_attn.spec for layer in self.model.layers]

    def rotaries(self) -> list[RotaryEmbedding]:
        return [m for m in self.model.children() if isinstance(m, RotaryEmbedding)]

    def set_ops(self, ops) -> None:
        """Route the per-token ops (norms, RoPE, SiLU-and-multiply) through `ops` (TorchOps' contract)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, GatedMLP, UpDownMLP)):
                module.ops = ops

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [...] -> the first block's input [..., H] (Gemma: times sqrt(H) rounded to the dtype; Granite:
        times embedding_multiplier, the product rounded to the dtype)."""
        x = self.model.embed_tokens(input_ids)
        scale = self.embedding_scale(x.dtype)
        if scale is not None:
            x = x * torch.tensor(scale, dtype=x.dtype)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        return x

    def embedding_scale(self, dtype: torch.dtype) -> Optional[float]:
        """Gemma's embedding scale sqrt(H), rounded to `dtype` as HF rounds it; None for the other families."""
        if not self.family.embed_scale:
            return None
        return float(torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.float32).to(dtype))

    def hidden(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
               attn: Optional[AttentionBackend] = None) -> torch.Tensor:
        """input_ids [B, L] (dense) or [T] (paged, with attn) -> final-normed hidden [..., H]."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        x = self.embed(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, attn)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> float32 logits [..., V] (finish_logits of lm_head's output)."""
        return self.finish_logits(self.lm_head(hidden))

    @property
    def plain_logits(self) -> bool:
        """Whether finish_logits is a float32 conversion alone."""
        cfg = self.config
        return cfg.logits_scaling == 1.0 and cfg.logit_scale == 1.0 and cfg.final_logit_softcapping is None

    def finish_logits(self, raw: torch.Tensor) -> torch.Tensor:
        """lm_head's output [..., V] -> float32 logits: divided by logits_scaling (Granite) or times logit_scale
        (Cohere) in raw's dtype, rounded as HF rounds it, then soft-capped where the config says (Gemma 2:
        cap * tanh(logits / cap), in fp32)."""
        scaling, scale, cap = self.config.logits_scaling, self.config.logit_scale, self.config.final_logit_softcapping
        raw = raw if scaling == 1.0 else raw / scaling
        logits = (raw if scale == 1.0 else raw * scale).float()
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
                attn: Optional[AttentionBackend] = None, logits_indices: Optional[torch.Tensor] = None):
        """-> float32 logits [B, L, V] (dense), [T, V] (paged) or [S, V] at `logits_indices` [S]."""
        h = self.hidden(input_ids, positions, attn)
        if logits_indices is not None:
            h = h.reshape(-1, h.shape[-1])[logits_indices]
        return self.logits(h)

"""Attention with GQA, optional biases, optional q/k RMSNorm, and per-layer facts as data (AttentionSpec).

Dense (attn=None): causal over the batch's own tokens, with the layer's sliding window and logit soft-cap. Paged: an
AttentionBackend (the serving engine's KV cache, docs/CONTRACTS.md) does the attending; it reads the same facts from
`model.attention_specs` (window_mask and masked_attention are shared with it), and `unsupported_by_paged_attention`
says what the paged path cannot serve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.models.layers import TorchOps


class AttentionBackend(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (RoPE applied) -> out [T, Hq, D]."""


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer's attention computes beyond causal softmax(q k^T) v."""

    scale: float  # multiplies q . k: 1 / sqrt(head_dim), Gemma: query_pre_attn_scalar ** -0.5, Granite: its multiplier
    sliding_window: Optional[int] = None  # a query at position p sees keys p - window + 1 .. p; None: all up to p
    logit_softcap: Optional[float] = None  # scores -> cap * tanh(scores / cap) before masking (Gemma 2)

    @classmethod
    def of(cls, cfg, layer_idx: int) -> "AttentionSpec":
        scalar, scale = cfg.query_pre_attn_scalar, cfg.attention_multiplier
        if scale is None:
            scale = 1.0 / math.sqrt(scalar if scalar is not None else cfg.head_dim)
        return cls(scale, cfg.window(layer_idx), cfg.attn_logit_softcapping)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """Keys a query may see: q_pos [..., Lq, 1], k_pos [..., 1, Lk] (broadcasting) -> bool [..., Lq, Lk], causal
    (key <= query) and, with a window, key > query - window. The dense and the paged paths share it."""
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     spec: AttentionSpec) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D], allowed bool [B | 1, 1, Lq, Lk] -> [B, Hq, Lq, D] at spec's scale,
    soft-capped when spec says so (every query must see at least one key)."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    if spec.logit_softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=spec.scale, enable_gqa=hq != hkv)
    # soft-capping happens between the product and the softmax, which SDPA has no hook for: eager, fp32 softmax
    qg = q.view(b, hkv, hq // hkv, n, d)  # [B, Hkv, G, Lq, D]: the queries sharing one kv head
    scores = (qg @ k.unsqueeze(2).transpose(-1, -2)) * spec.scale  # [B, Hkv, G, Lq, Lk]
    scores = torch.tanh(scores / spec.logit_softcap) * spec.logit_softcap
    scores = scores.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v.unsqueeze(2)).view(b, hq, n, d)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """q [B, Hq, L, D], k/v [B, Hkv, L, D] -> [B, Hq, L, D], causal over the L tokens (right padding is safe)."""
    gqa, n = k.shape[1] != q.shape[1], q.shape[2]
    window = spec.sliding_window if spec.sliding_window is not None and spec.sliding_window < n else None
    if window is None and spec.logit_softcap is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=spec.scale, enable_gqa=gqa)
    i = torch.arange(n, device=q.device)
    return masked_attention(q, k, v, window_mask(i[:, None], i[None, :], window)[None, None], spec)


class Attention(nn.Module):
    ops = TorchOps

    def __init__(self, cfg, layer_idx: int, linear_cls: Callable[..., nn.Module],
                 qk_norm: Optional[Callable[[int, float], nn.Module]] = None, qk_norm_whole: bool = False,
                 qk_norm_after_rope: bool = False):
        """qk_norm: the RMSNorm class applied to q and k before RoPE, over head_dim (Qwen3, Gemma 3) or, qk_norm_whole,
        over the whole projection, Hq * D and Hkv * D wide (OLMo 2), or, qk_norm_after_rope, over head_dim after RoPE
        (Hunyuan); None: no q/k norm."""
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.spec = AttentionSpec.of(cfg, layer_idx)
        h, qd, kvd = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = linear_cls(h, qd, bias=cfg.qkv_bias)
        self.k_proj = linear_cls(h, kvd, bias=cfg.qkv_bias)
        self.v_proj = linear_cls(h, kvd, bias=cfg.qkv_bias)
        self.o_proj = linear_cls(qd, h, bias=cfg.o_bias)
        self.query_scale = cfg.query_scale  # (beta, length) or None
        self.qk_norm_after_rope = qk_norm_after_rope
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm = qk_norm(qd if qk_norm_whole else cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = qk_norm(kvd if qk_norm_whole else cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, positions, rotary, attn: Optional[AttentionBackend]):
        # x [*lead, H] with lead = (B, L) dense or (T,) paged; positions [*lead] or [L]
        lead = x.shape[:-1]
        q, k, v = self.project(x)  # [*lead, Hq * D], [*lead, Hkv * D] x 2
        if self.q_norm is not None and not self.qk_norm_after_rope:  # per row of the norm's width: a head, or all
            q = self.q_norm(q.unflatten(-1, (-1, self.q_norm.weight.shape[0])))
            k = self.k_norm(k.unflatten(-1, (-1, self.k_norm.weight.shape[0])))
        q = q.view(*lead, self.n_heads, self.head_dim)
        k = k.view(*lead, self.n_kv, self.head_dim)
        v = v.view(*lead, self.n_kv, self.head_dim)
        if rotary is not None:  # None: a NoPE layer (SmolLM3), q and k unrotated
            q, k = self.ops.rope(q, k, positions, rotary)
        if self.q_norm is not None and self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.query_scale is not None:
            q = q * position_scale(positions, *self.query_scale).to(q.dtype)[..., None, None]
        if attn is None:  # dense: [B, L, H, D] -> [B, H, L, D]
            out = dense_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.spec).transpose(1, 2)
        else:
            out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(*lead, self.n_heads * self.head_dim))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [*lead, H] -> q [*lead, Hq * D], k, v [*lead, Hkv * D] (a serving runner may override it with one
        fused GEMM: serve/prepare.py)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def position_scale(positions: torch.Tensor, beta: float, length: int) -> torch.Tensor:
    """Ministral 3's query scale at `positions` (int, any shape): 1 + beta * ln(1 + floor(position / length)) in
    fp32, as transformers computes it; exactly 1 below `length`."""
    return 1 + beta * torch.log(1 + torch.floor(positions / length))


def kernel_servable(spec: AttentionSpec) -> bool:
    """Whether the CPU paged kernels that attend causally over the whole cache (the C decode / AMX prefill kernels;
    any scale) compute this layer: no sliding window, no logit soft-cap. (The Triton kernels take every spec.)"""
    return spec.sliding_window is None and spec.logit_softcap is None


def kv_window(specs: list[AttentionSpec]) -> Optional[int]:
    """The KV a sequence must keep, in tokens behind its next query: the largest window when every layer slides
    (Mistral, Mixtral, Phi-3 with sliding_window), None when any layer attends globally (Gemma 2/3, Qwen2/3 with
    max_window_layers: their global layers read every block)."""
    windows = [spec.sliding_window for spec in specs]
    return None if not windows or None in windows else max(windows)


def unsupported_by_paged_attention(model) -> Optional[str]:
    """Why the paged path of serve/ cannot run `model`, in one sentence naming the family; None when it can. Both
    backends honour every layer's AttentionSpec (scale, sliding window, logit soft-cap). K/V are cached rotated, so
    each position needs one RoPE for a sequence's life: longrope must first be settled for the serving length
    (RotaryEmbedding.settle, which the serving runner calls)."""
    if any(r.long_inv_freq is not None for r in model.rotaries()):
        return f"{model.family.name} ({model.config.model_type}) uses longrope, whose frequencies switch with the " \
               f"sequence length, and its RoPE was not settled for a serving length (RotaryEmbedding.settle)"
    return None

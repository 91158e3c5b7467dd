"""ONE model definition for the Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5, SmolLM2, TinyLlama).

Module names mirror Hugging Face's LlamaForCausalLM, so state-dict keys are the HF tensor names. The Linear class
is a constructor argument (nn.Linear, or anything with the same (in, out, bias) signature); the model never knows
about quantization (QLinear replaces modules after construction). Attention is dense and causal unless an
AttentionBackend is passed (the serving engine's paged KV cache), see docs/CONTRACTS.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.models.registry import arch_spec


class AttentionBackend(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (RoPE applied) -> out [T, Hq, D]."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face config.json dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        model_type = hf.get("model_type", "llama")
        spec = arch_spec(model_type)
        heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        attention_bias = hf.get("attention_bias", False)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            model_type=model_type,
            qkv_bias=spec.qkv_bias or attention_bias,
            o_bias=spec.o_bias_follows_attention_bias and attention_bias,
            mlp_bias=hf.get("mlp_bias", False),
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """inv_freq [D/2] float32, with linear or llama3 frequency scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq.float()
    kind = scaling["rope_type"]
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short kept, a smooth ramp in between.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_mid, mid, out).float()
    raise QuantkitError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, H, D], cos/sin [..., T, 1, D]: rotate-half RoPE (HF convention, not interleaved)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchOps:
    """The per-token ops between the matmuls, in plain torch (any device, dtype and layout). A serving runner may
    swap in fused kernels with the same contract (kernels/cpu/fused.py) through LlamaForCausalLM.set_ops."""

    @staticmethod
    def rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
        """-> (weight * norm(x + residual), x + residual): normalise in fp32 (as HF does), scale in x's dtype."""
        if residual is not None:
            x = residual + x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype), x

    @staticmethod
    def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary: "RotaryEmbedding"):
        """q [*lead, Hq, D], k [*lead, Hkv, D] at positions [*lead] (or [L] shared by a batch) -> rotated q, k."""
        cos, sin = rotary(positions, q.dtype)
        if q.dim() == 4 and positions.dim() == 1:  # one position row shared by the batch
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class RMSNorm(nn.Module):
    ops = TorchOps

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, None, self.weight, self.eps)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (norm(x + residual), x + residual)."""
        return self.ops.rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    ops = TorchOps

    def __init__(self, cfg: ModelConfig, layer_idx: int, linear_cls: Callable[..., nn.Module]):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, qd, kvd = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = linear_cls(h, qd, bias=cfg.qkv_bias)
        self.k_proj = linear_cls(h, kvd, bias=cfg.qkv_bias)
        self.v_proj = linear_cls(h, kvd, bias=cfg.qkv_bias)
        self.o_proj = linear_cls(qd, h, bias=cfg.o_bias)

    def forward(self, x, positions, rotary, attn: Optional[AttentionBackend]):
        # x [*lead, H] with lead = (B, L) dense or (T,) paged; positions [*lead] or [L]
        lead = x.shape[:-1]
        q, k, v = self.project(x)
        q = q.view(*lead, self.n_heads, self.head_dim)
        k = k.view(*lead, self.n_kv, self.head_dim)
        v = v.view(*lead, self.n_kv, self.head_dim)
        q, k = self.ops.rope(q, k, positions, rotary)
        if attn is None:
            # dense causal: [B, L, H, D] -> [B, H, L, D]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=self.n_kv != self.n_heads,
            ).transpose(1, 2)
        else:
            out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(*lead, self.n_heads * self.head_dim))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [*lead, H] -> q [*lead, Hq * D], k, v [*lead, Hkv * D] (a serving runner may override it with one
        fused GEMM: serve/prepare.py)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class MLP(nn.Module):
    ops = TorchOps

    def __init__(self, cfg: ModelConfig, linear_cls: Callable[..., nn.Module]):
        super().__init__()
        self.gate_proj = linear_cls(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = linear_cls(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = linear_cls(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(self.activated(x))

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        """x [*lead, H] -> silu(gate(x)) * up(x) [*lead, I] (a serving runner may override it with one fused GEMM
        and its epilogue: serve/prepare.py)."""
        return self.ops.silu_mul(self.gate_proj(x), self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, linear_cls: Callable[..., nn.Module]):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, linear_cls)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, linear_cls)
        self.rotary = None  # set by LlamaModel: the shared RotaryEmbedding (not a submodule)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: Optional[AttentionBackend] = None):
        """x [B, L, H] (dense) or [T, H] (paged); positions [L], [B, L] or [T]."""
        h = self.self_attn(self.input_layernorm(x), positions, self.rotary, attn)
        h, x = self.post_attention_layernorm.add_and_norm(h, x)
        return x + self.mlp(h)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._last = None  # (positions, dtype, inv_freq, (cos, sin)) of the latest call
        self._table = torch.empty(0)  # [P, D] fp32 cos | sin of positions 0 .. P-1, grown on demand
        self._table_key = (None, None)  # (positions, inv_freq) the table was last checked against

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [...] -> cos, sin [..., 1, D] in `dtype` (angles computed in fp32). Every layer of one forward
        passes the same positions tensor: the result is computed once and reused (the cache holds that tensor, so
        its identity cannot be recycled for another)."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype and last[2] is self.inv_freq:
            return last[3]
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [..., D/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)  # [..., 1, D]
        result = emb.cos().to(dtype), emb.sin().to(dtype)
        self._last = (positions, dtype, self.inv_freq, result)
        return result

    def table(self, positions: torch.Tensor) -> torch.Tensor:
        """fp32 [P, D], row p = cos(p * inv_freq) | sin(p * inv_freq) (the angles forward() uses), P > max
        position. Checked once per forward (same positions tensor), grown by doubling."""
        if self._table_key[0] is positions and self._table_key[1] is self.inv_freq:
            return self._table
        need = int(positions.max()) + 1
        if self._table.shape[0] < need or self._table_key[1] is not self.inv_freq:
            size = max(need, 2 * self._table.shape[0], 256)
            freqs = torch.arange(size, device=self.inv_freq.device).to(torch.float32)[:, None] * self.inv_freq
            self._table = torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()
        self._table_key = (positions, self.inv_freq)
        return self._table


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, linear_cls: Callable[..., nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, linear_cls) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)
        for layer in self.layers:
            object.__setattr__(layer, "rotary", self.rotary_emb)  # shared, not registered twice


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, linear_cls: Callable[..., nn.Module] = nn.Linear):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, linear_cls)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_ops(self, ops) -> None:
        """Route the per-token ops (norms, RoPE, SiLU-and-multiply) through `ops` (TorchOps' contract)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.ops = ops

    def hidden(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
               attn: Optional[AttentionBackend] = None) -> torch.Tensor:
        """input_ids [B, L] (dense) or [T] (paged, with attn) -> final-normed hidden [..., H]."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, attn)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def forward(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
                attn: Optional[AttentionBackend] = None, logits_indices: Optional[torch.Tensor] = None):
        """-> float32 logits [B, L, V] (dense), [T, V] (paged) or [S, V] at `logits_indices` [S]."""
        h = self.hidden(input_ids, positions, attn)
        if logits_indices is not None:
            h = h.reshape(-1, h.shape[-1])[logits_indices]
        return self.logits(h)

"""Shared layers of every family: the per-token ops, the norms, RoPE, and the MLPs (gated, and up-act-down).

A family picks among them by data (quantkit/models/family.py); nothing here knows about quantization or serving.
The Linear class is a constructor argument (nn.Linear, or anything with its (in, out, bias) signature).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import QuantkitError


# an MLP without gate's activation by kind: relu(x)^2 (Nemotron, Arcee), gelu's tanh approximation (StarCoder2)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu2": lambda x: torch.square(F.relu(x)), "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class TorchOps:
    """The per-token ops between the matmuls, in plain torch (any device, dtype and layout). A serving runner may
    swap in fused kernels with the same contract (kernels/cpu/fused.py) through CausalLM.set_ops."""

    @staticmethod
    def rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
        """-> (weight * norm(x + residual), x + residual): normalise in fp32 (as HF does), scale in x's dtype."""
        if residual is not None:
            x = residual + x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype), x

    @staticmethod
    def fp32_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, offset: float,
                  centered: bool, bias: Optional[torch.Tensor] = None):
        """-> ((offset + weight) * norm(x + residual) + bias, x + residual), in fp32 before one rounding to x's dtype
        (HF's OLMo 2 and Gemma order, unlike Llama's round-then-scale); centered: x - mean(x) normed (LayerNorm)."""
        if residual is not None:
            x = residual + x
        x32 = x.float()
        if centered:
            x32 = x32 - x32.mean(-1, keepdim=True)
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.float())
        return (y if bias is None else y + bias.float()).to(x.dtype), x

    @staticmethod
    def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
        """The activation of an MLP without gate, by kind (ACTIVATIONS)."""
        return ACTIVATIONS[kind](x)

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

    @staticmethod
    def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * up


class RMSNorm(nn.Module):
    """y = w * norm(x) (Llama): normalised in fp32, rounded to x's dtype, then scaled (through `ops`)."""

    ops = TorchOps
    weight_offset = 0.0  # the scale is weight_offset + weight (AWQ folds into the sum)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, None, self.weight, self.eps)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (norm(x + residual), x + residual)."""
        return self.ops.rms_norm(x, residual, self.weight, self.eps)


class Fp32RMSNorm(RMSNorm):
    """y = (weight_offset + w) * norm(x) (+ bias: LayerNorm) with the whole product in fp32 before one rounding to
    x's dtype (HF's OLMo 2 and Gemma order, unlike Llama's round-then-scale), through `ops` (fp32_norm)."""

    centered = False  # x - mean(x) normed (LayerNorm)

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_and_norm(x, None)[0]

    def add_and_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        weight, offset = self.scaling()
        return self.ops.fp32_norm(x, residual, weight, self.eps, offset, self.centered, self.bias)

    def scaling(self) -> tuple[torch.Tensor, float]:
        """(w, offset): the scale is offset + w, summed in fp32."""
        return self.weight, self.weight_offset


class Fp32LayerNorm(Fp32RMSNorm):
    """y = w * (x - mean(x)) / sqrt(var(x) + eps), no bias (Cohere's LayerNorm): in fp32, rounded once."""

    centered = True


class LayerNorm(Fp32LayerNorm):
    """torch's LayerNorm with a bias (StarCoder2), in fp32 and rounded once as torch's CPU kernel rounds it."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.bias = nn.Parameter(torch.zeros(dim))


class LayerNorm1P(LayerNorm):
    """Nemotron's LayerNorm: the checkpoint stores w of the scale 1 + w, summed in w's dtype as transformers sums it
    (in bf16 that rounding moves the scale by up to 2^-8, unlike Gemma's fp32 sum)."""

    weight_offset = 1.0

    def scaling(self) -> tuple[torch.Tensor, float]:
        return self.weight + self.weight_offset, 0.0


class OffsetRMSNorm(Fp32RMSNorm):
    """y = (1 + w) * norm(x) (Gemma): the checkpoint stores w."""

    weight_offset = 1.0


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, H, D], cos/sin [..., T, 1, R]: rotate-half RoPE (HF convention, not interleaved) of the first
    R <= D dims of each head; the other D - R pass through (partial rotary: Phi-4-mini)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = r // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


ROPE_TYPES = ("linear", "llama3", "longrope", "yarn")  # the scaled RoPE types beside the default one


def unsupported_rope(kind: str) -> str:
    return f"rope scaling type {kind!r} is not supported (supported: default, {', '.join(ROPE_TYPES)})"


def rope_inv_freq(cfg, sliding: bool = False, long: bool = False) -> torch.Tensor:
    """inv_freq [R/2] float32 (on CPU; R = cfg.rotary_dim, the rotated dims of a head) of the full-attention layers,
    or of the sliding ones (`sliding`: Gemma 3's local base), with one of ROPE_TYPES' frequency scaling; `long`:
    longrope's long-context factors."""
    theta, scaling = cfg.rope(sliding)
    d = cfg.rotary_dim
    exponents = torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d
    inv_freq = 1.0 / (theta ** exponents)
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "default":
        return inv_freq.float()
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
    if kind == "longrope":
        # Phi-3: each frequency divided by its own factor, the short set up to original_max_position_embeddings
        # tokens, the long set past it (HF computes these in fp32)
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
        exponents = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d
        return 1.0 / (ext * theta ** exponents)
    if kind == "yarn":
        return yarn_inv_freq(scaling, theta, d)
    raise QuantkitError(unsupported_rope(kind))


def yarn_inv_freq(scaling: dict, theta: float, d: int) -> torch.Tensor:
    """YaRN (Qwen2.5/3 long context): frequency i is blended between itself (extrapolation: the fast ones, over
    beta_fast or more rotations in the pretraining length) and itself / factor (interpolation: the slow ones, under
    beta_slow rotations), on a linear ramp over the dimensions in between (their bounds floored / ceiled unless
    `truncate` is false); in fp32, as transformers computes it."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension_of(rotations: float) -> float:  # the dimension that turns `rotations` times in `original` tokens
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(fast), dimension_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high
    kept = 1 - ((torch.arange(d // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    powers = theta ** (torch.arange(0, d, 2, device="cpu").float() / d)  # [R/2]: 1 / each unscaled frequency
    return 1.0 / (factor * powers) * (1 - kept) + 1.0 / powers * kept  # HF's operation order, bit for bit


def rope_attention_factor(scaling: Optional[dict]) -> float:
    """What cos and sin are multiplied by: `attention_factor` where set, else longrope's sqrt(1 + ln(factor) /
    ln(original length)), YaRN's mscale(factor) = 0.1 ln(factor) + 1 (DeepSeek's mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) where both are set); 1 for the other types."""
    kind = scaling["rope_type"] if scaling else "default"
    if kind not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    if factor <= 1.0:
        return 1.0
    if kind == "longrope":
        return math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dims:
        return (0.1 * mscale * math.log(factor) + 1) / (0.1 * all_dims * math.log(factor) + 1)
    return 0.1 * math.log(factor) + 1


class RotaryEmbedding(nn.Module):
    """cos/sin of the RoPE angles p * inv_freq. Longrope (Phi-3) switches to its long frequencies for a forward whose
    largest position reaches original_max_position_embeddings (as HF does) and scales cos/sin by its attention
    factor, until `settle` fixes one set for serving; `inv_freq` is then the set every position uses."""

    def __init__(self, cfg, sliding: bool = False):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg, sliding), persistent=False)
        scaling = cfg.rope(sliding)[1]
        longrope = bool(scaling) and scaling["rope_type"] == "longrope"
        self.register_buffer("long_inv_freq", rope_inv_freq(cfg, sliding, long=True) if longrope else None,
                             persistent=False)
        self.long_from = scaling["original_max_position_embeddings"] if longrope else None  # first long position
        self.attention_factor = rope_attention_factor(scaling)
        self._last = None  # (positions, dtype, inv_freq, (cos, sin)) of the latest call

    def settle(self, max_len: int) -> None:
        """Fix the frequencies for serving sequences of at most max_len tokens, as vLLM does: longrope takes its long
        set for every position when max_len > original_max_position_embeddings, else its short set (no sequence
        reaches the switch). K/V cached at one position then never go stale as the sequence grows. transformers
        differs on sequences shorter than the switch in a model that allows longer ones: it rotates them with the
        short set, and once a sequence crosses, its new tokens with the long set beside cached short-set K/V."""
        if self.long_inv_freq is not None and max_len > self.long_from:
            self.inv_freq = self.long_inv_freq
        self.long_inv_freq = None

    def frequencies(self, positions: torch.Tensor) -> torch.Tensor:
        """The inv_freq [R/2] for a forward over `positions` (longrope: the long set from long_from on)."""
        if self.long_inv_freq is not None and int(positions.max()) >= self.long_from:
            return self.long_inv_freq
        return self.inv_freq

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [...] -> cos, sin [..., 1, R] in `dtype` (R: the config's rotary_dim; angles computed in fp32).
        Every layer of one forward passes the same positions tensor: the result is computed once and reused (the
        cache holds that tensor, so its identity cannot be recycled for another)."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype and last[2] is self.inv_freq:
            return last[3]
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.frequencies(positions)  # [..., R/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)  # [..., 1, R]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        result = cos.to(dtype), sin.to(dtype)
        self._last = (positions, dtype, self.inv_freq, result)
        return result


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); the activation is the subclass's `activated`."""

    ops = TorchOps

    def __init__(self, hidden: int, intermediate: int, linear_cls: Callable[..., nn.Module], bias: bool = False):
        super().__init__()
        self.gate_proj = linear_cls(hidden, intermediate, bias=bias)
        self.up_proj = linear_cls(hidden, intermediate, bias=bias)
        self.down_proj = linear_cls(intermediate, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(self.activated(x))

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class MLP(GatedMLP):
    """SwiGLU (Llama, Qwen, Mistral, Phi-3 after its gate_up split, the Qwen MoE experts)."""

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        """x [*lead, H] -> silu(gate(x)) * up(x) [*lead, I] (a serving runner may override it with one fused GEMM
        and its SiLU epilogue: serve/prepare.py, which fuses MLP and Mixtral's expert, not other subclasses)."""
        return self.ops.silu_mul(self.gate_proj(x), self.up_proj(x))


class GeGLUMLP(GatedMLP):
    """GeGLU (Gemma): gelu with the tanh approximation instead of silu; not an MLP, so no SiLU fusion applies."""

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_tanh_mul(self.gate_proj(x), self.up_proj(x))


class UpDownMLP(nn.Module):
    """down(act(up(x))), no gate (StarCoder2, Nemotron, Arcee); act: `ops.activation` of the subclass's kind."""

    ops = TorchOps
    activation = ""  # TorchOps.activation's kind

    def __init__(self, hidden: int, intermediate: int, linear_cls: Callable[..., nn.Module], bias: bool = False):
        super().__init__()
        self.up_proj = linear_cls(hidden, intermediate, bias=bias)
        self.down_proj = linear_cls(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.activation(self.up_proj(x), self.activation))


class Relu2MLP(UpDownMLP):
    """relu(x)^2 (Nemotron, Arcee: config.hidden_act "relu2")."""

    activation = "relu2"


class GeluTanhMLP(UpDownMLP):
    """gelu's tanh approximation (StarCoder2: config.hidden_act "gelu_pytorch_tanh")."""

    activation = "gelu_tanh"

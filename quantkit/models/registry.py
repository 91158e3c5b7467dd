"""Per-architecture facts as data (never isinstance/string chains in the algorithms).

Module paths are relative to one decoder block (`model.layers.N`). Every supported architecture shares the Llama
block; they differ only in biases, which the config decides, and in the defaults below.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.errors import QuantkitError


@dataclass(frozen=True)
class ScalingGroup:
    """AWQ: `prev` (an RMSNorm or Linear) feeds every Linear in `linears`; a per-input-channel scale s divides
    `prev`'s output and multiplies the linears' weight columns. `inspect` is the module whose output the search
    compares (the linears' common parent, or the single linear). `needs_equal_heads`: only valid without GQA
    (v_proj's output width must equal o_proj's input width)."""

    prev: str
    linears: tuple[str, ...]
    inspect: str
    needs_equal_heads: bool = False


@dataclass(frozen=True)
class ArchSpec:
    # q/k/v always carry a bias (Qwen2) regardless of config.attention_bias
    qkv_bias: bool
    # o_proj carries a bias when config.attention_bias is set (Llama), never for Qwen2
    o_bias_follows_attention_bias: bool
    # GPTQ true-sequential order inside a block: each sub-list is quantized together, its outputs feed the next
    sequential: tuple[tuple[str, ...], ...]
    awq_groups: tuple[ScalingGroup, ...]
    # AWQ clips every Linear's weights except these (q/k feed a softmax through RoPE: clipping them hurts)
    awq_no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.sequential for name in group)


_LLAMA_SEQUENTIAL = (
    ("self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"),
    ("self_attn.o_proj",),
    ("mlp.up_proj", "mlp.gate_proj"),
    ("mlp.down_proj",),
)

_LLAMA_AWQ = (
    ScalingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj", needs_equal_heads=True),
    ScalingGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ScalingGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)

_LLAMA = ArchSpec(qkv_bias=False, o_bias_follows_attention_bias=True, sequential=_LLAMA_SEQUENTIAL,
                  awq_groups=_LLAMA_AWQ)

REGISTRY: dict[str, ArchSpec] = {
    "llama": _LLAMA,  # Llama 2/3/3.1, SmolLM/SmolLM2, TinyLlama
    "mistral": _LLAMA,
    "qwen2": ArchSpec(qkv_bias=True, o_bias_follows_attention_bias=False, sequential=_LLAMA_SEQUENTIAL,
                      awq_groups=_LLAMA_AWQ),
}


def arch_spec(model_type: str) -> ArchSpec:
    try:
        return REGISTRY[model_type]
    except KeyError:
        raise QuantkitError(
            f"model_type {model_type!r} is not supported: quantkit runs {', '.join(sorted(REGISTRY))}"
        ) from None

"""ModelConfig: the validated subset of a Hugging Face config.json that the model definitions read.

`from_hf` parses what every family shares (sizes, RoPE in transformers 4.x `rope_theta`/`rope_scaling` or 5.x
`rope_parameters` form, biases); the family named by `model_type` (quantkit/models/family.py) adds what only it
has (layer types and windows, Gemma's scalars and soft-caps, MoE sizes). A config that cannot run is refused here,
before any weight loads, in one QuantkitError naming the family and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from quantkit.errors import QuantkitError
from quantkit.models.family import family_of
from quantkit.models.layers import ROPE_TYPES, unsupported_rope

SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer types


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
    rope_scaling: Optional[dict] = None  # {"rope_type": one of ROPE_TYPES (layers.py), ...}; None = default
    partial_rotary_factor: float = 1.0  # RoPE turns the first rotary_dim dims of each head, the rest pass (Phi-4-mini)
    nope_layers: tuple[int, ...] = ()  # layers whose attention skips RoPE (SmolLM3's NoPE layers)
    # q times 1 + beta * ln(1 + floor(position / length)) after RoPE: rope_parameters' llama_4_scaling_beta and
    # original_max_position_embeddings (Ministral 3); None: no such scale (1 below `length` in any case)
    query_scale: Optional[tuple[float, int]] = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; () = all full
    sliding_window: Optional[int] = None  # keys a sliding layer's query sees, itself included
    rope_local_theta: Optional[float] = None  # RoPE base of the sliding layers (Gemma 3); None: as the full ones
    query_pre_attn_scalar: Optional[float] = None  # attention scale = scalar ** -0.5 (Gemma); None: head_dim
    attn_logit_softcapping: Optional[float] = None  # Gemma 2
    final_logit_softcapping: Optional[float] = None  # Gemma 2 (and Gemma 3 where set)
    attention_multiplier: Optional[float] = None  # the attention scale itself (Granite); None: from the scalar above
    embedding_multiplier: float = 1.0  # embeddings times it (Granite)
    residual_multiplier: float = 1.0  # each sublayer's output times it before the residual add (Granite)
    logits_scaling: float = 1.0  # logits divided by it (Granite)
    logit_scale: float = 1.0  # logits multiplied by it (Cohere)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's (Qwen MoE; Mixtral's experts use intermediate_size)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (GLM-4.5's: all its shared ones)
    norm_topk_prob: bool = False  # Qwen MoE: renormalise the top-k router weights
    # GLM-4.5's grouped sigmoid routing (models/moe.py GroupedTopKMoE): experts in router_groups groups, the top
    # router_topk_groups groups' experts eligible, the weights times routed_scaling_factor
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    router_norm_min: float = 0.0  # ERNIE 4.5 MoE: the k weights divided by max(their sum, this)
    qk_norm: bool = False  # per-head q/k norms a config turns on (GLM-4.5's use_qk_norm), beside Family.qk_norm
    sparse_layers: tuple[int, ...] = ()  # layers whose MLP is the MoE block

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (transformers' int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def window(self, layer_idx: int) -> Optional[int]:
        """The sliding window of layer `layer_idx`, or None (full causal attention)."""
        is_sliding = bool(self.layer_types) and self.layer_types[layer_idx] == SLIDING
        return self.sliding_window if is_sliding else None

    def rope(self, sliding: bool = False) -> tuple[float, Optional[dict]]:
        """(theta, scaling) of the full-attention layers, or of the sliding ones when they have their own base."""
        if sliding and self.rope_local_theta is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face config.json dict."""
        model_type = hf.get("model_type", "llama")
        family = family_of(model_type)
        where = f"{family.name} ({model_type})"
        heads = need(hf, "num_attention_heads", where)
        rope = rope_parameters(hf)
        partial = float(rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0)
        query_scale = position_query_scale(rope, where)
        own = family.parse(hf, where)  # a family reading its RoPE itself (Hunyuan's alpha) sets rope_theta
        theta, scaling = (None, None) if "rope_theta" in own else parse_rope(rope, hf, where, family.rope_theta)
        attention_bias = bool(hf.get("attention_bias", False))
        fields = dict(
            vocab_size=need(hf, "vocab_size", where),
            hidden_size=need(hf, "hidden_size", where),
            intermediate_size=need(hf, "intermediate_size", where),
            num_hidden_layers=need(hf, "num_hidden_layers", where),
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or need(hf, "hidden_size", where) // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            query_scale=query_scale,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", family.tied),
            model_type=model_type,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
        )
        fields.update(own)
        cfg = cls(**fields)
        if cfg.rotary_dim <= 0 or cfg.rotary_dim % 2:
            raise QuantkitError(f"{where}: partial_rotary_factor {partial} rotates {cfg.rotary_dim} of the "
                                f"{cfg.head_dim} dims of a head: RoPE needs an even number, at least 2")
        return cfg


def class_head_dim(hf: dict, default: int) -> int:
    """head_dim as a config class that declares one (GLM, ERNIE 4.5, Helium: 128) fills it in: config.json's value,
    `default` when the key is absent, hidden_size / num_attention_heads when it is null."""
    return hf.get("head_dim", default) or hf["hidden_size"] // hf["num_attention_heads"]


def need(hf: dict, key: str, where: str):
    """hf[key], or a QuantkitError naming the family and the missing field."""
    value = hf.get(key)
    if value is None:
        raise QuantkitError(f"config.json of this {where} model has no {key!r}: not a checkpoint quantkit can run")
    return value


def rope_parameters(hf: dict) -> dict:
    """The RoPE dict, copied ({} when absent): 5.x `rope_parameters`, updated by a 4.x `rope_scaling` beside it (a
    user adding Qwen's YaRN setting to a config transformers 5 saved). transformers lets rope_scaling win too, but
    drops the rope_parameters it replaces, theta included; here a key rope_scaling does not set keeps its value."""
    scaling = dict(hf.get("rope_scaling") or {})
    if "type" in scaling:  # the 4.x spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    return {**(hf.get("rope_parameters") or {}), **scaling}


def position_query_scale(rope: dict, where: str) -> Optional[tuple[float, int]]:
    """(beta, length) of a RoPE dict's llama_4_scaling_beta (ModelConfig.query_scale), None without one."""
    beta = rope.get("llama_4_scaling_beta")
    if beta is None:
        return None
    length = rope.get("original_max_position_embeddings")
    if not length:
        raise QuantkitError(f"{where}: rope_parameters.llama_4_scaling_beta needs original_max_position_embeddings "
                            f"(the length past which queries are scaled) in rope_parameters")
    return float(beta), int(length)


def parse_rope(rope: dict, hf: dict, where: str, default_theta: float = 10000.0) -> tuple[float, Optional[dict]]:
    """One RoPE dict -> (theta, scaling or None for the default rope). The scaled types get their pretraining length
    and factor filled in as transformers derives them: original_max_position_embeddings from the config's top level
    (Phi-3 keeps it there), else the RoPE dict, else max_position_embeddings; a missing longrope / yarn factor is
    max_position_embeddings over that length."""
    theta = float(rope.pop("rope_theta", None) or hf.get("rope_theta") or default_theta)
    rope.pop("partial_rotary_factor", None)  # ModelConfig.partial_rotary_factor
    rope.pop("llama_4_scaling_beta", None)  # ModelConfig.query_scale
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    kind = "longrope" if kind == "su" else kind
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise QuantkitError(f"{where}: {unsupported_rope(kind)}")
    if kind in ("llama3", "longrope", "yarn"):
        original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") \
            or need(hf, "max_position_embeddings", where)
        rope["original_max_position_embeddings"] = original
    if kind in ("longrope", "yarn") and rope.get("factor") is None:
        rope["factor"] = hf.get("max_position_embeddings", original) / original
    return theta, {**rope, "rope_type": kind}


def per_layer_type_rope(hf: dict, where: str, default_theta: float, local_default: Optional[float]) -> dict:
    """ModelConfig's RoPE fields where the sliding layers run their own unscaled RoPE (Gemma 3, OLMo 3): 5.x
    `rope_parameters` keyed by layer type, or 4.x rope_theta / rope_scaling for the full layers and
    rope_local_base_freq (else `local_default`, else the full layers' theta) for the sliding ones.
    rope_local_theta stays None where the sliding layers' RoPE is the full layers'."""
    rope = rope_parameters(hf)
    if FULL in rope or SLIDING in rope:
        theta, scaling = parse_rope(dict(rope.get(FULL) or {}), hf, where, default_theta)
        local, local_scaling = parse_rope(dict(rope.get(SLIDING) or {}), hf, where, local_default or default_theta)
    else:
        theta, scaling = parse_rope(rope, hf, where, default_theta)
        local, local_scaling = float(hf.get("rope_local_base_freq") or local_default or theta), None
    if local_scaling is not None:
        raise QuantkitError(f"{where}: RoPE scaling on the sliding layers is not supported")
    same = local == theta and scaling is None
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": None if same else local}


def every_nth_full(hf: dict, nth: int) -> list[str]:
    """Per-layer attention types: config.layer_types, else layer i full where (i + 1) % nth == 0 and sliding
    elsewhere (Gemma 2/3, OLMo 3, Cohere 2, EXAONE 4)."""
    return hf.get("layer_types") or [FULL if (i + 1) % nth == 0 else SLIDING for i in range(hf["num_hidden_layers"])]


def windowed(types: list[str], window: Optional[int]) -> dict:
    """ModelConfig fields for per-layer types sharing one window; {} (full attention) without a window."""
    if not window or SLIDING not in types:
        return {}
    return {"layer_types": tuple(types), "sliding_window": int(window)}


def windowed_everywhere(hf: dict, window: Optional[int]) -> dict:
    """Every layer slides over `window` (Mistral, Mixtral, Phi-3 when it is set)."""
    return windowed([SLIDING] * hf["num_hidden_layers"], window)

"""Per-architecture quantization facts as data (never isinstance/string chains in the algorithms).

Module paths are relative to one decoder block (`model.layers.N`). `{e}` stands for every expert of an MoE block
(`ArchSpec.in_block` expands it, and drops the names a block lacks: the dense layers of a Qwen MoE model). The
Linears not named in `sequential` stay float: lm_head, the MoE routers (`gate`: a rounding flip would reroute
tokens) and Qwen2-MoE's `shared_expert_gate`; checkpoints list them as unquantized.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quantkit.errors import QuantkitError

EXPERT = "{e}"


@dataclass(frozen=True)
class ScalingGroup:
    """AWQ: `prev` (an RMSNorm or Linear) feeds every Linear in `linears`; a per-input-channel scale s divides
    `prev`'s output and multiplies the linears' weight columns. `inspect` is the module whose output the search
    compares (the linears' common parent, or the single linear). `needs_equal_heads`: only valid without GQA
    (v_proj's output width must equal o_proj's input width). `source`: the Linear whose input statistics are the
    group's (default linears[0]; an MoE block's router, which sees every token its experts share out).
    `unquantized`: float Linears `prev` also feeds (router, shared-expert gate): their columns are multiplied by s
    too, so they compute the same after the fold."""

    prev: str
    linears: tuple[str, ...]
    inspect: str
    needs_equal_heads: bool = False
    source: str = ""
    unquantized: tuple[str, ...] = ()

    @property
    def stats_of(self) -> str:
        return self.source or self.linears[0]


@dataclass(frozen=True)
class ArchSpec:
    # GPTQ true-sequential order inside a block: each sub-list is quantized together, its outputs feed the next
    sequential: tuple[tuple[str, ...], ...]
    awq_groups: tuple[ScalingGroup, ...]
    # AWQ clips every Linear's weights except these (q/k feed a softmax through RoPE: clipping them hurts)
    awq_no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")
    # MoE: the block's router Linear (its output routes the tokens); its parent module holds `experts`
    router: str = ""

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.sequential for name in group)

    @property
    def experts(self) -> str:
        """The ModuleList of experts ("" without MoE)."""
        return f"{self.router.rpartition('.')[0]}.experts" if self.router else ""

    def in_block(self, block) -> "ArchSpec":
        """This spec for one block (an nn.Module): `{e}` expanded over its experts, and every name, group and
        stage it does not have dropped."""
        present = {name for name, _ in block.named_modules()}
        n = len(block.get_submodule(self.experts)) if self.experts and self.experts in present else 0

        def names(templates: tuple[str, ...]) -> tuple[str, ...]:
            out = [t.replace(EXPERT, str(e)) for t in templates for e in (range(n) if EXPERT in t else [None])]
            return tuple(name for name in out if name in present)

        groups = []
        for g in self.awq_groups:
            for e in range(n) if EXPERT in g.prev else [EXPERT]:  # an up -> down group per expert, else one
                prev, inspect = g.prev.replace(EXPERT, str(e)), g.inspect.replace(EXPERT, str(e))
                linears = names(tuple(t.replace(EXPERT, str(e)) for t in g.linears))
                if linears and prev in present:
                    groups.append(dataclasses.replace(g, prev=prev, linears=linears, inspect=inspect,
                                                      unquantized=names(g.unquantized)))
        sequential = tuple(s for s in (names(stage) for stage in self.sequential) if s)
        router = self.router if self.router in present else ""
        return dataclasses.replace(self, sequential=sequential, awq_groups=tuple(groups), router=router)


_ATTENTION_SEQUENTIAL = (
    ("self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"),
    ("self_attn.o_proj",),
)
_V_TO_O = ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj", needs_equal_heads=True)
_ATTENTION_AWQ = (
    ScalingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    _V_TO_O,
)


def _mlp(path: str, prev: str = "", gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"):
    """(gate/up stage, down stage, AWQ groups) of a gated MLP under `path`; its norm group only when `prev` feeds
    it alone (an MoE block's experts share theirs with the router: _moe_group)."""
    g, u, d = f"{path}.{gate}", f"{path}.{up}", f"{path}.{down}"
    groups = ((ScalingGroup(prev, (g, u), path),) if prev else ()) + (ScalingGroup(u, (d,), d),)
    return (u, g), (d,), groups


def _up_down_mlp(path: str, prev: str):
    """(up stage, down stage, AWQ groups) of an MLP without gate: prev -> up only (act(up) is not linear in up's
    rows, so no up -> down scale folds)."""
    u, d = f"{path}.up_proj", f"{path}.down_proj"
    return (u,), (d,), (ScalingGroup(prev, (u,), u),)


def _moe_group(moe: str, gate: str, up: str, shared: str = "", shared_gate: str = "") -> ScalingGroup:
    """post_attention_layernorm feeds the router and every expert's gate/up (and the shared expert's, with its
    float gate where it has one): one group, its statistics the router's input (all tokens)."""
    linears = (f"{moe}.experts.{EXPERT}.{gate}", f"{moe}.experts.{EXPERT}.{up}")
    unquantized = (f"{moe}.gate",)
    if shared:
        linears += (f"{moe}.{shared}.{gate}", f"{moe}.{shared}.{up}")
    if shared_gate:
        unquantized += (f"{moe}.{shared_gate}",)
    return ScalingGroup("post_attention_layernorm", linears, moe, source=f"{moe}.gate", unquantized=unquantized)


def _spec(*mlps, moe: ScalingGroup | None = None, attention: tuple[ScalingGroup, ...] = _ATTENTION_AWQ) -> ArchSpec:
    """Attention (its AWQ groups: `attention`), then the MLPs' gate/up stages together and their down stages
    together."""
    up_gate = tuple(name for mlp in mlps for name in mlp[0])
    down = tuple(name for mlp in mlps for name in mlp[1])
    groups = attention + ((moe,) if moe else ()) + tuple(g for mlp in mlps for g in mlp[2])
    return ArchSpec(_ATTENTION_SEQUENTIAL + (up_gate, down), groups, router=moe.source if moe else "")


_LLAMA = _spec(_mlp("mlp", "post_attention_layernorm"))
_UP_DOWN = _spec(_up_down_mlp("mlp", "post_attention_layernorm"))
_GEMMA = _spec(_mlp("mlp", "pre_feedforward_layernorm"))  # Gemma's post_attention_layernorm norms the attention out
_OLMO2 = _spec(_mlp("mlp"), attention=(_V_TO_O,))  # post-norm: no norm feeds q/k/v or gate/up (v -> o, up -> down)
_MIXTRAL = _spec(_mlp(f"block_sparse_moe.experts.{EXPERT}", gate="w1", up="w3", down="w2"),
                 moe=_moe_group("block_sparse_moe", "w1", "w3"))
_QWEN_MLPS = (_mlp("mlp", "post_attention_layernorm"), _mlp(f"mlp.experts.{EXPERT}"))  # dense layers, experts
_QWEN3_MOE = _spec(*_QWEN_MLPS, moe=_moe_group("mlp", "gate_proj", "up_proj"))
_QWEN2_MOE = _spec(*_QWEN_MLPS, _mlp("mlp.shared_expert"), moe=_moe_group("mlp", "gate_proj", "up_proj",
                                                                           "shared_expert", "shared_expert_gate"))
_GLM4_MOE = _spec(*_QWEN_MLPS, _mlp("mlp.shared_experts"), moe=_moe_group("mlp", "gate_proj", "up_proj",
                                                                          "shared_experts"))

REGISTRY: dict[str, ArchSpec] = {
    "llama": _LLAMA,  # Llama 2/3/3.1, SmolLM/SmolLM2, TinyLlama
    "smollm3": _LLAMA,
    "gemma": _LLAMA,  # pre-norm: its (1 + w) norms fold like Gemma 2's (quant/awq.py, weight_offset)
    "mistral": _LLAMA,
    "ministral": _LLAMA,
    "ministral3": _LLAMA,  # its query scale acts after RoPE, on no Linear's input
    "seed_oss": _LLAMA,  # its o_proj bias (attention_out_bias) is folded like any Linear's bias
    "granite": _LLAMA,  # its multipliers scale sublayer outputs, embeddings and logits, never a Linear's input
    "olmo2": _OLMO2,
    "olmo3": _OLMO2,
    "cohere": _OLMO2,  # parallel block: input_layernorm feeds attention and MLP both, so only v -> o, up -> down scale
    "cohere2": _OLMO2,
    "exaone4": _OLMO2,  # post-norm like OLMo 2; its per-head q/k norms are not Linears
    "hunyuan_v1_dense": _LLAMA,  # its q/k norms (after RoPE) are not Linears
    "helium": _LLAMA,  # its interleaved RoPE is a q/k row order fixed at load: GPTQ rows and AWQ scales ignore it
    "ernie4_5": _LLAMA,
    "glm": _LLAMA,  # after the load-time split of gate_up_proj (models/keys.py)
    "glm4": _LLAMA,  # post_attention_layernorm is its MLP's input norm, as in Llama; the post-sublayer norms feed none
    "qwen2": _LLAMA,
    "starcoder2": _UP_DOWN,  # c_fc / c_proj renamed up_proj / down_proj at load; LayerNorm biases fold like Linears
    "nemotron": _UP_DOWN,  # its LayerNorm1P's (1 + w) folds like Gemma's
    "arcee": _UP_DOWN,
    "qwen3": _LLAMA,  # q_norm / k_norm are not Linears
    "phi3": _LLAMA,  # after the load-time split of qkv_proj / gate_up_proj (models/keys.py)
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
    "mixtral": _MIXTRAL,
    "qwen2_moe": _QWEN2_MOE,  # dense layers (mlp_only_layers, decoder_sparse_step) keep mlp.{gate,up,down}_proj
    "qwen3_moe": _QWEN3_MOE,
    "glm4_moe": _GLM4_MOE,  # dense first layers, routed experts and the always-on shared ones; router kept float
    "ernie4_5_moe": _GLM4_MOE,  # the same names (mlp.gate, mlp.experts, mlp.shared_experts), dense layers too
    "hunyuan_v1_moe": _GLM4_MOE,  # its shared_mlp renamed shared_experts at load, its router mlp.gate.wg mlp.gate
    "olmoe": _QWEN3_MOE,  # the same names: mlp.gate, mlp.experts.{e}.{gate,up,down}_proj; its q/k norms feed no Linear
}


def arch_spec(model_type: str) -> ArchSpec:
    try:
        return REGISTRY[model_type]
    except KeyError:
        raise QuantkitError(
            f"model_type {model_type!r} is not supported: quantkit runs {', '.join(sorted(REGISTRY))}"
        ) from None

"""How tensor parallelism over N devices splits each parameter, and which configs it can split: the one rule that
`quantkit plan --tensor-parallel-size` and TP serving both apply.

The Megatron / vLLM split of a decoder (vLLM's linear.py, vocab_parallel_embedding.py):
- column-parallel Linears (q_proj, gate_proj, up_proj; Mixtral's w1, w3; every expert's and the shared expert's):
  out features split N ways, a bias with them; each device's output is its slice, fed to the row-parallel Linear
- k_proj, v_proj: split by KV head; with num_kv_heads < N each device holds one whole head and each head sits on
  N / num_kv_heads devices (vLLM QKVParallelLinear: num_kv_heads = 1, num_kv_head_replicas = N / total)
- row-parallel Linears (o_proj, down_proj; Mixtral's w2): in features split, outputs all-reduced; a bias is not
  split (every device holds it, it is added once after the reduce)
- embed_tokens, lm_head: vocabulary-parallel, rows split N ways (vLLM pads the vocabulary to a multiple of 64 N
  instead; quantkit splits evenly and so needs vocab_size % N == 0)
- everything else is replicated: the norms (q/k norms too, over head_dim), the MoE router `gate`, Qwen2-MoE's
  `shared_expert_gate`
A q/k norm over the whole projection (OLMo 2) needs every device's heads for each token's norm: refused.
"""

from __future__ import annotations

from typing import Optional

from quantkit.errors import QuantkitError
from quantkit.models.family import family_of

COLUMN = frozenset({"q_proj", "gate_proj", "up_proj", "w1", "w3"})  # [N, K] -> [N / tp, K]
KV = frozenset({"k_proj", "v_proj"})  # [kv_heads * D, K] -> [kv_heads_per_device * D, K]
ROW = frozenset({"o_proj", "down_proj", "w2"})  # [N, K] -> [N, K / tp]
VOCAB = frozenset({"embed_tokens", "lm_head"})  # [V, H] -> [V / tp, H]


def split_kind(param: str) -> str:
    """"column" | "kv" | "row" | "vocab" | "replicated" for a parameter name (`model.layers.0.mlp.up_proj.weight`);
    a row-parallel Linear's bias is replicated."""
    module, _, leaf = param.rpartition(".")
    name = module.rpartition(".")[2]
    if name in ROW:
        return "row" if leaf == "weight" else "replicated"
    for kind, names in (("column", COLUMN), ("kv", KV), ("vocab", VOCAB)):
        if name in names:
            return kind
    return "replicated"


def kv_heads_per_device(kv_heads: int, tp: int) -> int:
    """KV heads each device holds (and caches): kv_heads / tp, or 1 when there are fewer heads than devices."""
    return max(kv_heads // tp, 1)


def device_shape(param: str, shape: tuple[int, ...], cfg, tp: int) -> tuple[int, ...]:
    """The shape of `param` (full `shape`) on one of `tp` devices; cfg: a ModelConfig that check_tensor_parallel
    accepted for tp."""
    kind = split_kind(param)
    if tp == 1 or kind == "replicated":
        return shape
    if kind == "row":
        return (shape[0], shape[1] // tp)
    if kind == "kv":
        return (kv_heads_per_device(cfg.num_key_value_heads, tp) * cfg.head_dim, *shape[1:])
    return (shape[0] // tp, *shape[1:])  # column, vocab


def check_tensor_parallel(cfg, tp: int, group_size: Optional[int] = None) -> None:
    """Refuse, in one QuantkitError naming every config.json field at fault, a split the layers above cannot make:
    num_attention_heads, intermediate_size (and the MoE expert / shared-expert sizes) and vocab_size must divide by
    tp; num_key_value_heads must divide by tp or divide tp. With a quantization `group_size`, each device's slice
    of a row-parallel input (o_proj: heads x head_dim / tp, down_proj: intermediate / tp) must hold whole groups
    (vLLM's GPTQ/AWQ create_weights: "input size is not aligned with the quantized weight shape"). A family whose
    q/k norms span all heads (OLMo 2) is refused."""
    if tp < 1:
        raise QuantkitError(f"--tensor-parallel-size {tp}: must be at least 1")
    if tp == 1:
        return
    family = family_of(cfg.model_type)
    if family.qk_norm_whole:
        raise QuantkitError(f"--tensor-parallel-size {tp}: {family.name} ({cfg.model_type}) normalises q and k over "
                            f"all heads at once (q_norm / k_norm num_attention_heads x head_dim wide), which no "
                            f"device's share of the heads can compute: run it with tensor parallel size 1")
    problems = []
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % tp:
        problems.append(f"num_attention_heads={heads} is not divisible by {tp}")
    if (kv % tp) if kv >= tp else (tp % kv):
        problems.append(f"num_key_value_heads={kv} neither divides by {tp} nor divides it")
    row_inputs = {"num_attention_heads x head_dim": heads * cfg.head_dim}
    for field in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "vocab_size"):
        width = getattr(cfg, field)
        if width and width % tp:
            problems.append(f"{field}={width} is not divisible by {tp}")
        elif width and field != "vocab_size":
            row_inputs[field] = width
    if group_size is not None and group_size != -1:
        for field, width in row_inputs.items():
            if width % tp == 0 and (width // tp) % group_size:
                problems.append(f"{field}={width} / {tp} = {width // tp} columns per device is not a multiple of "
                                f"group size {group_size}")
    if problems:
        raise QuantkitError(f"--tensor-parallel-size {tp} cannot split this model (config.json): "
                            + "; ".join(problems))

"""`quantkit plan`: size a deployment before launch, from the model's config.json and a card's datasheet.

Weights: every parameter of the model quantkit builds for the config, its family's own definition built on the meta
device (shapes only): MoE experts, tied heads, q/k norms and biases counted as the model holds them. Quantized
(w8/w4) are the decoder Linears the family registry names (never the MoE router or lm_head): codes at bits/8 bytes
each, plus per group of `group_size` input columns one fp16 scale and one zero packed at `bits` (the GPTQ layout;
G = ceil(K / g)); embeddings, norms, biases and an untied lm_head stay fp16. `naive_bytes` is the back-of-envelope
figure, every parameter at bits/8.
Tensor parallelism over N cards: each parameter at its one-device shape (quantkit/models/tensor_parallel.py, the
rule TP serving applies); memory, KV capacity and the roofline are one card's, the KV heads per card kv_heads / N
(at least 1). All-reduce time is not modelled.
KV: the engine's own functions (quantkit.serve.capacity), so plan and `quantkit serve` agree for the same budget.
Roofline decode step at batch b, context c, on one card: time = max(bytes / bandwidth, flops / peak) with
bytes = weights + b * c * KV bytes per token, flops = b * (2 * matmul params + 4 * layers * q_heads * head_dim * c);
matmul params count an MoE expert's weights at top_k / experts (the share of tokens routed to it), and the weight
bytes count the routed experts at the share a step of b tokens routes to under uniform routing (models/moe.py's
routed_share: top_k of them at b = 1, nearly all at large b).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import init
from torch.overrides import TorchFunctionMode

from quantkit.errors import QuantkitError
from quantkit.models import CausalLM, ModelConfig
from quantkit.models.moe import routed_share
from quantkit.models.registry import arch_spec
from quantkit.models.tensor_parallel import check_tensor_parallel, device_shape, kv_heads_per_device
from quantkit.serve.capacity import kv_bytes_per_token, num_kv_blocks

GB = 1e9
QUANT_BITS = {"fp16": 16, "w8": 8, "w4": 4}
KV_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gb: float  # the datasheet figure, decimal GB
    bandwidth_gbs: float  # HBM/GDDR bandwidth, GB/s
    tflops: float  # dense FP16/BF16 tensor-core peak (no sparsity), TFLOP/s


# Vendor datasheet figures (SXM parts for H100/A100; A10G as AWS quotes it).
GPUS = {
    g.name: g
    for g in (
        Gpu("h100-80gb", 80, 3350, 989),
        Gpu("h200", 141, 4800, 989),
        Gpu("a100-80gb", 80, 2039, 312),
        Gpu("a100-40gb", 40, 1555, 312),
        Gpu("l4", 24, 300, 121),
        Gpu("a10g", 24, 600, 70),
        Gpu("rtx-4090", 24, 1008, 165),
    )
}


DEFAULT_GPU = "h100-80gb"  # the card a plan is made for when none is named (the most common serving card)


def gpu_from_args(name: Optional[str], memory_gb: Optional[float], bandwidth_gbs: Optional[float],
                  tflops: Optional[float]) -> Gpu:
    """A card from the table, with any of the three figures overridden; or a custom card from all three; with
    nothing given, the DEFAULT_GPU."""
    if name is None and memory_gb is None and bandwidth_gbs is None and tflops is None:
        name = DEFAULT_GPU
    if name is not None:
        if name not in GPUS:
            raise QuantkitError(f"--gpu {name}: unknown card; use one of {', '.join(GPUS)} or --memory-gb/--bandwidth-gbs/--tflops")
        base = GPUS[name]
        return Gpu(name, memory_gb or base.memory_gb, bandwidth_gbs or base.bandwidth_gbs, tflops or base.tflops)
    if memory_gb is None or bandwidth_gbs is None or tflops is None:
        raise QuantkitError("name a card with --gpu (e.g. h100-80gb) or give all of --memory-gb, --bandwidth-gbs, --tflops")
    return Gpu("custom", memory_gb, bandwidth_gbs, tflops)


def quant_of_folder(hf_config: dict) -> tuple[str, int]:
    """("fp16" | "w8" | "w4", group size) from config.json's quantization_config (GPTQ/AWQ `bits`/`group_size`,
    compressed-tensors `config_groups.*.weights.num_bits`/`group_size`); ("fp16", 128) for a float folder."""
    qc = hf_config.get("quantization_config") or {}
    weights = next(iter((qc.get("config_groups") or {}).values()), {}).get("weights") or qc
    bits = weights.get("bits") or weights.get("num_bits")
    group = -1 if weights.get("strategy") == "channel" else weights.get("group_size") or 128
    if bits is None:
        return "fp16", 128
    if f"w{bits}" not in QUANT_BITS:
        raise QuantkitError(f"config.json quantization_config: {bits}-bit weights are not planned; use --quant fp16|w8|w4")
    return f"w{bits}", group


@dataclass(frozen=True)
class Param:
    name: str  # the state-dict name (HF's)
    shape: tuple[int, ...]  # the whole model's
    quantized: bool  # a decoder Linear weight that w8/w4 quantize
    # share of the tokens multiplying it: 1 (a Linear), top_k / experts (an expert's), 0 (lookups, norms, biases)
    matmul_share: float


class _SkipInit(TorchFunctionMode):
    """torch.nn.init's in-place initialisers return their tensor untouched (the shapes are all a plan needs; on the
    meta device the random ones would first import torch._dynamo, seconds)."""

    SKIPPED = {init.normal_, init.uniform_, init.trunc_normal_, init.kaiming_uniform_, init.kaiming_normal_,
               init.xavier_uniform_, init.xavier_normal_, init.zeros_, init.ones_, init.constant_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SKIPPED:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def _is_expert(name: str) -> bool:
    """Whether a parameter is a routed MoE expert's (not a shared expert's: those have no `.experts.`)."""
    return ".experts." in name


def model_params(cfg: ModelConfig) -> list[Param]:
    """Every parameter and persistent buffer (a router's score correction bias) of the model quantkit builds for cfg
    (on the meta device: no memory, no init), a tied lm_head once (as the embedding, which then also multiplies
    every token)."""
    with torch.device("meta"), _SkipInit():
        model = CausalLM(cfg)
    spec = arch_spec(cfg.model_type)
    quantized = {f"model.layers.{i}.{name}.weight" for i, block in enumerate(model.model.layers)
                 for name in spec.in_block(block).linears}
    matmuls = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if cfg.tie_word_embeddings:
        matmuls.add("model.embed_tokens.weight")
    expert_share = cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 1.0
    buffers = [(name, b) for name, b in model.state_dict(keep_vars=True).items() if not isinstance(b, nn.Parameter)]
    return [Param(name, tuple(p.shape), name in quantized,
                  (expert_share if _is_expert(name) else 1.0) if name in matmuls else 0.0)
            for name, p in [*model.named_parameters(), *buffers]]


@dataclass(frozen=True)
class WeightBytes:
    params: int  # every parameter of the model
    quantized_params: int  # decoder Linear weights (the ones w8/w4 quantize)
    bits: int
    group_size: int
    naive_bytes: int  # params * bits / 8
    stored_bytes: int  # codes + group scales/zeros + the rest at fp16 (what a checkpoint holds)
    device_bytes: int  # what one of the tensor-parallel cards holds (= stored_bytes on one card)
    device_matmul_params: int  # weights one card multiplies per generated token (sum of shape x matmul_share)
    device_expert_bytes: int  # of device_bytes, the routed MoE experts' (0 for a dense model)


def _stored_bytes(shapes: list[tuple[tuple[int, ...], bool]], bits: int, group_size: int) -> int:
    """Bytes of (shape, quantized) tensors: quantized [N, K] at `bits` per code plus per group one fp16 scale and
    one zero at `bits`; the rest at fp16."""
    packed_bits = scale_bytes = 0
    for shape, quantized in shapes:
        if quantized and bits < 16:
            n, k = shape
            groups = n * (1 if group_size == -1 else math.ceil(k / group_size))
            packed_bits += (n * k + groups) * bits
            scale_bytes += 2 * groups
        else:
            scale_bytes += 2 * math.prod(shape)
    return packed_bits // 8 + scale_bytes


def weight_bytes(cfg: ModelConfig, quant: str = "fp16", group_size: int = 128, tensor_parallel_size: int = 1
                 ) -> WeightBytes:
    if quant not in QUANT_BITS:
        raise QuantkitError(f"--quant {quant}: use one of {', '.join(QUANT_BITS)}")
    bits, tp = QUANT_BITS[quant], tensor_parallel_size
    check_tensor_parallel(cfg, tp, group_size if bits < 16 else None)
    params = model_params(cfg)
    on_device = [device_shape(p.name, p.shape, cfg, tp) for p in params]
    total = sum(math.prod(p.shape) for p in params)
    return WeightBytes(
        params=total,
        quantized_params=sum(math.prod(p.shape) for p in params if p.quantized),
        bits=bits,
        group_size=group_size,
        naive_bytes=total * bits // 8,
        stored_bytes=_stored_bytes([(p.shape, p.quantized) for p in params], bits, group_size),
        device_bytes=_stored_bytes([(shape, p.quantized) for shape, p in zip(on_device, params)], bits, group_size),
        device_matmul_params=round(sum(math.prod(shape) * p.matmul_share for shape, p in zip(on_device, params))),
        device_expert_bytes=_stored_bytes([(shape, p.quantized) for shape, p in zip(on_device, params)
                                           if _is_expert(p.name)], bits, group_size),
    )


def step_weight_bytes(w: WeightBytes, cfg: ModelConfig, batch: int) -> int:
    """Bytes of weights one card reads in a decode step of `batch` tokens: device_bytes, the routed experts at
    routed_share."""
    if not cfg.num_experts:
        return w.device_bytes
    unread = 1 - routed_share(cfg.num_experts_per_tok, cfg.num_experts, batch)
    return w.device_bytes - round(w.device_expert_bytes * unread)


def activation_bytes(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int = 2,
                     tensor_parallel_size: int = 1) -> int:
    """Estimate of one card's live activations for one scheduler step (the engine measures its own): per batched
    token the residual, normed input, q, k/v, attention output and gate/up/act, 4H + 2 * kv_heads * D + 3I values
    with kv_heads and I per card (q and the attention output kept at H: an upper bound under tensor parallelism),
    plus fp32 logits for up to max_num_seqs sampled rows (gathered whole on the first card)."""
    tp = tensor_parallel_size
    kv = kv_heads_per_device(cfg.num_key_value_heads, tp)
    per_token = 4 * cfg.hidden_size + 2 * kv * cfg.head_dim + 3 * cfg.intermediate_size // tp
    return max_num_batched_tokens * per_token * dtype_bytes + max_num_seqs * cfg.vocab_size * 4


def max_concurrency(num_blocks: int, block_size: int, seq_len: int) -> int:
    """Sequences of `seq_len` tokens that fit at once (each holds ceil(seq_len / block_size) whole blocks)."""
    return num_blocks // math.ceil(seq_len / block_size) if seq_len > 0 else 0


def roofline_step_s(weights: int, kv_per_token: int, matmul_params: int, attention_width: int, gpu: Gpu, batch: int,
                    context: float) -> float:
    """Seconds per decode step on one card for `batch` sequences of mean `context` tokens: the slower of memory and
    compute. Per card: `weights` bytes, `kv_per_token` bytes, `matmul_params` multiplied per token, attention_width
    = layers x query heads x head_dim (q.k and p.v: 4 flops per width per context token)."""
    memory_s = (weights + batch * context * kv_per_token) / (gpu.bandwidth_gbs * GB)
    flops = batch * (2 * matmul_params + 4 * attention_width * context)
    return max(memory_s, flops / (gpu.tflops * 1e12))


def cost_per_million(price_per_hour: float, tokens_per_s: float) -> float:
    return price_per_hour / 3600 / tokens_per_s * 1e6 if tokens_per_s > 0 else math.inf


def batch_sizes(limit: int) -> list[int]:
    """1, 2, 4, ... below `limit`, then `limit` itself."""
    sizes, b = [], 1
    while b < limit:
        sizes.append(b)
        b *= 2
    return sizes + [limit] if limit >= 1 else []


def make_plan(
    cfg: ModelConfig,
    gpu: Gpu,
    quant: str = "fp16",
    group_size: int = 128,
    max_model_len: Optional[int] = None,
    memory_fraction: float = 0.9,
    block_size: int = 16,
    kv_cache_dtype: str = "fp16",
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 128,
    activation_gb: Optional[float] = None,
    kv_cache_bytes: Optional[int] = None,
    workload: Optional[tuple[str, list[tuple[int, int]]]] = None,
    price_per_hour: Optional[float] = None,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """The plan as a dict (all sizes in bytes, one card's: weights, KV per token, budget, blocks; the whole model's
    only in model_weights_bytes and weights_naive_bytes). `workload` = (name, [(prompt tokens, output tokens), ...]).
    kv_cache_bytes: a fixed KV pool per card (as the engine's kv_cache_memory) instead of memory - weights -
    activations. price_per_hour: of one card (the deployment costs tensor_parallel_size times it)."""
    if not 0 < memory_fraction <= 1:
        raise QuantkitError(f"--memory-fraction {memory_fraction}: must be in (0, 1]")
    if kv_cache_dtype not in KV_DTYPE_BYTES:
        raise QuantkitError(f"--kv-cache-dtype {kv_cache_dtype}: use one of {', '.join(KV_DTYPE_BYTES)}")
    max_len = max_model_len or cfg.max_position_embeddings
    tp = tensor_parallel_size
    w = weight_bytes(cfg, quant, group_size, tp)
    kv_tok = kv_bytes_per_token(cfg, KV_DTYPE_BYTES[kv_cache_dtype], tp)
    act = round(activation_gb * GB) if activation_gb is not None else activation_bytes(
        cfg, max_num_batched_tokens, max_num_seqs, tensor_parallel_size=tp)
    usable = round(gpu.memory_gb * GB * memory_fraction)
    kv_budget = kv_cache_bytes if kv_cache_bytes is not None else usable - w.device_bytes - act
    blocks = num_kv_blocks(kv_budget, block_size, kv_tok)
    plan: dict[str, Any] = {
        "gpu": vars(gpu),
        "tensor_parallel_size": tp,
        "quant": quant,
        "group_size": group_size if quant != "fp16" else None,
        "params": w.params,
        "quantized_params": w.quantized_params,
        "weights_naive_bytes": w.naive_bytes,
        "model_weights_bytes": w.stored_bytes,
        "weights_bytes": w.device_bytes,
        "num_key_value_heads": cfg.num_key_value_heads,
        "kv_heads_per_device": kv_heads_per_device(cfg.num_key_value_heads, tp),
        "kv_bytes_per_token": kv_tok,
        "usable_bytes": usable,
        "memory_fraction": memory_fraction,
        "activation_bytes": act,
        "kv_budget_bytes": kv_budget,
        "kv_budget_fixed": kv_cache_bytes is not None,
        "block_size": block_size,
        "kv_blocks": blocks,
        "kv_tokens": blocks * block_size,
        "max_model_len": max_len,
        "kv_bytes_per_seq_at_max_len": kv_tok * max_len,
        "max_concurrency_at_max_len": max_concurrency(blocks, block_size, max_len),
    }
    context = float(max_len)
    limit = plan["max_concurrency_at_max_len"]
    if workload is not None:
        name, lengths = workload
        if not lengths:
            raise QuantkitError(f"workload {name!r} has no requests")
        mean_total = sum(p + o for p, o in lengths) / len(lengths)
        context = sum(p + o / 2 for p, o in lengths) / len(lengths)  # mean context over a request's decode steps
        limit = max_concurrency(blocks, block_size, math.ceil(mean_total))
        plan["workload"] = {
            "name": name,
            "requests": len(lengths),
            "mean_prompt_tokens": sum(p for p, _ in lengths) / len(lengths),
            "mean_output_tokens": sum(o for _, o in lengths) / len(lengths),
            "mean_total_tokens": mean_total,
            "max_concurrency_at_mean_len": limit,
        }
    plan["decode_context_tokens"] = context
    rows = []
    attention_width = cfg.num_hidden_layers * cfg.num_attention_heads // tp * cfg.head_dim
    for b in batch_sizes(min(limit, max_num_seqs)):
        step = roofline_step_s(step_weight_bytes(w, cfg, b), kv_tok, w.device_matmul_params, attention_width, gpu, b,
                               context)
        row = {"batch": b, "step_ms": step * 1000, "per_user_tps": 1 / step, "aggregate_tps": b / step}
        if price_per_hour is not None:
            row["usd_per_million_tokens"] = cost_per_million(price_per_hour * tp, b / step)
        rows.append(row)
    plan["roofline"] = rows
    plan["price_per_hour"] = price_per_hour
    return plan


def format_plan(plan: dict[str, Any], model_name: str) -> str:
    gpu, tp = plan["gpu"], plan["tensor_parallel_size"]
    per = " per card" if tp > 1 else ""
    gb = lambda n: f"{n / GB:.2f} GB"  # noqa: E731
    quant = plan["quant"] + (f" (group {plan['group_size']})" if plan["group_size"] else "")
    kv, kv_card = plan["num_key_value_heads"], plan["kv_heads_per_device"]
    heads = "" if tp == 1 else f"; {kv_card} of {kv} KV heads per card" + (
        f", each head on {tp // kv} cards" if kv < tp else "")
    cards, each = (f" x {tp}, tensor parallel", " each") if tp > 1 else ("", "")
    weights = gb(plan["weights_bytes"]) + (f" per card, {gb(plan['model_weights_bytes'])} in all" if tp > 1 else "")
    lines = [
        f"model {model_name}: {plan['params'] / 1e9:.3f} B parameters ({plan['quantized_params'] / 1e9:.3f} B in quantizable Linears)",
        f"card {gpu['name']}{cards}: {gpu['memory_gb']:g} GB, {gpu['bandwidth_gbs']:g} GB/s, {gpu['tflops']:g} TFLOP/s{each}",
        f"weights {quant}: {weights} as stored (every parameter at bits/8 would be {gb(plan['weights_naive_bytes'])})",
        f"KV cache per token{per}: {plan['kv_bytes_per_token']} bytes ({plan['kv_bytes_per_token'] / 1e6:.3f} MB{heads})",
        f"KV pool fixed at {gb(plan['kv_budget_bytes'])}{per} (--kv-cache-gb)" if plan["kv_budget_fixed"] else
        f"memory{per}: {gb(plan['usable_bytes'])} usable at fraction {plan['memory_fraction']:g} - weights "
        f"- {gb(plan['activation_bytes'])} activations = {gb(plan['kv_budget_bytes'])} for KV",
        f"KV capacity{per}: {plan['kv_blocks']} blocks of {plan['block_size']} = {plan['kv_tokens']} tokens",
        f"KV of one sequence at max_model_len {plan['max_model_len']}: {gb(plan['kv_bytes_per_seq_at_max_len'])}{per}; "
        f"max concurrency there: {plan['max_concurrency_at_max_len']}",
    ]
    if "workload" in plan:
        wl = plan["workload"]
        lines.append(
            f"workload {wl['name']} ({wl['requests']} requests): mean {wl['mean_prompt_tokens']:.0f} prompt + "
            f"{wl['mean_output_tokens']:.0f} output tokens; max concurrency at its mean length "
            f"{wl['mean_total_tokens']:.0f}: {wl['max_concurrency_at_mean_len']}"
        )
    if plan["kv_budget_bytes"] <= 0:
        lines.append("does not fit: weights and activations exceed the usable memory (quantize, a bigger card, or "
                     "more cards with --tensor-parallel-size)")
        return "\n".join(lines)
    price = plan["price_per_hour"]
    lines.append(f"roofline decode at mean context {plan['decode_context_tokens']:.0f} tokens"
                 + (f", at ${price:g}/hour" + (f" per card x {tp}" if tp > 1 else "") if price is not None else "")
                 + (" (one card's share; all-reduce time not modelled)" if tp > 1 else "") + ":")
    header = f"{'batch':>6} {'step ms':>9} {'tok/s/user':>11} {'tok/s total':>12}" + ("  $/M tokens" if price is not None else "")
    lines.append(header)
    for r in plan["roofline"]:
        line = f"{r['batch']:>6} {r['step_ms']:>9.2f} {r['per_user_tps']:>11.1f} {r['aggregate_tps']:>12.1f}"
        if price is not None:
            line += f"  {r['usd_per_million_tokens']:>11.3f}"
        lines.append(line)
    return "\n".join(lines)

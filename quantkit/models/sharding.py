"""Tensor parallelism applied to a loaded model: `shard_model(model, comm)` keeps, in place, worker comm.rank's share of
every parameter (the split of quantkit/models/tensor_parallel.py, whose check_tensor_parallel says which models
split) and wraps the layers whose outputs the workers combine:

  q/k/v_proj, gate/up_proj   column-parallel: rank r keeps the rows of its query heads [r Hq/N, (r+1) Hq/N), of the
                             KV heads they read (num_kv_heads < N: the one head, replicated on N / num_kv_heads
                             ranks), of its intermediate channels [r I/N, (r+1) I/N); biases with them
  o_proj, down_proj          RowParallelLinear over the matching input columns: all_reduce(x_r @ W_r^T) + bias,
                             the bias added once, after the reduce (a gate-less MLP's up_proj is column-parallel)
  MoE blocks                 every expert's and the shared experts' MLPs split as above, but their down_proj a bare
                             part: the block's output (routed sum plus shared, each a sum over the ranks' channel
                             shares) is all-reduced once, by AllReduced around the block; the router is replicated,
                             so every rank routes every token alike
  embed_tokens               VocabParallelEmbedding: rows [r V/N, (r+1) V/N); ids elsewhere look up 0; all_reduce
  lm_head                    VocabParallelHead: the same rows (tied: the same tensor); logits gathered to rank 0
Quantized layers are sliced by quantkit/quant/shard.py (output channels; whole groups of input channels, act-order
g_idx handled). The model's config becomes the shard's (its heads, KV heads, intermediate size; vocab_size stays the
whole vocabulary, which rank 0's logits span), so whatever sizes itself from model.config (the serving runner's KV
pool) sizes the shard. The dense and the paged forward both run sharded, every rank calling the same forward with
the same inputs. `comm` carries the collectives (serve/tp_group.py: torch.distributed); the model code never
imports torch.distributed.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.models.attention import Attention
from quantkit.models.layers import GatedMLP, UpDownMLP
from quantkit.models.moe import MoE
from quantkit.models.tensor_parallel import check_tensor_parallel, kv_heads_per_device
from quantkit.quant import shard as qshard
from quantkit.quant.qlinear import QLinear


class Collectives(Protocol):
    rank: int
    world: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, on every rank (x may be reduced in place)."""

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] of every rank -> [..., world * n] in rank order on rank 0; x itself on the others."""


def check_shardable(cfg, world: int, group_size: Optional[int] = None) -> None:
    """QuantkitError, before any weight loads, for a model that `world` workers cannot split (cfg: ModelConfig;
    group_size: the checkpoint's quantization group size, or None)."""
    check_tensor_parallel(cfg, world, group_size)


class RowParallelLinear(nn.Module):
    """A row-parallel layer's share: x [..., K/N] (this rank's columns) -> all_reduce(part(x)) + bias [..., N]."""

    def __init__(self, part: nn.Module, bias: Optional[torch.Tensor], comm: Collectives):
        super().__init__()
        self.part = part  # nn.Linear or QLinear without bias (serving may swap in a packed Linear)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(self.part(x))
        return y if self.bias is None else y + self.bias.to(y.dtype)


class AllReduced(nn.Module):
    """A MoE block whose experts' down projections are bare row-parallel parts: x -> all_reduce(block(x))."""

    def __init__(self, block: nn.Module, comm: Collectives):
        super().__init__()
        self.block = block
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.block(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V/N) of the embedding: ids [...] -> [..., H], each id's row from the rank holding it."""

    def __init__(self, weight: torch.Tensor, start: int, comm: Collectives):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V/N, H]
        self.start = start
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))  # one non-zero term per id: exact


class VocabParallelHead(nn.Module):
    """hidden [..., H] -> logits [..., V] on rank 0 (this rank's [..., V/N] elsewhere)."""

    def __init__(self, part: nn.Module, comm: Collectives):
        super().__init__()
        self.part = part  # nn.Linear [V/N, H] (tied: sharing VocabParallelEmbedding's weight) or QLinear
        self.comm = comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.comm.gather(self.part(hidden))


def _linear(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> nn.Linear:
    """An nn.Linear owning copies of weight [n, k] and bias [n] (so the full tensors they were cut from can go)."""
    with torch.device("meta"):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight.clone(memory_format=torch.contiguous_format), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.clone(), requires_grad=False)
    return layer


def take_rows(layer: nn.Module, lo: int, count: int, name: str) -> nn.Module:
    """Output channels [lo, lo + count) of an nn.Linear or QLinear (and its bias), as a layer of the same kind."""
    bias = None if layer.bias is None else layer.bias.detach()[lo : lo + count]
    if isinstance(layer, QLinear):
        index = torch.arange(lo, lo + count, device=layer.qweight.device)
        return QLinear.from_qtensor(qshard.rows(layer.qtensor(), index), None if bias is None else bias.clone())
    if type(layer) is nn.Linear:
        return _linear(layer.weight.detach()[lo : lo + count], bias)
    raise QuantkitError(f"{name}: a {type(layer).__name__} cannot be split for tensor parallelism")


def take_columns(layer: nn.Module, lo: int, hi: int, name: str) -> tuple[nn.Module, Optional[torch.Tensor]]:
    """Input channels [lo, hi) of an nn.Linear or QLinear, without bias -> (part, the full bias or None)."""
    bias = None if layer.bias is None else layer.bias.detach().clone()
    if isinstance(layer, QLinear):
        return QLinear.from_qtensor(qshard.columns(layer.qtensor(), lo, hi, name)), bias
    if type(layer) is nn.Linear:
        return _linear(layer.weight.detach()[:, lo:hi], None), bias
    raise QuantkitError(f"{name}: a {type(layer).__name__} cannot be split for tensor parallelism")


def _replace(module: nn.Module, role: str, new: nn.Module) -> None:
    """Set the child that module.<role> names (MLP's gate_proj, or Mixtral's w1 behind its gate_proj property)."""
    current = getattr(module, role)
    setattr(module, next(name for name, child in module.named_children() if child is current), new)


def shard_mlp(mlp: nn.Module, r: int, n: int, where: str, comm: Optional[Collectives]) -> None:
    """Keep rank r's share of a gated or gate-less MLP's intermediate channels: gate/up (up) column-parallel, down
    a RowParallelLinear over comm, or (comm None: a MoE block's MLP, reduced with the block) its bare part."""
    width = mlp.down_proj.in_features
    if width % n:
        raise QuantkitError(f"{where}: {width} intermediate channels do not split over {n} devices")
    share = width // n
    for role in ("gate_proj", "up_proj") if isinstance(mlp, GatedMLP) else ("up_proj",):
        _replace(mlp, role, take_rows(getattr(mlp, role), r * share, share, f"{where}.{role}"))
    part, bias = take_columns(mlp.down_proj, r * share, (r + 1) * share, f"{where}.down_proj")
    if comm is None and bias is not None:
        raise QuantkitError(f"{where}.down_proj: a biased expert cannot be split for tensor parallelism")
    _replace(mlp, "down_proj", part if comm is None else RowParallelLinear(part, bias, comm))


def shard_model(model: nn.Module, comm: Collectives) -> None:
    """Keep rank comm.rank's share of `model` (a CausalLM, weights loaded) in place; refuses what check_shardable
    refuses."""
    cfg, n, r = model.config, comm.world, comm.rank
    check_shardable(cfg, n)
    d, heads, kv = cfg.head_dim, cfg.num_attention_heads // n, kv_heads_per_device(cfg.num_key_value_heads, n)
    first_kv = r * cfg.num_key_value_heads // n  # the KV head of rank r's first query head
    for i, layer in enumerate(model.model.layers):
        attn, ffn, where = layer.self_attn, layer.ffn, f"model.layers.{i}"
        if type(attn) is not Attention or not isinstance(ffn, (GatedMLP, UpDownMLP, MoE)):
            raise QuantkitError(f"{where}: tensor parallelism splits attention, MLP and MoE blocks only, not "
                                f"{type(attn).__name__} / {type(ffn).__name__}")
        attn.q_proj = take_rows(attn.q_proj, r * heads * d, heads * d, f"{where}.self_attn.q_proj")
        attn.k_proj = take_rows(attn.k_proj, first_kv * d, kv * d, f"{where}.self_attn.k_proj")
        attn.v_proj = take_rows(attn.v_proj, first_kv * d, kv * d, f"{where}.self_attn.v_proj")
        attn.o_proj = RowParallelLinear(*take_columns(attn.o_proj, r * heads * d, (r + 1) * heads * d,
                                                      f"{where}.self_attn.o_proj"), comm)
        attn.n_heads, attn.n_kv = heads, kv
        where = f"{where}.{layer.ffn_name}"
        if not isinstance(ffn, MoE):
            shard_mlp(ffn, r, n, where, comm)
            continue
        for e, expert in enumerate(ffn.experts):
            shard_mlp(expert, r, n, f"{where}.experts.{e}", None)
        for name in ("shared_experts", "shared_expert"):  # GLM-4.5's, ERNIE's, Hunyuan's; Qwen2-MoE's
            if getattr(ffn, name, None) is not None:
                shard_mlp(getattr(ffn, name), r, n, f"{where}.{name}", None)
        setattr(layer, layer.ffn_name, AllReduced(ffn, comm))
    vocab = cfg.vocab_size // n
    embed = VocabParallelEmbedding(model.model.embed_tokens.weight.detach()[r * vocab : (r + 1) * vocab].clone(),
                                   r * vocab, comm)
    if cfg.tie_word_embeddings:
        with torch.device("meta"):
            head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        head.weight = embed.weight
    else:
        head = take_rows(model.lm_head, r * vocab, vocab, "lm_head")
    model.model.embed_tokens = embed
    model.lm_head = VocabParallelHead(head, comm)
    model.config = dataclasses.replace(
        cfg, num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=cfg.intermediate_size // n,
        moe_intermediate_size=cfg.moe_intermediate_size // n,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // n)

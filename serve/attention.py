"""AttentionBackends over the paged KV cache (docs/CONTRACTS.md): the model calls attn(layer, q, k, v) per layer.

Each step the runner hands over one AttentionMetadata; every layer first stores the step's K/V at slot_mapping,
then attends over the cache. The batch is ordered decodes first (one new token each), then prefill chunks.
  TorchPagedAttention: CPU (and any dtype): decodes with the C kernel of kernels/cpu/paged_decode.py when it builds (read
    through the block tables, no copies), else as one masked SDPA over their gathered blocks (GQA folded into the
    query axis, no K/V repeat); the prefill chunks all in one call of cpu_prefill.py's AMX kernel where it runs
    (bf16, head_dim 64/128), else each chunk with SDPA, causal over its cached context.
  TritonPagedAttention: CUDA fp16/bf16: quantkit.kernels kv_store / paged_attention_decode / _prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quantkit.kernels.cpu import paged_prefill as cpu_prefill
from quantkit.kernels.cpu.paged_decode import paged_decode


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S]: tokens in cache after this step
    query_start_loc: torch.Tensor  # int32 [S + 1]
    num_decodes: int  # sequences 0..num_decodes-1 have exactly one new token (tokens 0..num_decodes-1)
    # host copies for the CPU path
    seq_lens_host: list[int] = field(default_factory=list)
    query_lens_host: list[int] = field(default_factory=list)


class TorchPagedAttention:
    """Pure torch paged attention; per step it precomputes the gather/mask tensors all layers share."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float, decode_kernel=None,
                 fused_ops=None, prefill_kernel=None):
        self.kv_caches = kv_caches  # per layer (k_cache, v_cache) [num_blocks, block_size, Hkv, D]
        self.scale = scale
        self.decode_kernel = decode_kernel  # kernels.cpu.paged_decode.load_decode_kernel() or None
        # cpu_prefill.load_prefill_kernel(), or None (also when it does not take this cache's dtype or head_dim)
        self.prefill_kernel = prefill_kernel if cpu_prefill.supports(kv_caches[0][0]) else None
        self.fused_ops = fused_ops  # kernels.cpu.fused.CpuFusedOps (its kv_store) or None
        self.meta: AttentionMetadata | None = None

    def begin_step(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        block_size = self.kv_caches[0][0].shape[1]
        nd = meta.num_decodes
        self.decode_blocks = self.decode_mask = None
        if nd and self.decode_kernel is not None:
            self.decode_tables = meta.block_tables[:nd].contiguous()
            self.decode_lens = meta.seq_lens[:nd].contiguous()
        elif nd:
            lens = meta.seq_lens[:nd].long()
            num_blocks = -(-int(max(meta.seq_lens_host[:nd])) // block_size)
            self.decode_blocks = meta.block_tables[:nd, :num_blocks].long().flatten()
            span = torch.arange(num_blocks * block_size, device=lens.device)
            self.decode_mask = (span[None, :] < lens[:, None])[:, None, None, :]  # [Sd, 1, 1, Lp]
        # prefill chunks: the kernel's inputs, or per chunk (token start, token end, its row in block_tables,
        # context before the chunk)
        self.prefills = []
        self.kernel_prefill = self.prefill_kernel is not None and nd < len(meta.seq_lens_host)
        if self.kernel_prefill:
            self.prefill_tables = meta.block_tables[nd:].contiguous()
            self.prefill_qsl = (meta.query_start_loc[nd:] - nd).to(torch.int32)
            self.prefill_lens = meta.seq_lens[nd:].contiguous()
            return
        start = nd
        for s in range(nd, len(meta.seq_lens_host)):
            q_len, seq_len = meta.query_lens_host[s], meta.seq_lens_host[s]
            past = seq_len - q_len
            blocks = mask = None
            if past:
                nb = -(-seq_len // block_size)
                blocks = meta.block_tables[s, :nb].long()
                rows = torch.arange(q_len, device=blocks.device)[:, None] + past
                mask = torch.arange(seq_len, device=blocks.device)[None, :] <= rows  # [q_len, seq_len]
            self.prefills.append((start, start + q_len, seq_len, blocks, mask))
            start += q_len

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]
        k_cache, v_cache = self.kv_caches[layer_idx]
        num_blocks, block_size, hkv, d = k_cache.shape
        if self.fused_ops is not None:
            self.fused_ops.kv_store(k, v, k_cache, v_cache, self.meta.slot_mapping)
        else:
            k_cache.view(-1, hkv, d).index_copy_(0, self.meta.slot_mapping, k)
            v_cache.view(-1, hkv, d).index_copy_(0, self.meta.slot_mapping, v)
        out = torch.empty_like(q)
        hq = q.shape[1]
        nd = self.meta.num_decodes
        if nd and self.decode_kernel is not None:
            paged_decode(self.decode_kernel, q[:nd].contiguous(), k_cache, v_cache, self.decode_tables,
                         self.decode_lens, self.scale, out[:nd])
        elif nd:
            # [Sd, Lp, Hkv, D] -> [Sd, Hkv, Lp, D]; queries [Sd, Hkv, G, D] (the G heads sharing a kv head)
            kk = k_cache.index_select(0, self.decode_blocks).view(nd, -1, hkv, d).transpose(1, 2)
            vv = v_cache.index_select(0, self.decode_blocks).view(nd, -1, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[:nd].view(nd, hkv, hq // hkv, d), kk, vv, attn_mask=self.decode_mask, scale=self.scale
            )
            out[:nd] = o.reshape(nd, hq, d)
        if self.kernel_prefill:
            cpu_prefill.paged_prefill(self.prefill_kernel, q[nd:], k_cache, v_cache, self.prefill_tables,
                                      self.prefill_qsl, self.prefill_lens, self.scale, out[nd:])
            return out
        for start, end, seq_len, blocks, mask in self.prefills:
            if blocks is None:  # nothing cached before this chunk: plain causal attention over it
                kk, vv = k[start:end], v[start:end]
            else:
                kk = k_cache.index_select(0, blocks).view(-1, hkv, d)[:seq_len]
                vv = v_cache.index_select(0, blocks).view(-1, hkv, d)[:seq_len]
            # [1, H, L, D]: with a batch axis SDPA takes its flash kernel on CPU (7x faster than the math path
            # it falls back to for 3-d inputs)
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1)[None], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None],
                attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=hq != hkv,
            )
            out[start:end] = o[0].transpose(0, 1)
        return out


class TritonPagedAttention:
    """CUDA: the Triton kernels of quantkit.kernels (imported lazily; fp16/bf16 caches)."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float):
        from quantkit.kernels.triton.kv_store import kv_store
        from quantkit.kernels.triton.paged_attention import paged_attention_decode
        from quantkit.kernels.triton.paged_prefill import paged_attention_prefill

        self.kv_store, self.decode, self.prefill = kv_store, paged_attention_decode, paged_attention_prefill
        self.kv_caches = kv_caches
        self.scale = scale
        self.meta: AttentionMetadata | None = None

    def begin_step(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        nd = meta.num_decodes
        self.prefill_qsl = (meta.query_start_loc[nd:] - nd).to(torch.int32)
        self.max_query_len = max(meta.query_lens_host[nd:], default=0)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer_idx]
        meta = self.meta
        self.kv_store(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decodes
        if nd == q.shape[0]:
            return self.decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale=self.scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                                   scale=self.scale)
        out[nd:] = self.prefill(q[nd:], k_cache, v_cache, meta.block_tables[nd:], self.prefill_qsl,
                                meta.seq_lens[nd:], scale=self.scale, max_query_len=self.max_query_len)
        return out

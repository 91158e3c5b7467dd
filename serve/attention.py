"""AttentionBackends over the paged KV cache (docs/CONTRACTS.md): the model calls attn(layer, q, k, v) per layer.

Each step the runner hands over one AttentionMetadata; every layer first stores the step's K/V at slot_mapping,
then attends over the cache. The batch is ordered decodes first (one new token each), then prefill chunks.
  TorchPagedAttention: CPU (and any dtype): decodes with the C kernel of kernels/cpu/paged_decode.py when it builds (read
    through the block tables, no copies), else as one masked SDPA over their gathered blocks (GQA folded into the
    query axis, no K/V repeat); the prefill chunks all in one call of cpu_prefill.py's AMX kernel where it runs
    (bf16, head_dim 64/128), else each chunk with SDPA, causal over its cached context. Those kernels serve the
    layers whose AttentionSpec they compute (any scale; no sliding window, no logit soft-cap: kernel_servable);
    the others (Mistral's windows, Gemma's soft-caps) take the masked torch path, chosen per layer once at
    construction: per sequence only the keys the layer can see are gathered (a windowed layer reads the last
    `window` positions, never a block the block manager freed behind the window), masked with the dense path's
    window_mask and attended with its masked_attention (SDPA, or an fp32 softmax after the soft-cap).
    Batch-invariant (given rows_kernel, paged_decode.py's paged_rows): every query row of every layer - decode,
    prefill chunk (fresh or after cached context), speculative verify - is one decode item over the positions of
    its sequence its layer lets it see (window and soft-cap in the kernel), so a position's output is the same bits
    whatever the step holds.
  TritonPagedAttention: CUDA fp16/bf16: quantkit.kernels kv_store / paged_attention_decode / _prefill, at each
    layer's scale, sliding window and soft-cap (the kernels start at the window: never a FREED block-table entry).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quantkit.kernels.cpu import paged_prefill as cpu_prefill
from quantkit.kernels.cpu.paged_decode import paged_decode, paged_rows
from quantkit.models.attention import AttentionSpec, kernel_servable, masked_attention, window_mask


def layer_specs(specs, num_layers: int) -> list[AttentionSpec]:
    """model.attention_specs, or one scale for every layer (plain causal attention: kernel tests, benches)."""
    if isinstance(specs, (int, float)):
        return [AttentionSpec(float(specs))] * num_layers
    specs = list(specs)
    if len(specs) != num_layers:
        raise ValueError(f"{len(specs)} attention specs for {num_layers} cached layers")
    return specs


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

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], specs, decode_kernel=None,
                 fused_ops=None, prefill_kernel=None, rows_kernel=None):
        """specs: per layer AttentionSpec (model.attention_specs), or one scale for every layer. rows_kernel:
        paged_decode.load_rows_kernel() for batch-invariant serving (then it runs every row of every layer, at the
        layer's window and soft-cap), or None."""
        self.kv_caches = kv_caches  # per layer (k_cache, v_cache) [num_blocks, block_size, Hkv, D]
        self.specs = layer_specs(specs, len(kv_caches))
        self.rows_kernel = rows_kernel
        # the kernels' (or plain SDPA's) layers; with rows_kernel, every layer
        self.fast = [rows_kernel is not None or kernel_servable(spec) for spec in self.specs]
        # the windows of the masked layers (None: a soft-capped layer without one); begin_step gathers per window
        self.windows = list(dict.fromkeys(spec.sliding_window for spec, fast in zip(self.specs, self.fast)
                                          if not fast))
        self.decode_kernel = decode_kernel  # kernels.cpu.paged_decode.load_decode_kernel() or None
        # cpu_prefill.load_prefill_kernel(), or None (also when it does not take this cache's dtype or head_dim)
        self.prefill_kernel = prefill_kernel if cpu_prefill.supports(kv_caches[0][0]) else None
        self.fused_ops = fused_ops  # kernels.cpu.fused.CpuFusedOps (its kv_store) or None
        self.meta: AttentionMetadata | None = None

    def begin_step(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.masked = {window: self._masked_inputs(meta, window) for window in self.windows}
        if any(self.fast):
            self._begin_fast(meta)

    def _masked_inputs(self, meta: AttentionMetadata, window: int | None):
        """For the masked layers of one window: the decodes' (cache slots [Sd, Lmax], mask [Sd, 1, 1, Lmax]) or
        None, and per prefill chunk (token start, end, cache slots [n], mask [1, 1, q_len, n]). Only positions the
        layer can see are gathered: a decode at position p reads (p - window, p], a chunk from its first query's
        window on; padding repeats the sequence's own last slot (written this step), masked off."""
        bs = self.kv_caches[0][0].shape[1]
        nd, dev = meta.num_decodes, meta.block_tables.device
        tables = meta.block_tables.long()
        decodes = None
        if nd:
            lens = meta.seq_lens[:nd].long()
            lo = (lens - window).clamp(min=0) if window is not None else torch.zeros_like(lens)
            span = max(meta.seq_lens_host[:nd]) if window is None else min(window, max(meta.seq_lens_host[:nd]))
            j = torch.arange(span, device=dev)
            valid = j[None, :] < (lens - lo)[:, None]  # [Sd, Lmax]
            pos = torch.where(valid, lo[:, None] + j[None, :], lens[:, None] - 1)
            slots = tables[:nd].gather(1, pos // bs) * bs + pos % bs
            decodes = slots, valid[:, None, None, :]
        chunks = []
        start = nd
        for s in range(nd, len(meta.seq_lens_host)):
            q_len, seq_len = meta.query_lens_host[s], meta.seq_lens_host[s]
            past = seq_len - q_len
            lo = max(0, past - window + 1) if window is not None else 0
            pos = torch.arange(lo, seq_len, device=dev)
            slots = tables[s, pos // bs] * bs + pos % bs
            queries = torch.arange(past, seq_len, device=dev)
            mask = window_mask(queries[:, None], pos[None, :], window)[None, None]
            chunks.append((start, start + q_len, slots, mask))
            start += q_len
        return decodes, chunks

    def _begin_fast(self, meta: AttentionMetadata) -> None:
        """The kernels' inputs (or the plain SDPA path's gathers) for the kernel_servable layers."""
        if self.rows_kernel is not None:
            # per row: its sequence and length (its position + 1); row t of sequence s, whose new tokens end at
            # query_start_loc[s + 1], sits at position seq_lens[s] - query_start_loc[s + 1] + t
            q_lens = torch.tensor(meta.query_lens_host)
            self.rows_tables = meta.block_tables.contiguous()
            self.row_seqs = torch.repeat_interleave(torch.arange(len(q_lens), dtype=torch.int32), q_lens)
            ends = meta.query_start_loc[1:].long()
            offset = torch.repeat_interleave(meta.seq_lens.long() - ends, q_lens)
            self.row_lens = (torch.arange(int(ends[-1])) + offset + 1).to(torch.int32)
            return
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
        spec = self.specs[layer_idx]
        if not self.fast[layer_idx]:
            return self._masked(spec, q, k_cache, v_cache, out)
        scale = spec.scale
        if self.rows_kernel is not None:
            paged_rows(self.rows_kernel, q.contiguous(), k_cache, v_cache, self.rows_tables, self.row_seqs,
                       self.row_lens, scale, out, spec.sliding_window, spec.logit_softcap)
            return out
        hq = q.shape[1]
        nd = self.meta.num_decodes
        if nd and self.decode_kernel is not None:
            paged_decode(self.decode_kernel, q[:nd].contiguous(), k_cache, v_cache, self.decode_tables,
                         self.decode_lens, scale, out[:nd])
        elif nd:
            # [Sd, Lp, Hkv, D] -> [Sd, Hkv, Lp, D]; queries [Sd, Hkv, G, D] (the G heads sharing a kv head)
            kk = k_cache.index_select(0, self.decode_blocks).view(nd, -1, hkv, d).transpose(1, 2)
            vv = v_cache.index_select(0, self.decode_blocks).view(nd, -1, hkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[:nd].view(nd, hkv, hq // hkv, d), kk, vv, attn_mask=self.decode_mask, scale=scale
            )
            out[:nd] = o.reshape(nd, hq, d)
        if self.kernel_prefill:
            cpu_prefill.paged_prefill(self.prefill_kernel, q[nd:], k_cache, v_cache, self.prefill_tables,
                                      self.prefill_qsl, self.prefill_lens, scale, out[nd:])
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
                attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=hq != hkv,
            )
            out[start:end] = o[0].transpose(0, 1)
        return out

    def _masked(self, spec: AttentionSpec, q, k_cache, v_cache, out):
        """A layer the kernels cannot compute: its window's gathered keys, the dense path's masked attention."""
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
        decodes, chunks = self.masked[spec.sliding_window]
        if decodes is not None:
            slots, mask = decodes
            nd, span = slots.shape
            kk = k_flat.index_select(0, slots.flatten()).view(nd, span, hkv, d).transpose(1, 2)
            vv = v_flat.index_select(0, slots.flatten()).view(nd, span, hkv, d).transpose(1, 2)
            out[:nd] = masked_attention(q[:nd].unsqueeze(2), kk, vv, mask, spec).squeeze(2)
        for start, end, slots, mask in chunks:
            kk = k_flat.index_select(0, slots).transpose(0, 1)[None]
            vv = v_flat.index_select(0, slots).transpose(0, 1)[None]
            o = masked_attention(q[start:end].transpose(0, 1)[None], kk, vv, mask, spec)
            out[start:end] = o[0].transpose(0, 1)
        return out


class TritonPagedAttention:
    """CUDA: the Triton kernels of quantkit.kernels (imported lazily; fp16/bf16 caches)."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], specs, max_num_seqs: int,
                 num_q_heads: int):
        """specs: per layer AttentionSpec (model.attention_specs) or one scale for every layer. max_num_seqs and
        num_q_heads size the decode kernel's split workspace, reserved here: outside any CUDA-graph capture."""
        from quantkit.kernels.triton.kv_store import kv_store
        from quantkit.kernels.triton.paged_attention import paged_attention_decode, reserve_decode_workspace
        from quantkit.kernels.triton.paged_prefill import paged_attention_prefill

        self.kv_store, self.decode, self.prefill = kv_store, paged_attention_decode, paged_attention_prefill
        self.kv_caches = kv_caches
        k_cache = kv_caches[0][0]  # [num_blocks, block_size, Hkv, D], every layer alike
        reserve_decode_workspace(k_cache.device, max_num_seqs, num_q_heads, k_cache.shape[2], k_cache.shape[3])
        # per layer the kernels' keyword arguments: scale, window and soft-cap (0 = none)
        self.layer_args = [dict(scale=spec.scale, window=spec.sliding_window or 0, softcap=spec.logit_softcap or 0.0)
                           for spec in layer_specs(specs, len(kv_caches))]
        self.meta: AttentionMetadata | None = None

    def begin_step(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        nd = meta.num_decodes
        self.prefill_qsl = (meta.query_start_loc[nd:] - nd).to(torch.int32)
        self.max_query_len = max(meta.query_lens_host[nd:], default=0)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer_idx]
        meta = self.meta
        args = self.layer_args[layer_idx]
        self.kv_store(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decodes
        if nd == q.shape[0]:
            return self.decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, **args)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], **args)
        out[nd:] = self.prefill(q[nd:], k_cache, v_cache, meta.block_tables[nd:], self.prefill_qsl,
                                meta.seq_lens[nd:], max_query_len=self.max_query_len, **args)
        return out

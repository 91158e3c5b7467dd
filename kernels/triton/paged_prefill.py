# paged_prefill - q [T, Hq, D] (new tokens of S sequences) x k/v_cache [num_blocks, block_size, Hkv, D]
#                 -> out [T, Hq, D], fp16/bf16 (chunked prefill: causal over cached blocks + the chunk itself)
"""Prefill / chunked-prefill attention over the paged KV cache.

Sequence s owns query rows [query_start_loc[s], query_start_loc[s+1]) of q (q_len of them) and has seq_lens[s]
tokens in the cache after this step, the new ones included (kv_store.py runs first). Its first new token sits at
position ctx = seq_lens[s] - q_len, and query i sees cache tokens 0..ctx + i, or with a sliding window w only
ctx + i - w < t <= ctx + i. Scores may be soft-capped (paged_attention.py's kv_tile).

Grid (cdiv(max_query_len, BLOCK_M), S, Hq): program (m, s, h) takes query rows [m*BLOCK_M, +BLOCK_M) of
sequence s, head h, and streams K/V tiles of BLOCK_N tokens (gathered through the block table) from the first key
its first row sees (0, or behind the window: never a block the block manager freed) up to its last visible token,
with an online softmax in fp32. A decode batch (q_len 1) works too.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import fp32_dot
from .paged_attention import (
    attention_ref, attention_warps, check_paged_inputs, gather_kv, kv_tile, softcap_scales, softmax_step,
)

PREFILL_BLOCK_M = 64  # query rows per program on a GPU
PREFILL_BLOCK_N = 64  # tokens per K/V tile on a GPU


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr, v_ptr,  # [num_blocks, block_size, Hkv, D], head_dim stride 1
    bt_ptr,  # int32 [S, max_blocks]
    qsl_ptr,  # int32 [S + 1] query_start_loc
    lens_ptr,  # int32 [S] cache length after this step
    out_ptr,  # [T, Hq, D]
    qk_scale, cap_log2,  # softmax scale * log2(e), or with SOFTCAP scale / cap and cap * log2(e) (kv_tile)
    window,  # keys a query sees, itself included (WINDOWED)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, FP32_DOT: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_SIZE: tl.constexpr,  # the cache's tokens per block
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    s = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    seq_len = tl.load(lens_ptr + s)
    ctx = seq_len - q_len  # position of the chunk's first token

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] row within the chunk
    mask_m = offs_m < q_len
    pos = ctx + offs_m  # [BM] position of each query row
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    # q (t, h, d) at q_ptr + t * stride_qt + h * stride_qh + d, t = q_start + row
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BM, BD]

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # keys up to the last visible token of this row block (0 when the block is past the chunk: nothing to do)
    t_end = tl.where(pid_m * BLOCK_M < q_len, tl.minimum(seq_len, ctx + (pid_m + 1) * BLOCK_M), 0)
    t_begin = 0
    if WINDOWED:  # the first key the block's first row sees
        t_begin = tl.maximum(ctx + pid_m * BLOCK_M - window + 1, 0)
    kv_head = (h // GROUP).to(tl.int64) * stride_kh
    for t0 in range(t_begin, t_end, BLOCK_N):
        offs_t, scores, v = kv_tile(q, k_ptr, v_ptr, bt_ptr + s * stride_bt, t0, t_end, offs_d, mask_d, kv_head,
                                    BLOCK_SIZE, stride_kb, stride_ks, qk_scale, cap_log2, SOFTCAP, FP32_DOT, BLOCK_N)
        # causal: row sees token t iff t <= pos; without a window token 0 is visible to every row, so no row is
        # all -inf; with one, later rows may see nothing of the first tiles (softmax_step's EMPTY_ROWS)
        visible = offs_t[None, :] <= pos[:, None]
        if WINDOWED:
            visible &= offs_t[None, :] > pos[:, None] - window
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = softmax_step(scores, m_i, l_i, acc, v, FP32_DOT, WINDOWED)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i == 0 only on rows past the chunk (not stored)
    tl.store(out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float | None = None, max_query_len: int | None = None,
                            window: int = 0, softcap: float = 0.0,
                            block_m: int = PREFILL_BLOCK_M, block_n: int = PREFILL_BLOCK_N) -> torch.Tensor:
    """q [T, Hq, D] (RoPE applied) -> out [T, Hq, D] in q.dtype, causal over each sequence's cache.

    query_start_loc int32 [S + 1], seq_lens int32 [S] (cache length including this step's tokens).
    max_query_len bounds the grid (defaults to T: no host sync, extra programs exit at once).
    window: keys a query sees, itself included (0: all before it); softcap: scores -> c * tanh(scores / c) (0: none).
    """
    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    assert window >= 0, f"window {window}: 0 (none) or the keys a query sees"
    total, hq, d = q.shape
    num_seqs = block_tables.shape[0]
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,), \
        "query_start_loc int32 [S + 1]"
    hkv = k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    max_query_len = total if max_query_len is None else max_query_len
    out = torch.empty_like(q)
    if total == 0:
        return out
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, hq)
    qk_scale, cap_log2 = softcap_scales(scale, softcap)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        qk_scale, cap_log2, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=hq // hkv, HEAD_DIM=d, FP32_DOT=fp32_dot(q.dtype), WINDOWED=window > 0, SOFTCAP=softcap > 0,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_D=triton.next_power_of_2(d), BLOCK_N=block_n,
        num_warps=attention_warps(triton.next_power_of_2(d)), num_stages=2,
    )
    return out


def paged_attention_prefill_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                scale: float | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Pure torch `paged_attention_prefill`: per sequence, gather its K/V and attend causally in fp32."""
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, length in enumerate(seq_lens.tolist()):
        lo, hi = starts[s], starts[s + 1]
        k = gather_kv(k_cache, block_tables[s], length)
        v = gather_kv(v_cache, block_tables[s], length)
        out[lo:hi] = attention_ref(q[lo:hi], k, v, length - (hi - lo), scale, window, softcap)
    return out

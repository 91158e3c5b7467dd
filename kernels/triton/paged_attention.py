# paged_attention - q [S, Hq, D] x k/v_cache [num_blocks, block_size, Hkv, D] -> out [S, Hq, D], fp16/bf16
"""Decode attention over the engine's paged KV cache: one query token per sequence, GQA, variable lengths, an
optional sliding window and logit soft-cap (a layer's AttentionSpec, quantkit/models/attention.py).

Cache layout (docs/CONTRACTS.md): token t of sequence s lives in block block_tables[s, t // block_size] at row
t % block_size; seq_lens[s] tokens are valid (the new token's K/V are already stored, kv_store.py).

Flash-decoding in two launches:
  1. grid (S, Hkv, num_splits): program (s, kvh, split) takes the query heads of kv head kvh (the GQA group,
     padded to 16 rows for tl.dot) and the tokens [split*partition, +partition) of sequence s; it streams K/V
     tiles of BLOCK_N tokens gathered through the block table (one cache block or several per tile) with an
     online softmax in fp32 (exp2 domain) and writes its normalised partial output and log-sum-exp.
  2. grid (S, Hq): merges the partials of the splits that hold tokens (weights 2^(lse - max lse)).
With one split, launch 1 writes `out` directly and launch 2 is skipped. The grid depends only on tensor shapes
(block_tables.shape[1] bounds the context), never on seq_lens' values: no host sync, CUDA-graph safe.

Window w (0 = none): the query at position p = seq_len - 1 sees keys (p - w, p], so every program starts at
max(split start, seq_len - w): tiles behind the window are never loaded, and neither are their block-table entries
(the block manager may have freed them: FREED = -1). Soft-cap c (0 = none): scores -> c * tanh(scale * q.k / c)
before the softmax (Gemma 2, as transformers computes it). Both are constexpr-gated: the plain path is unchanged.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .common import fp32_dot, mma

LOG2E = 1.4426950408889634
DECODE_BLOCK_N = 64  # tokens per K/V tile on a GPU (a 64 x 128 fp16 tile is 16 KiB)
PROGRAMS_PER_SM = 4  # split the context until S * Hkv * splits fills the GPU this many times over


@triton.jit
def kv_tile(q, k_ptr, v_ptr, bt_row_ptr, t0, t_end, offs_d, mask_d, kv_head, block_size, stride_kb, stride_ks,
            qk_scale, cap_log2, SOFTCAP: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens [t0, t0 + BLOCK_N) of one sequence (those >= t_end masked) for the query rows q [BM, BD]:
    -> (offs_t [BN], scores [BM, BN] fp32 in log2 units, -inf where t >= t_end, v [BN, BD]).
    Scores: q.k * qk_scale (= scale * log2(e)); SOFTCAP: tanh(q.k * qk_scale) * cap_log2 with qk_scale =
    scale / cap and cap_log2 = cap * log2(e) (softcap_scales).
    Token t's row: block = block_tables row [t // block_size], at block * stride_kb + (t % block_size) * stride_ks
    + kv_head (the kv head's offset) in the cache [num_blocks, block_size, Hkv, D]."""
    offs_t = t0 + tl.arange(0, BLOCK_N)  # [BN] token positions
    mask_t = offs_t < t_end
    block = tl.load(bt_row_ptr + offs_t // block_size, mask=mask_t, other=0).to(tl.int64)  # [BN] physical blocks
    rows = block * stride_kb + (offs_t % block_size).to(tl.int64) * stride_ks + kv_head  # [BN]
    mask_td = mask_t[:, None] & mask_d[None, :]
    k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=mask_td, other=0.0)  # [BN, BD]
    v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=mask_td, other=0.0)  # [BN, BD]
    scores = mma(q, tl.trans(k), tl.zeros((q.shape[0], BLOCK_N), dtype=tl.float32), FP32_DOT) * qk_scale
    if SOFTCAP:
        scores = tanh(scores) * cap_log2
    return offs_t, tl.where(mask_t[None, :], scores, float("-inf")), v


@triton.jit
def tanh(x):
    """tanh in fp32 through the sigmoid (saturates to +-1 without overflow; absolute error ~1e-7)."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def softmax_step(scores, m_i, l_i, acc, v, FP32_DOT: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    """Online softmax (exp2 domain): fold scores [BM, BN] (masked = -inf, >= 1 finite per row over the whole
    run) and v [BN, D] into running max m_i [BM], sum l_i [BM] and output acc [BM, D] fp32. EMPTY_ROWS: a row may
    have seen no finite score yet (a window leaves the first tiles of later rows empty): its max stays -inf and
    the step adds nothing to it instead of NaN."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [BM]
    shift = m_new
    if EMPTY_ROWS:
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # an empty row: alpha and p are exp2(-inf) = 0
    alpha = tl.exp2(m_i - shift)  # rescale of the old sums (0 on the first tile: m_i = -inf)
    p = tl.exp2(scores - shift[:, None])  # [BM, BN]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = mma(p.to(v.dtype), v, acc * alpha[:, None], FP32_DOT)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [S, Hq, D]
    k_ptr, v_ptr,  # [num_blocks, block_size, Hkv, D], head_dim stride 1
    bt_ptr,  # int32 [S, max_blocks]
    lens_ptr,  # int32 [S]
    out_ptr,  # [S, Hq, D] (NUM_SPLITS == 1)
    part_out_ptr,  # fp32 [S, Hq, NUM_SPLITS, D] (NUM_SPLITS > 1)
    part_lse_ptr,  # fp32 [S, Hq, NUM_SPLITS] (NUM_SPLITS > 1), log2 units
    qk_scale, cap_log2,  # softmax scale * log2(e), or with SOFTCAP scale / cap and cap * log2(e) (kv_tile)
    window,  # keys the query sees, itself included (WINDOWED)
    block_size, partition,  # partition: tokens per split, a multiple of BLOCK_N
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, FP32_DOT: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + s)
    t_begin = split * partition
    t_end = tl.minimum(t_begin + partition, seq_len)  # empty range for splits past the context
    if WINDOWED:  # the first visible key: splits wholly behind the window get an empty range
        t_begin = tl.maximum(t_begin, seq_len - window)

    offs_h = kvh * GROUP + tl.arange(0, BLOCK_H)  # [BH] query heads of this kv head (rows >= GROUP are padding)
    mask_h = tl.arange(0, BLOCK_H) < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    # q (s, h, d) at q_ptr + s * stride_qs + h * stride_qh + d
    q = tl.load(q_ptr + s * stride_qs + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BH, BD]

    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    kv_head = kvh.to(tl.int64) * stride_kh
    for t0 in range(t_begin, t_end, BLOCK_N):
        _, scores, v = kv_tile(q, k_ptr, v_ptr, bt_ptr + s * stride_bt, t0, t_end, offs_d, mask_d, kv_head,
                               block_size, stride_kb, stride_ks, qk_scale, cap_log2, SOFTCAP, FP32_DOT,
                               BLOCK_N)  # [BH, BN], [BN, BD]
        m_i, l_i, acc = softmax_step(scores, m_i, l_i, acc, v, FP32_DOT, False)

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + s * stride_os + offs_h[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
    else:
        # partials (s, h, split, d) at ((s * Hq + h) * NUM_SPLITS + split) * HEAD_DIM + d; an empty split (past
        # the context, or behind the window) writes zeros and lse -inf, which the merge skips or weighs 0
        row = (s * tl.num_programs(1) * GROUP + offs_h) * NUM_SPLITS + split  # [BH]
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None],
                 mask=mask_h[:, None] & mask_d[None, :])
        tl.store(part_lse_ptr + row, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr,  # fp32 [S, Hq, NUM_SPLITS, D], [S, Hq, NUM_SPLITS]
    lens_ptr, out_ptr,  # int32 [S]; [S, Hq, D]
    partition, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    used = tl.cdiv(tl.load(lens_ptr + s), partition)  # splits holding tokens
    offs_p = tl.arange(0, BLOCK_SPLITS)
    mask_p = offs_p < used
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    row = (s * tl.num_programs(1) + h) * NUM_SPLITS + offs_p  # [BP]
    lse = tl.load(part_lse_ptr + row, mask=mask_p, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # [BP], 0 for unused splits
    part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_p[:, None] & mask_d[None, :],
                   other=0.0)  # [BP, BD]
    out = tl.sum(weight[:, None] * part, axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + s * stride_os + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def attention_warps(block_d: int) -> int:
    """Warps per program: 8 for head_dim 128+ (64-token K/V tiles then fit sm_90 registers without spilling)."""
    return 8 if block_d >= 128 else 4


def check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    """Shared assertions of the paged-attention launchers (q [*, Hq, D], caches, block tables, lengths)."""
    assert q.dim() == 3 and k_cache.dim() == 4, "q [*, Hq, D], caches [num_blocks, block_size, Hkv, D]"
    assert q.dtype in (torch.float16, torch.bfloat16), f"q dtype {q.dtype}: fp16/bf16"
    assert k_cache.dtype == v_cache.dtype == q.dtype, "q, k_cache and v_cache share one dtype"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), "k/v caches alike"
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    assert k_cache.shape[3] == d and hq % hkv == 0, f"Hq={hq} must be a multiple of Hkv={hkv}, D={d}"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1, "head_dim must be contiguous"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.stride(1) == 1, \
        "block_tables int32 [S, max_blocks]"
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (block_tables.shape[0],), "seq_lens int32 [S]"
    assert q.device == k_cache.device == block_tables.device == seq_lens.device, "one device"


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(num_seqs: int, num_kv_heads: int, max_tokens: int, block_n: int, device) -> int:
    """Splits per sequence so S * Hkv * splits is about PROGRAMS_PER_SM x the SM count (1 in the interpreter)."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = triton.cdiv(PROGRAMS_PER_SM * sms, num_seqs * num_kv_heads)
    return max(1, min(want, triton.cdiv(max_tokens, block_n)))


def softcap_scales(scale: float, softcap: float) -> tuple[float, float]:
    """The kernels' (qk_scale, cap_log2): scores in log2 units are q.k * qk_scale, or with a soft-cap
    tanh(q.k * qk_scale) * cap_log2 = cap * tanh(scale * q.k / cap) * log2(e)."""
    assert softcap >= 0 and scale > 0, f"softcap {softcap} (0 = none), scale {scale}"
    return (scale / softcap, softcap * LOG2E) if softcap else (scale * LOG2E, 0.0)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
                           window: int = 0, softcap: float = 0.0,
                           num_splits: int | None = None, block_n: int = DECODE_BLOCK_N) -> torch.Tensor:
    """q [S, Hq, D] (one new token per sequence, RoPE applied) -> out [S, Hq, D] in q.dtype.

    Attends over tokens [max(0, seq_lens[s] - window), seq_lens[s]) of each sequence (seq_lens >= 1, K/V already
    in the cache; window 0: from token 0), scores soft-capped at `softcap` (0: none).
    scale defaults to 1/sqrt(D); num_splits (context partitions) defaults to filling the GPU.
    """
    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    assert window >= 0, f"window {window}: 0 (none) or the keys a query sees"
    num_seqs, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    assert q.shape[0] == block_tables.shape[0], "one query token per sequence"
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    max_tokens = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = _num_splits(num_seqs, hkv, max_tokens, block_n, q.device)
    partition = triton.cdiv(triton.cdiv(max_tokens, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_tokens, partition)
    out = torch.empty_like(q)
    if num_splits > 1:
        part_out = torch.empty((num_seqs, hq, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out
    block_d = triton.next_power_of_2(d)
    qk_scale, cap_log2 = softcap_scales(scale, softcap)
    _decode_split_kernel[(num_seqs, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        qk_scale, cap_log2, window, block_size, partition,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=d, NUM_SPLITS=num_splits, FP32_DOT=fp32_dot(q.dtype),
        WINDOWED=window > 0, SOFTCAP=softcap > 0,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        num_warps=attention_warps(block_d), num_stages=2,
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, hq)](
            part_out, part_lse, seq_lens, out, partition, out.stride(0), out.stride(1),
            HEAD_DIM=d, NUM_SPLITS=num_splits, BLOCK_SPLITS=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    return out


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Pure torch: the first `length` tokens of one sequence from a paged cache -> [length, Hkv, D]."""
    t = torch.arange(length, device=cache.device)
    blocks = block_table.to(torch.int64)[t // cache.shape[1]]
    return cache[blocks, t % cache.shape[1]]


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float,
                  window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Pure torch causal GQA attention in fp32: q [L, Hq, D] at positions first_pos.., k/v [T, Hkv, D] -> [L, Hq, D].
    Query i sees keys first_pos + i - window < t <= first_pos + i (window 0: from 0); softcap c > 0: scores ->
    c * tanh(scores / c) after the scale."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [T, Hq, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,thd->hlt", q.float(), k) * scale  # [Hq, L, T]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = first_pos + torch.arange(q.shape[0], device=q.device)
    t = torch.arange(k.shape[0], device=q.device)[None, :]
    visible = t <= pos[:, None]  # [L, T]
    if window:
        visible &= t > pos[:, None] - window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hlt,thd->lhd", probs, v).to(q.dtype)


def paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale: float | None = None,
                               window: int = 0, softcap: float = 0.0):
    """Pure torch `paged_attention_decode`: gather each sequence's K/V and attend in fp32."""
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    out = torch.empty_like(q)
    for s, length in enumerate(seq_lens.tolist()):
        k = gather_kv(k_cache, block_tables[s], length)
        v = gather_kv(v_cache, block_tables[s], length)
        out[s] = attention_ref(q[s:s + 1], k, v, length - 1, scale, window, softcap)[0]
    return out

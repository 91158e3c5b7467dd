# paged_attention - q [S, Hq, D] x k/v_cache [num_blocks, block_size, Hkv, D] -> out [S, Hq, D], fp16/bf16
"""Decode attention over the engine's paged KV cache: one query token per sequence, GQA, variable lengths, an
optional sliding window and logit soft-cap (a layer's AttentionSpec, quantkit/models/attention.py).

Cache layout (docs/CONTRACTS.md): token t of sequence s lives in block block_tables[s, t // block_size] at row
t % block_size; seq_lens[s] tokens are valid (the new token's K/V are already stored, kv_store.py).

Flash-decoding in ONE launch, grid (S, Hkv, num_splits): program (s, kvh, split) takes the query heads of kv head
kvh (the GQA group, padded to 16 rows for tl.dot) and the tokens [split*partition, +partition) of sequence s; it
streams K/V tiles of BLOCK_N tokens gathered through the block table (one cache block or several per tile) with an
online softmax in fp32 (exp2 domain). With one split it writes `out` directly. With several, it stores its
normalised partial output and log-sum-exp in its own slice of a per-device fp32 workspace (plain stores: no float
atomics, dequant_gemv.py's docstring says why), then bumps the arrival counter of (s, kvh) (acq_rel); the program
that arrives last merges the group's splits that hold visible tokens (weights 2^(lse - max lse)), writes `out` and
puts the counter back to zero. Invariant between launches: every counter is zero (common.SplitWorkspaces).
Splits (decode_splits): enough that S * Hkv * splits fills the GPU PROGRAMS_PER_SM times over, each at least
MIN_TILES_PER_SPLIT tiles long (a program of one or two tiles is all latency: its pipeline never fills). The grid
depends only on tensor shapes (block_tables.shape[1] bounds the context), never on seq_lens' values: no host sync,
CUDA-graph safe; the workspace is reserved at load time, outside capture (reserve_decode_workspace).

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

from .common import SplitWorkspaces, fp32_dot, mma

LOG2E = 1.4426950408889634
DECODE_BLOCK_N = 64  # tokens per K/V tile on a GPU (a 64 x 128 fp16 tile is 16 KiB)
MIN_TILES_PER_SPLIT = 4  # a split streams at least this many K/V tiles (when the context has them)
PROGRAMS_PER_SM = 2  # split the context until S * Hkv * splits fills the GPU this many times over (2 fit an SM)
# Software-pipeline depth of the split kernel's loop. Compiled for sm_90 (Triton 3.6 and 3.9; head_dim 128 fp16,
# BLOCK_N 64, 8 warps; bench/gpu_sass.py's way): with 2 to 4 stages the loop opens by waiting for every copy in
# flight (DEPBAR.LE SB0, 0x0), so each tile's K/V load latency is exposed, one tile after another; 5 double-buffers
# K and V: the loop waits for the current tile only (0x3: the next tile's K, V and block-table copies stay in
# flight). 70.5 KiB of shared memory: two programs (PROGRAMS_PER_SM) fit one 228 KiB SM (sm_90) or 164 KiB (sm_80).
DECODE_STAGES = 5
# fp32 partials the merging program loads at once: 16 a thread at 8 warps keeps the kernel at ~100 registers on
# sm_90 (8192: 116 to 128), under the 128 that let two 8-warp programs share an SM
MERGE_TILE = 4096


@triton.jit
def kv_tile(q, k_ptr, v_ptr, bt_row_ptr, t0, t_end, offs_d, mask_d, kv_head, BLOCK_SIZE: tl.constexpr, stride_kb,
            stride_ks, qk_scale, cap_log2, SOFTCAP: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens [t0, t0 + BLOCK_N) of one sequence (those >= t_end masked) for the query rows q [BM, BD]:
    -> (offs_t [BN], scores [BM, BN] fp32 in log2 units, -inf where t >= t_end, v [BN, BD]).
    Scores: q.k * qk_scale (= scale * log2(e)); SOFTCAP: tanh(q.k * qk_scale) * cap_log2 with qk_scale =
    scale / cap and cap_log2 = cap * log2(e) (softcap_scales).
    Token t's row: block = block_tables row [t // BLOCK_SIZE], at block * stride_kb + (t % BLOCK_SIZE) * stride_ks
    + kv_head (the kv head's offset) in the cache [num_blocks, BLOCK_SIZE, Hkv, D]. The cache's block size is a
    constexpr: a runtime divisor costs an integer division per token (sm_90, a decode tile: 359 -> 304
    instructions under Triton 3.9, 444 -> 357 under 3.6; bench/gpu_sass.py)."""
    offs_t = t0 + tl.arange(0, BLOCK_N)  # [BN] token positions
    mask_t = offs_t < t_end
    block = tl.load(bt_row_ptr + offs_t // BLOCK_SIZE, mask=mask_t, other=0).to(tl.int64)  # [BN] physical blocks
    rows = block * stride_kb + (offs_t % BLOCK_SIZE).to(tl.int64) * stride_ks + kv_head  # [BN]
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
def visible_start(seq_len, window, WINDOWED: tl.constexpr):
    """The first key the query at position seq_len - 1 sees: max(0, seq_len - window) with a window, else 0."""
    first = 0
    if WINDOWED:
        first = tl.maximum(seq_len - window, 0)
    return first


@triton.jit
def attend(q, k_ptr, v_ptr, bt_row_ptr, t_begin, t_end, offs_d, mask_d, kv_head, BLOCK_SIZE: tl.constexpr, stride_kb,
           stride_ks, qk_scale, cap_log2, SOFTCAP: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_N: tl.constexpr):
    """The query rows q [BH, BD] over tokens [t_begin, t_end) of one sequence (kv_tile's arguments), an online
    softmax tile by tile -> (max m_i [BH], sum l_i [BH], unnormalised output acc [BH, BD]), fp32, log2 units;
    an empty range leaves m_i = -inf and l_i = 0."""
    m_i = tl.full((q.shape[0],), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((q.shape[0],), dtype=tl.float32)
    acc = tl.zeros((q.shape[0], q.shape[1]), dtype=tl.float32)
    for t0 in range(t_begin, t_end, BLOCK_N):
        _, scores, v = kv_tile(q, k_ptr, v_ptr, bt_row_ptr, t0, t_end, offs_d, mask_d, kv_head, BLOCK_SIZE,
                               stride_kb, stride_ks, qk_scale, cap_log2, SOFTCAP, FP32_DOT,
                               BLOCK_N)  # [BH, BN], [BN, BD]
        m_i, l_i, acc = softmax_step(scores, m_i, l_i, acc, v, FP32_DOT, False)
    return m_i, l_i, acc


@triton.jit
def merge_splits(part_out_ptr, part_lse_ptr, row0, mask_g, used, offs_d, mask_d,
                 HEAD_DIM: tl.constexpr, MERGE_SPLITS: tl.constexpr):
    """The output [BG, BD] fp32 of the query heads whose partials start at workspace rows row0 [BG] (split p at
    row row0 + p: out at row * HEAD_DIM + d, lse at row), mask_g their real rows. Splits [0, used) hold the
    visible tokens (the others stored nothing); merged with weights 2^(lse - max lse), MERGE_SPLITS at a time
    with a running max, finite from the first chunk on (it starts at a split with tokens). Loads bypass L1 (.cg):
    the other programs' partials are in L2."""
    m = tl.full((row0.shape[0],), float("-inf"), dtype=tl.float32)
    total = tl.zeros((row0.shape[0],), dtype=tl.float32)
    acc = tl.zeros((row0.shape[0], offs_d.shape[0]), dtype=tl.float32)
    for p0 in range(0, used, MERGE_SPLITS):
        splits = p0 + tl.arange(0, MERGE_SPLITS)  # [BP]
        mask_gp = mask_g[:, None] & (splits < used)[None, :]  # [BG, BP]
        rows = row0[:, None] + splits[None, :]  # [BG, BP]
        lse = tl.load(part_lse_ptr + rows, mask=mask_gp, other=float("-inf"), cache_modifier=".cg")
        lse = tl.where(mask_g[:, None], lse, 0.0)  # padding rows: finite, their (masked) output 0
        part = tl.load(part_out_ptr + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :],  # [BG, BP, BD]
                       mask=mask_gp[:, :, None] & mask_d[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=1))  # [BG]
        alpha = tl.exp2(m - m_new)  # 0 on the first chunk
        weight = tl.exp2(lse - m_new[:, None])  # [BG, BP], 0 for masked splits
        acc = acc * alpha[:, None] + tl.sum(weight[:, :, None] * part, axis=1)
        total = total * alpha + tl.sum(weight, axis=1)
        m = m_new
    return acc / total[:, None]


@triton.jit
def _decode_kernel(
    q_ptr,  # [S, Hq, D]
    k_ptr, v_ptr,  # [num_blocks, block_size, Hkv, D], head_dim stride 1
    bt_ptr,  # int32 [S, max_blocks]
    lens_ptr,  # int32 [S]
    out_ptr,  # [S, Hq, D]
    part_out_ptr,  # fp32 [S, Hq, NUM_SPLITS, D] (NUM_SPLITS > 1; workspace)
    part_lse_ptr,  # fp32 [S, Hq, NUM_SPLITS] (NUM_SPLITS > 1; workspace), log2 units
    cnt_ptr,  # int32 [S, Hkv] arrival counters (NUM_SPLITS > 1), all zero on entry and on exit
    qk_scale, cap_log2,  # softmax scale * log2(e), or with SOFTCAP scale / cap and cap * log2(e) (kv_tile)
    window,  # keys the query sees, itself included (WINDOWED)
    min_partition,  # the fewest tokens a split takes (a multiple of BLOCK_N)
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, FP32_DOT: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_SIZE: tl.constexpr,  # the cache's tokens per block
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr, MERGE_SPLITS: tl.constexpr,  # the merge's tile [BLOCK_G heads, MERGE_SPLITS, BLOCK_D]
):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + s)
    # the visible keys [first, seq_len) in NUM_SPLITS partitions of whole tiles, none under min_partition: sized by
    # this sequence's length, not the block table's width (the engine's tables span max_model_len)
    first = visible_start(seq_len, window, WINDOWED)
    partition = tl.maximum(tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N, min_partition)
    t_begin = first + split * partition
    t_end = tl.minimum(t_begin + partition, seq_len)  # empty range for splits past the visible keys

    offs_h = kvh * GROUP + tl.arange(0, BLOCK_H)  # [BH] query heads of this kv head (rows >= GROUP are padding)
    mask_h = tl.arange(0, BLOCK_H) < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    # q (s, h, d) at q_ptr + s * stride_qs + h * stride_qh + d
    q = tl.load(q_ptr + s * stride_qs + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BH, BD]
    m_i, l_i, acc = attend(q, k_ptr, v_ptr, bt_ptr + s * stride_bt, t_begin, t_end, offs_d, mask_d,
                           kvh.to(tl.int64) * stride_kh, BLOCK_SIZE, stride_kb, stride_ks, qk_scale, cap_log2,
                           SOFTCAP, FP32_DOT, BLOCK_N)

    if NUM_SPLITS == 1:
        tl.store(out_ptr + s * stride_os + offs_h[:, None] * stride_oh + offs_d[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
    else:
        # partials (s, h, split, d) at ((s * Hq + h) * NUM_SPLITS + split) * HEAD_DIM + d, lse at the row
        hq = tl.num_programs(1) * GROUP
        if t_begin < t_end:  # an empty split (past the context, or behind the window) stores nothing: unread
            row = (s * hq + offs_h) * NUM_SPLITS + split  # [BH]
            tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None],
                     mask=mask_h[:, None] & mask_d[None, :])
            tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=mask_h)
        tl.debug_barrier()  # every thread's partial is stored before the counter is bumped (release below)
        counter = cnt_ptr + s * tl.num_programs(1) + kvh
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == NUM_SPLITS - 1:  # the last split of (s, kvh) to finish merges the group's splits
            offs_g = tl.arange(0, BLOCK_G)
            mask_g = offs_g < GROUP
            heads = kvh * GROUP + offs_g  # [BG]
            out = merge_splits(part_out_ptr, part_lse_ptr, (s * hq + heads) * NUM_SPLITS, mask_g,
                               tl.cdiv(seq_len - first, partition), offs_d, mask_d, HEAD_DIM,
                               MERGE_SPLITS)  # [BG, BD]
            tl.store(out_ptr + s * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
            tl.atomic_xchg(counter, 0)


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


def _splits_to_fill(num_seqs: int, num_kv_heads: int, device) -> int:
    """Splits per sequence so S * Hkv * splits is about PROGRAMS_PER_SM x the SM count (1 off CUDA: the
    interpreter); an upper bound of decode_splits' default."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return triton.cdiv(PROGRAMS_PER_SM * sms, num_seqs * num_kv_heads)


def decode_splits(num_seqs: int, num_kv_heads: int, max_tokens: int, block_n: int, device,
                  num_splits: int | None = None) -> tuple[int, int]:
    """(splits, min_partition) of a launch over block tables of max_tokens tokens. Splits: `num_splits`, by default
    _splits_to_fill but no more than leave each split MIN_TILES_PER_SPLIT tiles of block_n tokens, and never more
    than the table has tiles. The kernel cuts each sequence's visible keys into that many partitions of whole tiles,
    none shorter than min_partition tokens (MIN_TILES_PER_SPLIT tiles by default; one tile for an explicit count)."""
    tiles = triton.cdiv(max_tokens, block_n)
    if num_splits is None:
        fill = _splits_to_fill(num_seqs, num_kv_heads, device)
        return max(1, min(fill, tiles // MIN_TILES_PER_SPLIT)), MIN_TILES_PER_SPLIT * block_n
    return max(1, min(num_splits, tiles)), block_n


def decode_workspace_size(num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                          num_splits: int) -> tuple[int, int]:
    """(fp32 elements, int32 counters) one launch uses: partial outputs [S, Hq, splits, D], then their log-sum-exps
    [S, Hq, splits]; a counter per (sequence, kv head). (0, 0) with one split."""
    if num_splits == 1:
        return 0, 0
    return num_seqs * num_q_heads * num_splits * (head_dim + 1), num_seqs * num_kv_heads


DECODE_WORKSPACES = SplitWorkspaces()


def reserve_decode_workspace(device, max_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Grow `device`'s decode workspace to fit every launch of up to max_seqs sequences at the default split count,
    whatever the context (_splits_to_fill bounds it). Call at load time, outside CUDA-graph capture;
    paged_attention_decode grows it as well (direct calls, explicit num_splits), which must not happen in capture."""
    device = torch.device(device)
    sizes = [decode_workspace_size(s, num_q_heads, num_kv_heads, head_dim, _splits_to_fill(s, num_kv_heads, device))
             for s in range(1, max_seqs + 1)]
    DECODE_WORKSPACES.reserve(device, max(f for f, _ in sizes), max(c for _, c in sizes))


def _split_buffers(device, num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int, num_splits: int):
    """One launch's views of the device's workspace (grown if needed): partial outputs, log-sum-exps (fp32, flat;
    layout in decode_workspace_size) and counters (int32 [S * Hkv])."""
    floats, counters = decode_workspace_size(num_seqs, num_q_heads, num_kv_heads, head_dim, num_splits)
    ws, cnt = DECODE_WORKSPACES.reserve(device, floats, counters)
    partials = num_seqs * num_q_heads * num_splits * head_dim
    return ws[:partials], ws[partials:floats], cnt[:counters]


def merge_step(num_splits: int, block_g: int, block_d: int) -> int:
    """Splits the merging program loads at once: a [block_g heads, splits, block_d] fp32 tile of <= MERGE_TILE."""
    return min(triton.next_power_of_2(num_splits), max(1, MERGE_TILE // (block_g * block_d)))


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
    scale defaults to 1/sqrt(D); num_splits (context partitions) defaults to decode_splits' choice.
    """
    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    assert window >= 0, f"window {window}: 0 (none) or the keys a query sees"
    num_seqs, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    assert q.shape[0] == block_tables.shape[0], "one query token per sequence"
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    num_splits, min_partition = decode_splits(num_seqs, hkv, block_tables.shape[1] * block_size, block_n, q.device,
                                              num_splits)
    out = torch.empty_like(q)
    splits = (out, out, out) if num_splits == 1 else _split_buffers(q.device, num_seqs, hq, hkv, d, num_splits)
    block_d = triton.next_power_of_2(d)
    block_g = triton.next_power_of_2(group)
    qk_scale, cap_log2 = softcap_scales(scale, softcap)
    _decode_kernel[(num_seqs, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, *splits,
        qk_scale, cap_log2, window, min_partition,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=d, NUM_SPLITS=num_splits, FP32_DOT=fp32_dot(q.dtype),
        WINDOWED=window > 0, SOFTCAP=softcap > 0, BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        BLOCK_G=block_g, MERGE_SPLITS=merge_step(num_splits, block_g, block_d),
        num_warps=attention_warps(block_d), num_stages=DECODE_STAGES,
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

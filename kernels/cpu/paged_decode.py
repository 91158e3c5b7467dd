"""Paged decode attention on CPU (paged_decode.c, built once by build.py, loaded with ctypes).

One query token per sequence reads its K/V straight from the paged cache through the block table: no gather
copy, no padding. Work item = (sequence, kv head): the G query heads sharing that kv head stream the context in
tiles of 16 tokens with an online softmax in fp32; items are spread over torch's OpenMP threads (the .so links the
same libgomp torch loaded). `load_decode_kernel` is None when no compiler works (and the torch path runs).

`paged_rows` is the same item for any query row: row r names its sequence (row_seqs[r], a row of block_tables) and
its length (row_lens[r] = its position + 1, causal), so decode rows, the rows of a prefill chunk (fresh or after a
cached prefix) and speculative verify rows all run one code path, and a row's output is bit-identical whatever else
the call holds (batch-invariant serving, serve/attention.py). It also takes a layer's AttentionSpec: a sliding
window (the row reads its last `window` positions, in tiles at multiples of 16, the first partial) and a logit
soft-cap (cap * tanh(score / cap) before the softmax, fp32 throughout, where the masked torch path rounds P to the
dtype).
Every build (AVX-512 BF16, AVX-512, AVX2, plain C) gives an item up to 8 consecutive rows of one sequence (a
prefill chunk's), which share each K/V tile, each row computed as it would be alone (BENCHMARKS.md, eighteenth
session: one row per item on AVX-512 made a chunked prefill over a cached prefix slower than SDPA).
Precondition the launchers do not check (it would read the tables): each length <= MB * block_size and every
table entry it reaches a block of the cache.
"""

from __future__ import annotations

import ctypes

import torch

from quantkit.kernels.cpu.build import DTYPE_CODES, load_library
from quantkit.kernels.cpu.paged_prefill import paged_prefill_ref

MAX_HEAD_DIM, MAX_GROUP = 256, 16  # paged_decode.c's MAXD, MAXG
SIGNATURE = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
ROWS_SIGNATURE = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_float] \
    + [ctypes.c_int] * 2


def _library():
    return load_library("paged_decode", {"paged_decode": SIGNATURE, "paged_rows": ROWS_SIGNATURE})


def load_decode_kernel():
    """The compiled paged_decode function, or None when it cannot be built here."""
    lib = _library()
    return None if lib is None else lib.paged_decode


def load_rows_kernel():
    """The compiled paged_rows function, or None when it cannot be built here."""
    lib = _library()
    return None if lib is None else lib.paged_rows


def _check(q, k_cache, v_cache, out, lens, name: str) -> None:
    """What paged_decode.c reads: contiguous tensors of one dtype, D <= 256, G = Hq / Hkv <= 16, and int32
    lengths [R] (R = q's rows)."""
    shape, cache = q.shape, k_cache.shape
    if len(shape) != 3 or len(cache) != 4 or out.shape != shape or v_cache.shape != cache or shape[2] != cache[3]:
        raise ValueError(f"{name}: q/out [S, Hq, D], k/v_cache [NB, BS, Hkv, D]; got q {tuple(shape)}, out "
                         f"{tuple(out.shape)}, k_cache {tuple(cache)}, v_cache {tuple(v_cache.shape)}")
    num_rows, hq, d = shape
    hkv = cache[2]
    dtype = q.dtype
    if k_cache.dtype is not dtype or v_cache.dtype is not dtype or out.dtype is not dtype or dtype not in DTYPE_CODES:
        raise ValueError(f"{name}: q, caches and out of one dtype among {list(DTYPE_CODES)}; got {dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}, {out.dtype}")
    if not (q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{name}: q, out and the caches must be contiguous")
    if d > MAX_HEAD_DIM or hq % hkv or hq // hkv > MAX_GROUP:
        raise ValueError(f"{name}: head_dim <= {MAX_HEAD_DIM} and Hq a multiple of Hkv at most {MAX_GROUP} "
                         f"times it; got D {d}, Hq {hq}, Hkv {hkv}")
    if lens.dtype is not torch.int32 or lens.shape != (num_rows,) or not lens.is_contiguous():
        raise ValueError(f"{name}: lengths int32 [{num_rows}] contiguous; got {lens.dtype} {tuple(lens.shape)}")


def _check_tables(block_tables, num_seqs: int | None, name: str) -> None:
    """block_tables int32 [S, MB] contiguous (S = num_seqs unless None)."""
    tables = block_tables.shape
    if block_tables.dtype is not torch.int32 or len(tables) != 2 or not block_tables.is_contiguous() \
            or (num_seqs is not None and tables[0] != num_seqs):
        raise ValueError(f"{name}: block_tables int32 [S, MB] contiguous{f', S = {num_seqs}' if num_seqs else ''}; "
                         f"got {block_tables.dtype} {tuple(tables)}")


# paged_decode - q [S, Hq, D] x k/v_cache [NB, BS, Hkv, D] (fp32/bf16/fp16, contiguous), block_tables int32
#                [S, MB], seq_lens int32 [S] -> out [S, Hq, D] (written in place), q's dtype
def paged_decode(fn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """out = attention of each sequence's one query over tokens [0, seq_lens[s]) of its cache (fn: the kernel)."""
    _check(q, k_cache, v_cache, out, seq_lens, "paged_decode")
    _check_tables(block_tables, q.shape[0], "paged_decode")
    num_seqs, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
       out.data_ptr(), num_seqs, hq, hkv, d, block_size, block_tables.shape[1], scale, DTYPE_CODES[q.dtype],
       torch.get_num_threads())


# paged_decode_ref - the same arguments (no out) -> [S, Hq, D] fp32
def paged_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """Plain torch: each sequence's query is the last of its seq_lens[s] positions, so decode is the prefill
    reference with one query per sequence."""
    one_each = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_prefill_ref(q, k_cache, v_cache, block_tables, one_each, seq_lens, scale)


# paged_rows - q [R, Hq, D] x k/v_cache [NB, BS, Hkv, D] (fp32/bf16/fp16, contiguous), block_tables int32 [S, MB],
#              row_seqs int32 [R] in [0, S), row_lens int32 [R] >= 1 -> out [R, Hq, D] (written in place), q's dtype
def paged_rows(fn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               row_seqs: torch.Tensor, row_lens: torch.Tensor, scale: float, out: torch.Tensor,
               window: int | None = None, softcap: float | None = None) -> None:
    """out[r] = attention of query row r over tokens [0, row_lens[r]) of sequence row_seqs[r] (the last `window`
    of them with a window; scores soft-capped with softcap) (fn: the kernel)."""
    _check(q, k_cache, v_cache, out, row_lens, "paged_rows")
    _check_tables(block_tables, None, "paged_rows")
    num_rows, hq, d = q.shape
    if row_seqs.dtype is not torch.int32 or row_seqs.shape != (num_rows,) or not row_seqs.is_contiguous():
        raise ValueError(f"paged_rows: row_seqs int32 [{num_rows}] contiguous; got {row_seqs.dtype} "
                         f"{tuple(row_seqs.shape)}")
    _, block_size, hkv, _ = k_cache.shape
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), row_seqs.data_ptr(),
       row_lens.data_ptr(), out.data_ptr(), num_rows, hq, hkv, d, block_size, block_tables.shape[1], scale,
       window or 0, softcap or 0.0, DTYPE_CODES[q.dtype], torch.get_num_threads())


# paged_rows_ref - the same arguments (no out) -> [R, Hq, D] fp32
def paged_rows_ref(q, k_cache, v_cache, block_tables, row_seqs, row_lens, scale, window=None,
                   softcap=None) -> torch.Tensor:
    """Plain torch, fp32: row r attends the positions p of its sequence with p < row_lens[r] (and
    p >= row_lens[r] - window), scores scaled, then soft-capped, then softmax."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    block_size, group = k_cache.shape[1], q.shape[1] // hkv
    out = torch.empty(q.shape)
    for r in range(q.shape[0]):
        n = int(row_lens[r])
        lo = max(0, n - window) if window else 0
        blocks = block_tables[int(row_seqs[r]), : -(-n // block_size)].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[lo:n].float().repeat_interleave(group, dim=1)  # [n - lo, Hq, D]
        v = v_cache[blocks].reshape(-1, hkv, d)[lo:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[r].float(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out[r] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
    return out

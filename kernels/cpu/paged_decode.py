"""Paged decode attention on CPU (paged_decode.c, built once by build.py, loaded with ctypes).

One query token per sequence reads its K/V straight from the paged cache through the block table: no gather
copy, no padding. Work item = (sequence, kv head): the G query heads sharing that kv head stream the context in
tiles of 16 tokens with an online softmax in fp32; items are spread over torch's OpenMP threads (the .so links the
same libgomp torch loaded). `load_decode_kernel` is None when no compiler works (and the torch path runs).
Precondition the launcher does not check (it would read the tables): seq_lens[s] <= MB * block_size and every
table entry a block of the cache.
"""

from __future__ import annotations

import ctypes

import torch

from quantkit.kernels.cpu.build import DTYPE_CODES, load_library
from quantkit.kernels.cpu.paged_prefill import paged_prefill_ref

MAX_HEAD_DIM, MAX_GROUP = 256, 16  # paged_decode.c's MAXD, MAXG
SIGNATURE = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]


def load_decode_kernel():
    """The compiled paged_decode function, or None when it cannot be built here."""
    lib = load_library("paged_decode", {"paged_decode": SIGNATURE})
    return None if lib is None else lib.paged_decode


def _check(q, k_cache, v_cache, block_tables, seq_lens, out) -> None:
    """What paged_decode.c reads: contiguous tensors of one dtype, D <= 256, G = Hq / Hkv <= 16, int32 tables."""
    shape, cache = q.shape, k_cache.shape
    if len(shape) != 3 or len(cache) != 4 or out.shape != shape or v_cache.shape != cache or shape[2] != cache[3]:
        raise ValueError(f"paged_decode: q/out [S, Hq, D], k/v_cache [NB, BS, Hkv, D]; got q {tuple(shape)}, out "
                         f"{tuple(out.shape)}, k_cache {tuple(cache)}, v_cache {tuple(v_cache.shape)}")
    num_seqs, hq, d = shape
    hkv = cache[2]
    dtype = q.dtype
    if k_cache.dtype is not dtype or v_cache.dtype is not dtype or out.dtype is not dtype or dtype not in DTYPE_CODES:
        raise ValueError(f"paged_decode: q, caches and out of one dtype among {list(DTYPE_CODES)}; got {dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}, {out.dtype}")
    if not (q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_decode: q, out and the caches must be contiguous")
    if d > MAX_HEAD_DIM or hq % hkv or hq // hkv > MAX_GROUP:
        raise ValueError(f"paged_decode: head_dim <= {MAX_HEAD_DIM} and Hq a multiple of Hkv at most {MAX_GROUP} "
                         f"times it; got D {d}, Hq {hq}, Hkv {hkv}")
    tables = block_tables.shape
    if block_tables.dtype is not torch.int32 or seq_lens.dtype is not torch.int32 or len(tables) != 2 \
            or tables[0] != num_seqs or seq_lens.shape != (num_seqs,) or not block_tables.is_contiguous() \
            or not seq_lens.is_contiguous():
        raise ValueError(f"paged_decode: block_tables int32 [S, MB] and seq_lens int32 [S] contiguous, S = {num_seqs}; "
                         f"got {block_tables.dtype} {tuple(tables)}, {seq_lens.dtype} {tuple(seq_lens.shape)}")


# paged_decode - q [S, Hq, D] x k/v_cache [NB, BS, Hkv, D] (fp32/bf16/fp16, contiguous), block_tables int32
#                [S, MB], seq_lens int32 [S] -> out [S, Hq, D] (written in place), q's dtype
def paged_decode(fn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """out = attention of each sequence's one query over tokens [0, seq_lens[s]) of its cache (fn: the kernel)."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, out)
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

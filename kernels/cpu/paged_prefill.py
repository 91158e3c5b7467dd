"""Paged prefill attention on CPU with AMX tiles (paged_prefill.c, built once by build.py): every prefill chunk of
a step in one call, reading K/V straight from the paged cache, causal over each sequence's whole context.

Work item = (sequence, kv head), spread over torch's OpenMP threads. Per item, into thread scratch:
  kt  K rows [0, L) as VNNI B tiles of S = Q K^T: per 16-key block, element (r, n) = K[16kb + n][2r, 2r + 1]
  vv  V as VNNI B tiles of O = P V: per 32-key block and 16-wide d slice, element (r, n) = V[32kb + 2r, +1][d n]
Then for each of the G query heads and each block of 16 query tokens:
  S [16, keys] fp32 = Q K^T on tiles (tile 0 accumulates, tile 1 holds K, tiles 4.. hold Q's 32-wide d chunks),
  only over the key blocks the block's last query can see; softmax per row in fp32 (scale, causal limit
  past + i + 1 keys for query i, exp16), P rounded to bf16 (as SDPA rounds P before its PV matmul);
  O [16, D] = P V on tiles (tiles 0-3 accumulate a 64-wide d slice, tile 4 holds P, tile 5 holds V), / row sums.
So no online rescaling: a row's whole score vector is in L2 (16 x 8192 keys = 512 KiB at most). D must be 64 or
128 and the dtype bf16; `load_prefill_kernel` is None without AMX (and the torch path runs).
"""

from __future__ import annotations

import ctypes

import torch

from quantkit.kernels.cpu.build import load_library

_P, _INT, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SIGNATURE = [_P, _I64, _P, _P, _P, _INT, _P, _P, _P, _I64] + [_INT] * 5 + [ctypes.c_float, _INT]
HEAD_DIMS = (64, 128)


def load_prefill_kernel():
    """The compiled paged_prefill function, or None without AMX (CPU flags, kernel permission or compiler)."""
    from quantkit.kernels.cpu import gemm as cpu_gemm

    if not cpu_gemm.available():  # the same AMX checks (and the tile permission, asked once per process)
        return None
    lib = load_library("paged_prefill", {"paged_prefill": SIGNATURE})
    return None if lib is None else lib.paged_prefill


def supports(k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this cache [NB, BS, Hkv, D]: bf16, head_dim 64 or 128, contiguous."""
    return k_cache.dtype == torch.bfloat16 and k_cache.shape[-1] in HEAD_DIMS and k_cache.is_contiguous()


def _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out) -> None:
    """What paged_prefill.c reads: bf16 caches of head_dim 64/128, q and out with each token's heads contiguous
    (tokens at any stride), int32 tables."""
    cache = k_cache.shape
    if len(cache) != 4 or v_cache.shape != cache or not supports(k_cache) or not v_cache.is_contiguous() \
            or v_cache.dtype is not torch.bfloat16:
        raise ValueError(f"paged_prefill: k/v_cache bf16 [NB, BS, Hkv, D in {HEAD_DIMS}] contiguous; got "
                         f"{tuple(cache)} {k_cache.dtype}, {tuple(v_cache.shape)} {v_cache.dtype}")
    hkv, d = cache[2], cache[3]
    shape = q.shape
    for name, t in (("q", q), ("out", out)):
        if t.dtype is not torch.bfloat16 or t.shape != shape or len(shape) != 3 or shape[2] != d or shape[1] % hkv \
                or t.stride()[1:] != (d, 1):
            raise ValueError(f"paged_prefill: {name} bf16 [T, Hq, {d}] like q, Hq a multiple of {hkv}, heads "
                             f"contiguous within a token; got {tuple(t.shape)} {t.dtype} strides {t.stride()}")
    num_seqs = seq_lens.shape[0]
    if block_tables.dtype is not torch.int32 or query_start_loc.dtype is not torch.int32 \
            or seq_lens.dtype is not torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs \
            or query_start_loc.shape != (num_seqs + 1,) or seq_lens.dim() != 1 or not block_tables.is_contiguous() \
            or not query_start_loc.is_contiguous() or not seq_lens.is_contiguous():
        raise ValueError(f"paged_prefill: block_tables int32 [S, MB], query_start_loc int32 [S + 1], seq_lens int32 "
                         f"[S], contiguous; got {block_tables.dtype} {tuple(block_tables.shape)}, "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}, {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")


# paged_prefill - q [T, Hq, D] bf16 (token stride free) x k/v_cache [NB, BS, Hkv, D] bf16, block_tables int32
#                 [S, MB], query_start_loc int32 [S + 1], seq_lens int32 [S] -> out [T, Hq, D] bf16 (in place)
def paged_prefill(fn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """out = causal attention of q (sequence s's queries are rows query_start_loc[s] .. query_start_loc[s + 1],
    the last of its seq_lens[s] positions) over each sequence's paged cache (fn: the kernel)."""
    _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out)
    num_seqs = seq_lens.shape[0]
    _, block_size, hkv, d = k_cache.shape
    fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
       block_tables.shape[1], query_start_loc.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), out.stride(0),
       num_seqs, q.shape[1], hkv, d, block_size, scale, torch.get_num_threads())


# paged_prefill_ref - the same arguments (no out) -> [T, Hq, D] fp32
def paged_prefill_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale) -> torch.Tensor:
    """Plain torch, fp32: each sequence's queries (the last positions of its context) attend causally over its
    cached keys (gathered through its block table)."""
    hq, d = q.shape[1], q.shape[2]
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape)
    for s in range(len(seq_lens)):
        n, a, b = int(seq_lens[s]), int(query_start_loc[s]), int(query_start_loc[s + 1])
        rows = block_tables[s, : -(-n // block_size)].long()
        k = k_cache[rows].reshape(-1, hkv, d)[:n].float().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v_cache[rows].reshape(-1, hkv, d)[:n].float().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * scale
        positions = torch.arange(b - a)[:, None] + (n - (b - a))  # [q, 1]
        scores = scores.masked_fill(torch.arange(n)[None, :] > positions, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out

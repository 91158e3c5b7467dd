"""Paged KV-cache kernels (kv_store, decode attention, chunked-prefill attention) against torch references.

Runs the Triton kernels under TRITON_INTERPRET=1 on CPU (tests/kernels/triton_env.py); with a GPU and
TRITON_INTERPRET=0 the same tests run compiled on CUDA. The references gather K/V through the block table and
are themselves checked against torch's scaled_dot_product_attention on the unpaged K/V.

Block tables are random permutations of a pool with spare blocks (never contiguous, never in order); contexts
include 1, block_size - 1, block_size and block_size + 1 tokens; GQA ratios 1, 3 and 8.
Tolerances: probabilities and P @ V run on fp16/bf16 operands with fp32 accumulation; outputs are O(1):
  fp16 rtol 2e-3 atol 4e-3,  bf16 rtol 1.6e-2 atol 3e-2 (the probabilities are rounded to bf16 for P @ V).
"""

from __future__ import annotations

from tests.kernels.triton_env import DEVICE  # first: sets TRITON_INTERPRET before triton loads

import pytest
import torch
import torch.nn.functional as F

from quantkit.kernels.triton import kv_store, paged_attention, paged_prefill

TOL = {torch.float16: dict(rtol=2e-3, atol=4e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=3e-2)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
BS = 16  # block size of the caches below


class PagedCache:
    """Random K/V of several sequences written through kv_store into a shuffled block pool."""

    def __init__(self, lens, num_kv_heads, head_dim, dtype, block_size=BS, seed=0):
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = [-(-n // block_size) for n in lens]
        pool = sum(blocks_per_seq) + 3  # spare blocks stay garbage
        order = torch.randperm(pool, generator=gen)
        self.block_tables = torch.zeros(len(lens), max(blocks_per_seq) + 1, dtype=torch.int32)
        used = 0
        for s, nb in enumerate(blocks_per_seq):
            self.block_tables[s, :nb] = order[used:used + nb].to(torch.int32)
            used += nb
        shape = (pool, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
        self.v_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
        self.keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype) for n in lens]
        self.values = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype) for n in lens]
        self.block_tables = self.block_tables.to(DEVICE)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        slots = torch.cat([self.slots(s, 0, n) for s, n in enumerate(lens)])
        kv_store.kv_store(torch.cat(self.keys), torch.cat(self.values), self.k_cache, self.v_cache, slots)

    def slots(self, seq: int, first: int, last: int) -> torch.Tensor:
        """int64 slots of tokens first..last-1 of sequence `seq` (docs/CONTRACTS.md formula)."""
        t = torch.arange(first, last, device=DEVICE)
        block_size = self.k_cache.shape[1]
        return self.block_tables[seq].long()[t // block_size] * block_size + t % block_size


def sdpa(q, k, v, first_pos):
    """torch SDPA on unpaged K/V: q [L, Hq, D] at positions first_pos.., k/v [T, Hkv, D] -> [L, Hq, D] fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, T, D]
    v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    visible = torch.arange(k.shape[1], device=q.device)[None, :] <= first_pos + torch.arange(q.shape[0],
                                                                                          device=q.device)[:, None]
    return F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=visible).transpose(0, 1)


# splits per decode launch: direct write; two, three (some of a short sequence's splits empty); more than the
# block table has tiles (the launcher keeps one split per tile: most splits of a short sequence are empty)
DECODE_SPLITS = (1, 2, 3, 8)


def decode_checked(*args, **kwargs) -> torch.Tensor:
    """paged_attention_decode, then its invariant: every arrival counter of the device is back to zero."""
    out = paged_attention.paged_attention_decode(*args, **kwargs)
    _, counters = paged_attention.DECODE_WORKSPACES.reserve(out.device, 0, 0)
    assert not counters.any(), f"arrival counters left at {counters.nonzero().flatten().tolist()}"
    return out


def test_kv_store_matches_reference_with_padding_and_strides():
    gen = torch.Generator().manual_seed(1)
    cache = PagedCache([5, 17], num_kv_heads=3, head_dim=40, dtype=torch.float16)
    qkv = torch.randn(6, 3 * 3 * 40 + 8, generator=gen).to(DEVICE, torch.float16)  # k/v are strided views
    k = qkv[:, :120].view(6, 3, 40)
    v = qkv[:, 128:248].view(6, 3, 40)
    slots = torch.cat([cache.slots(0, 5, 8), torch.tensor([-1], device=DEVICE), cache.slots(1, 17, 19)])
    k_ref, v_ref = cache.k_cache.clone(), cache.v_cache.clone()
    kv_store.kv_store_ref(k, v, k_ref, v_ref, slots)
    kv_store.kv_store(k, v, cache.k_cache, cache.v_cache, slots)
    assert torch.equal(cache.k_cache, k_ref) and torch.equal(cache.v_cache, v_ref)
    assert torch.equal(k_ref[slots[0] // BS, slots[0] % BS], k[0])  # the reference writes where the contract says


# (lens, Hq, Hkv, D): contexts 1, BS-1, BS, BS+1 and a multi-block one; GQA ratios 8, 3, 1; D not a power of 2
DECODE_CASES = {
    "gqa8": ([1, BS - 1, BS, BS + 1, 3 * BS + 5], 8, 1, 32),
    "gqa3": ([BS + 1, 1, 2 * BS], 6, 2, 64),
    "mha-d40": ([BS - 1, 40], 3, 3, 40),
}


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
def test_decode_matches_reference(case, dtype):
    lens, hq, hkv, d = DECODE_CASES[case]
    cache = PagedCache(lens, hkv, d, dtype)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens)
    ref = paged_attention.paged_attention_decode_ref(*args)
    for s, n in enumerate(lens):  # the reference is plain attention over the unpaged K/V
        torch.testing.assert_close(ref[s].float(), sdpa(q[s:s + 1], cache.keys[s], cache.values[s], n - 1)[0],
                                   **TOL[dtype])
    for num_splits in DECODE_SPLITS:
        out = decode_checked(*args, num_splits=num_splits, block_n=16)
        torch.testing.assert_close(out, ref, **TOL[dtype], msg=lambda m: f"{num_splits} splits: {m}")


def test_default_split_count_fills_the_gpu_with_long_splits(monkeypatch):
    """decode_splits: enough splits to fill the GPU, but none shorter than MIN_TILES_PER_SPLIT tiles; an explicit
    count keeps at most one split per tile. (_splits_to_fill stands in for an SM count: off CUDA it is 1.)"""
    monkeypatch.setattr(paged_attention, "_splits_to_fill", lambda num_seqs, num_kv_heads, device: 33)
    tiles = paged_attention.MIN_TILES_PER_SPLIT
    splits = lambda tokens, n=None: paged_attention.decode_splits(1, 8, tokens, 64, DEVICE, n)  # noqa: E731
    assert splits(8192) == (8192 // (64 * tiles), 64 * tiles)  # the tile floor binds
    assert splits(64 * 160) == (33, 64 * tiles)  # the fill binds
    assert splits(64 * tiles - 1) == (1, 64 * tiles)  # a short table: one split
    assert splits(80, 8) == (2, 64)  # explicit: 8 splits asked, 2 tiles


def test_splits_follow_the_sequence_not_the_table():
    """Partitions are cut from each sequence's visible keys, not from the block table's width: a short sequence in
    a wide table (the engine's span max_model_len), with and without a window, merged from the splits it uses."""
    hq, hkv, d = 4, 2, 32
    cache = PagedCache([3 * BS + 1, 9 * BS + 7], hkv, d, torch.float16, seed=41)
    wide = torch.zeros((2, 4 * cache.block_tables.shape[1]), dtype=torch.int32, device=DEVICE)
    wide[:, :cache.block_tables.shape[1]] = cache.block_tables
    q = torch.randn(2, hq, d, generator=torch.Generator().manual_seed(41)).to(DEVICE, torch.float16)
    for window in (0, 2 * BS + 3):
        args = (q, cache.k_cache, cache.v_cache, wide, cache.seq_lens)
        ref = paged_attention.paged_attention_decode_ref(*args, window=window)
        for num_splits in (3, 7):
            out = decode_checked(*args, window=window, num_splits=num_splits, block_n=16)
            torch.testing.assert_close(out, ref, **TOL[torch.float16], msg=lambda m: f"{num_splits} splits: {m}")


def test_reserved_workspace_covers_every_default_launch(monkeypatch):
    """reserve_decode_workspace (the engine's, at load time) sizes the workspace for every batch up to max_seqs at
    the default split count: no launch grows it (growing it during CUDA-graph capture would break the graph)."""
    monkeypatch.setattr(paged_attention, "DECODE_WORKSPACES", paged_attention.SplitWorkspaces())
    monkeypatch.setattr(paged_attention, "MIN_TILES_PER_SPLIT", 1)
    monkeypatch.setattr(paged_attention, "_splits_to_fill",
                        lambda num_seqs, num_kv_heads, device: -(-12 // (num_seqs * num_kv_heads)))
    hq, hkv, d, max_seqs = 4, 2, 32, 3
    paged_attention.reserve_decode_workspace(DEVICE, max_seqs, hq, hkv, d)
    reserved = paged_attention.DECODE_WORKSPACES.reserve(DEVICE, 0, 0)
    for num_seqs in range(1, max_seqs + 1):  # 6 tiles of 16 tokens: 6, 3 and 2 splits
        cache = PagedCache([5 * BS - 3 * s for s in range(num_seqs)], hkv, d, torch.float16, seed=30 + num_seqs)
        q = torch.randn(num_seqs, hq, d, generator=torch.Generator().manual_seed(num_seqs)).to(DEVICE, torch.float16)
        args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens)
        torch.testing.assert_close(decode_checked(*args, block_n=16), paged_attention.paged_attention_decode_ref(*args),
                                   **TOL[torch.float16])
        assert all(a is b for a, b in zip(paged_attention.DECODE_WORKSPACES.reserve(DEVICE, 0, 0), reserved))


# (cached tokens before the chunk, chunk length) per sequence: fresh prefill, chunks after 1 / BS-1 / BS+1 cached
# tokens, a one-token (decode-like) chunk
PREFILL_CASES = {
    "gqa3": ([(0, 20), (BS - 1, 6), (BS + 1, 1)], 6, 2, 32),
    "gqa8": ([(1, BS + 1), (0, 1), (2 * BS, 9)], 8, 1, 32),
    "mha-d40": ([(BS, BS), (3, 4)], 2, 2, 40),
}


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", list(PREFILL_CASES), ids=list(PREFILL_CASES))
def test_prefill_matches_reference(case, dtype):
    chunks, hq, hkv, d = PREFILL_CASES[case]
    lens = [ctx + n for ctx, n in chunks]
    cache = PagedCache(lens, hkv, d, dtype, seed=3)
    q_lens = [n for _, n in chunks]
    query_start_loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.seq_lens)
    ref = paged_prefill.paged_attention_prefill_ref(*args)
    for s, (ctx, n) in enumerate(chunks):
        lo = int(query_start_loc[s])
        torch.testing.assert_close(ref[lo:lo + n].float(), sdpa(q[lo:lo + n], cache.keys[s], cache.values[s], ctx),
                                   **TOL[dtype])
    out = paged_prefill.paged_attention_prefill(*args, max_query_len=max(q_lens), block_m=16, block_n=16)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_decode_equals_one_token_prefill():
    cache = PagedCache([BS + 1, 7], 2, 32, torch.float16, seed=5)
    q = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.float16)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    decode = decode_checked(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, num_splits=2,
                            block_n=16)
    prefill = paged_prefill.paged_attention_prefill(q, cache.k_cache, cache.v_cache, cache.block_tables, qsl,
                                                    cache.seq_lens, max_query_len=1, block_m=16, block_n=16)
    torch.testing.assert_close(decode, prefill, **TOL[torch.float16])

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
    for num_splits in (1, 3):  # direct write, and flash-decoding partials + merge (some splits empty)
        out = paged_attention.paged_attention_decode(*args, num_splits=num_splits, block_n=16)
        torch.testing.assert_close(out, ref, **TOL[dtype])


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
    decode = paged_attention.paged_attention_decode(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                                    cache.seq_lens, num_splits=2, block_n=16)
    prefill = paged_prefill.paged_attention_prefill(q, cache.k_cache, cache.v_cache, cache.block_tables, qsl,
                                                    cache.seq_lens, max_query_len=1, block_m=16, block_n=16)
    torch.testing.assert_close(decode, prefill, **TOL[torch.float16])

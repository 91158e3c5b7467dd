"""Sliding windows and logit soft-caps in the Triton paged-attention kernels (decode and chunked prefill), and the
Triton backend of serve/attention.py routing every layer's AttentionSpec to them.

Runs under TRITON_INTERPRET=1 on CPU (tests/kernels/triton_env.py). The kernels' torch reference (attention_ref) is
itself held to models/attention.py's masked_attention (the dense path's, fp32); windows smaller than, equal to and
larger than the context; soft-cap on and off. Block-table entries wholly behind the window point at a poisoned
(NaN) block, as the block manager frees them (FREED): one read of it would turn the output into NaN.
"""

from __future__ import annotations

from tests.kernels.triton_env import DEVICE  # first: sets TRITON_INTERPRET before triton loads

import pytest
import torch

from quantkit.kernels.triton import paged_attention, paged_prefill
from quantkit.models.attention import AttentionSpec, masked_attention, window_mask
from quantkit.serve.attention import AttentionMetadata, TorchPagedAttention, TritonPagedAttention
from tests.kernels.test_kernels_attention import BS, DECODE_SPLITS, DTYPES, TOL, PagedCache, decode_checked

CAP = 1.0  # scores of random q, k at scale 1/sqrt(D) are O(1): tanh bends them
LONGEST = 3 * BS + 5  # the longest context below
WINDOWS = {"smaller": 5, "equal": LONGEST, "larger": LONGEST + 7}


def dense_reference(q, k, v, first_pos, scale, window, softcap):
    """models/attention.py's masked_attention on unpaged K/V: q [L, Hq, D] at positions first_pos.., k/v [T, Hkv, D]
    -> [L, Hq, D] fp32."""
    spec = AttentionSpec(scale, window or None, softcap or None)
    pos = first_pos + torch.arange(q.shape[0], device=q.device)
    keys = torch.arange(k.shape[0], device=q.device)
    allowed = window_mask(pos[:, None], keys[None, :], spec.sliding_window)[None, None]
    out = masked_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                           v.float().transpose(0, 1)[None], allowed, spec)
    return out[0].transpose(0, 1)


def poisoned(cache: PagedCache, first_visible: list[int]) -> torch.Tensor:
    """A copy of cache.block_tables whose entries wholly before first_visible[s] name a NaN block (a spare one)."""
    blocks = [-(-n // BS) for n in cache.seq_lens.tolist()]
    used = {int(b) for s, nb in enumerate(blocks) for b in cache.block_tables[s, :nb]}
    spare = next(b for b in range(cache.k_cache.shape[0]) if b not in used)
    cache.k_cache[spare] = float("nan")
    cache.v_cache[spare] = float("nan")
    tables = cache.block_tables.clone()
    for s, first in enumerate(first_visible):
        tables[s, :first // BS] = spare
    return tables


@pytest.mark.parametrize("softcap", [0.0, CAP], ids=["plain", "softcap"])
@pytest.mark.parametrize("window", list(WINDOWS.values()), ids=list(WINDOWS))
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_decode_honours_window_and_softcap(dtype, window, softcap):
    lens, hq, hkv, d = [1, BS - 1, BS + 1, 2 * BS, LONGEST], 6, 2, 32
    cache = PagedCache(lens, hkv, d, dtype, seed=7)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(8)).to(DEVICE, dtype)
    scale = d ** -0.5
    ref = paged_attention.paged_attention_decode_ref(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                                     cache.seq_lens, scale, window, softcap)
    for s, n in enumerate(lens):
        torch.testing.assert_close(ref[s].float(), dense_reference(q[s:s + 1], cache.keys[s], cache.values[s], n - 1,
                                                                   scale, window, softcap)[0], **TOL[dtype])
    tables = poisoned(cache, [max(0, n - window) for n in lens])
    for num_splits in DECODE_SPLITS:  # with several, the first splits wholly behind a small window are empty
        out = decode_checked(q, cache.k_cache, cache.v_cache, tables, cache.seq_lens, scale, window=window,
                             softcap=softcap, num_splits=num_splits, block_n=16)
        torch.testing.assert_close(out, ref, **TOL[dtype], msg=lambda m: f"{num_splits} splits: {m}")


# (cached tokens before the chunk, chunk length): a fresh prefill longer than the small window, chunks after
# cached context, a one-token chunk
CHUNKS = [(0, 2 * BS + 3), (BS + 1, 9), (2 * BS, BS + 5), (LONGEST - 1, 1)]


@pytest.mark.parametrize("softcap", [0.0, CAP], ids=["plain", "softcap"])
@pytest.mark.parametrize("window", list(WINDOWS.values()), ids=list(WINDOWS))
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_prefill_honours_window_and_softcap(dtype, window, softcap):
    hq, hkv, d = 4, 2, 32
    lens = [ctx + n for ctx, n in CHUNKS]
    cache = PagedCache(lens, hkv, d, dtype, seed=9)
    q_lens = [n for _, n in CHUNKS]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(10)).to(DEVICE, dtype)
    scale = 0.3  # not 1/sqrt(D): the scale is applied before the cap
    ref = paged_prefill.paged_attention_prefill_ref(q, cache.k_cache, cache.v_cache, cache.block_tables, qsl,
                                                    cache.seq_lens, scale, window, softcap)
    for s, (ctx, n) in enumerate(CHUNKS):
        lo = int(qsl[s])
        torch.testing.assert_close(ref[lo:lo + n].float(), dense_reference(q[lo:lo + n], cache.keys[s],
                                                                           cache.values[s], ctx, scale, window,
                                                                           softcap), **TOL[dtype])
    tables = poisoned(cache, [max(0, ctx - window + 1) for ctx, _ in CHUNKS])
    # 32 query rows over 16-token tiles: with the small window later rows see nothing of the first tile
    out = paged_prefill.paged_attention_prefill(q, cache.k_cache, cache.v_cache, tables, qsl, cache.seq_lens, scale,
                                                max_query_len=max(q_lens), window=window, softcap=softcap,
                                                block_m=32, block_n=16)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_plain_arguments_leave_the_kernels_unchanged():
    """window=0, softcap=0 is the plain kernel: bit-identical to a call without them."""
    cache = PagedCache([BS + 3, 7], 2, 32, torch.float16, seed=11)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(12)).to(DEVICE, torch.float16)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens)
    assert torch.equal(paged_attention.paged_attention_decode(*args, num_splits=2, block_n=16),
                       paged_attention.paged_attention_decode(*args, window=0, softcap=0.0, num_splits=2, block_n=16))


def test_triton_backend_routes_every_spec_like_the_torch_backend():
    """TritonPagedAttention over Gemma-like layers (window + soft-cap, global + soft-cap, a plain one) equals
    TorchPagedAttention's masked path over one step of decodes and prefill chunks."""
    specs = [AttentionSpec(0.2, 5, CAP), AttentionSpec(0.2, None, CAP), AttentionSpec(0.25), AttentionSpec(0.25, 9)]
    feeds = [(BS + 2, 1), (LONGEST - 1, 1), (0, 2 * BS + 1), (BS - 3, BS + 6)]  # (cached, new): decodes first
    lens = [c + n for c, n in feeds]
    hq, hkv, d = 4, 2, 32
    caches = [PagedCache(lens, hkv, d, torch.float16, seed=20 + i) for i in range(len(specs))]
    tables = caches[0].block_tables
    for c in caches[1:]:
        c.block_tables = tables  # one block table for every layer, as the engine has
    slots = torch.cat([caches[0].slots(s, c, c + n) for s, (c, n) in enumerate(feeds)])
    q_lens = [n for _, n in feeds]
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=tables, seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32),
        num_decodes=2, seq_lens_host=lens, query_lens_host=q_lens,
    )
    g = torch.Generator().manual_seed(13)
    pools = [(c.k_cache, c.v_cache) for c in caches]
    triton_attn = TritonPagedAttention(pools, specs, max_num_seqs=len(feeds), num_q_heads=hq)
    torch_attn = TorchPagedAttention([(k.float(), v.float()) for k, v in pools], specs)
    triton_attn.begin_step(meta)
    torch_attn.begin_step(meta)
    for layer in range(len(specs)):
        q, k, v = (torch.randn(sum(q_lens), h, d, generator=g).half() for h in (hq, hkv, hkv))
        got = triton_attn(layer, q, k, v)
        want = torch_attn(layer, q.float(), k.float(), v.float())
        torch.testing.assert_close(got.float(), want, **TOL[torch.float16], msg=f"layer {layer}: {specs[layer]}")

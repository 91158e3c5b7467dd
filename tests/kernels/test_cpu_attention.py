"""The C paged decode kernel against a plain fp32 torch reference (gather each sequence's K/V, softmax, sum) on edge
sizes: lengths 1 / tile-1 / tile / tile+1, head dims with and without the AVX-512 path, GQA groups, block sizes."""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels.cpu.paged_decode import load_decode_kernel, paged_decode


def reference(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """fp32: out[s, head] = softmax(q . K^T * scale) V over the first seq_lens[s] tokens of s."""
    num_seqs, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(num_seqs, hq, d)
    for s in range(num_seqs):
        n = int(seq_lens[s])
        blocks = block_tables[s, : -(-n // block_size)].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:n].float().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = v_cache[blocks].reshape(-1, hkv, d)[:n].float().repeat_interleave(hq // hkv, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[s].float(), k) * scale, dim=-1)
        out[s] = torch.einsum("hn,nhd->hd", weights, v)
    return out


@pytest.fixture(scope="module")
def kernel():
    fn = load_decode_kernel()
    if fn is None:
        pytest.fail("the C decode kernel did not build: a C compiler (gcc) is expected on this machine")
    return fn


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("head_dim,hq,hkv,block_size", [(64, 9, 3, 16), (128, 8, 2, 16), (32, 4, 4, 8), (64, 8, 1, 1)])
def test_decode_kernel_matches_reference(kernel, dtype, tol, head_dim, hq, hkv, block_size):
    gen = torch.Generator().manual_seed(head_dim + hq + block_size)
    lens = torch.tensor([1, 15, 16, 17, 33, 70, 5, 129], dtype=torch.int32)
    max_blocks = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), hq, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    tables = tables.to(torch.int32).contiguous()
    scale = head_dim ** -0.5
    out = torch.empty_like(q)
    paged_decode(kernel, q, k_cache, v_cache, tables, lens, scale, out)
    ref = reference(q, k_cache, v_cache, tables, lens, scale)
    assert (out.float() - ref).abs().max().item() < tol

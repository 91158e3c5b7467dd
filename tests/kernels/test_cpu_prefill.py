"""The AMX paged prefill kernel against its plain fp32 torch reference (paged_prefill_ref: gather each sequence's
K/V, causal softmax over its whole context, sum), its launcher's refusals, and inside TorchPagedAttention against
the SDPA path it replaces. Edge sizes: chunks of 1 / 15 / 16 / 17 / 33 queries, chunks after cached context (past
not a multiple of 16 or 32), contexts past one 32-key tile, GQA groups, head_dim 64 and 128, queries as a strided
view (the fused q/k/v projection's).

Tolerance: P and the output are rounded to bf16 as SDPA's bf16 path rounds them; SDPA's own relative error
against the same fp32 reference is ~2e-3 on these inputs, the kernel's the same.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.kernels.cpu import paged_prefill as cpu_prefill
from quantkit.serve.attention import AttentionMetadata, TorchPagedAttention

REL_TOL = 5e-3


@pytest.fixture(scope="module")
def kernel():
    fn = cpu_prefill.load_prefill_kernel()
    if fn is None:
        pytest.skip("no AMX on this CPU: the SDPA path runs")
    return fn


def paged_problem(hq, hkv, d, q_lens, pasts, block_size=16, seed=0):
    """Random caches with shuffled blocks; queries as the q slice of a [T, Hq + 2 Hkv, D] projection output."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + p for q, p in zip(q_lens, pasts)]
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 5
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).bfloat16()
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(q_lens), max(blocks), dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = order[used:used + n]
        used += n
    qkv = torch.randn(sum(q_lens), hq + 2 * hkv, d, generator=gen).bfloat16()
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return qkv[:, :hq], k_cache, v_cache, tables, qsl, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("hq,hkv,d,q_lens,pasts", [
    (9, 3, 64, [1, 15, 16, 17, 33], [0, 0, 0, 0, 0]),
    (9, 3, 64, [5, 40, 1], [21, 100, 300]),
    (8, 2, 128, [33, 16], [0, 70]),
    (4, 4, 64, [130], [0]),
], ids=["fresh-prompts", "after-context", "head-dim-128", "no-gqa"])
def test_kernel_matches_reference(kernel, hq, hkv, d, q_lens, pasts):
    q, k_cache, v_cache, tables, qsl, seq_lens = paged_problem(hq, hkv, d, q_lens, pasts)
    scale = d ** -0.5
    out = torch.full((q.shape[0], hq, d), float("nan"), dtype=torch.bfloat16)
    cpu_prefill.paged_prefill(kernel, q, k_cache, v_cache, tables, qsl, seq_lens, scale, out)
    ref = cpu_prefill.paged_prefill_ref(q, k_cache, v_cache, tables, qsl, seq_lens, scale)
    for s in range(len(q_lens)):  # per sequence: a wrong block table or causal limit fails one of them
        a, b = int(qsl[s]), int(qsl[s + 1])
        err = ((out[a:b].float() - ref[a:b]).norm() / ref[a:b].norm()).item()
        assert err < REL_TOL, f"sequence {s}: relative error {err:.2e}"


def test_backend_with_kernel_matches_the_sdpa_path(kernel):
    """One mixed step (two decodes, then three prefill chunks) through TorchPagedAttention: the kernel's prefill
    rows against the SDPA path's, and the decode rows unchanged."""
    hq, hkv, d = 9, 3, 64
    q_lens, pasts = [1, 1, 20, 3, 50], [40, 7, 0, 30, 17]
    q, k_cache, v_cache, tables, qsl, seq_lens = paged_problem(hq, hkv, d, q_lens, pasts, seed=3)
    # the step's own K/V are already in the caches; storing them again at their slots changes nothing
    slots = torch.cat([tables[s, (p + torch.arange(n)) // 16].long() * 16 + (p + torch.arange(n)) % 16
                       for s, (n, p) in enumerate(zip(q_lens, pasts))])
    k = k_cache.view(-1, hkv, d)[slots].clone()
    v = v_cache.view(-1, hkv, d)[slots].clone()
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl,
                             num_decodes=2, seq_lens_host=seq_lens.tolist(), query_lens_host=q_lens)
    outs = []
    for prefill in (kernel, None):
        attn = TorchPagedAttention([(k_cache, v_cache)], d ** -0.5, prefill_kernel=prefill)
        attn.begin_step(meta)
        outs.append(attn(0, q, k, v).float())
    fast, sdpa = outs
    assert torch.equal(fast[:2], sdpa[:2])
    assert ((fast[2:] - sdpa[2:]).norm() / sdpa[2:].norm()).item() < REL_TOL


@pytest.mark.parametrize("bad", ["cache-fp32", "head-dim-32", "q-heads-strided", "hq-not-multiple", "qsl-int64",
                                 "qsl-length"])
def test_launcher_refuses_what_the_kernel_does_not_take(kernel, bad):
    q, k_cache, v_cache, tables, qsl, seq_lens = paged_problem(4, 2, 64, [3, 5], [0, 2])
    if bad == "cache-fp32":
        k_cache, v_cache = k_cache.float(), v_cache.float()
    elif bad == "head-dim-32":
        q, k_cache, v_cache, tables, qsl, seq_lens = paged_problem(4, 2, 32, [3, 5], [0, 2])
    elif bad == "q-heads-strided":
        q = q[:, ::2]
    elif bad == "hq-not-multiple":
        q = q[:, :3]
    elif bad == "qsl-int64":
        qsl = qsl.long()
    else:
        qsl = qsl[:2]
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="paged_prefill"):
        cpu_prefill.paged_prefill(kernel, q, k_cache, v_cache, tables, qsl, seq_lens, 0.125, out)

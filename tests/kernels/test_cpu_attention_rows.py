"""paged_rows (kernels/cpu/paged_decode.py: every query row as its own decode item) against a plain fp32 torch
reference, with and without sliding windows and soft-caps, and TorchPagedAttention's batch-invariant mode: one
position's attention output is the same bits whether it is a row of a whole-prompt prefill, of a chunk batched with
another sequence's rows, a decode row, or a chunk after a cached prefix."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cpu_builds import NARROWER, narrower_library

from quantkit.kernels.cpu.paged_decode import ROWS_SIGNATURE, SIGNATURE, load_decode_kernel, load_rows_kernel, \
    paged_decode, paged_rows, paged_rows_ref
from quantkit.models.attention import AttentionSpec
from quantkit.serve.attention import AttentionMetadata, TorchPagedAttention

HQ, HKV, D, BS = 9, 3, 64, 16  # the bundled SmolLM2's heads; 16-token blocks
SPECS = [AttentionSpec(0.125), AttentionSpec(0.125, sliding_window=20, logit_softcap=30.0)]


@pytest.fixture(scope="module", params=["native", *sorted(NARROWER)])
def build(request, tmp_path_factory):
    """(rows, decode) functions of paged_decode.c as this CPU's build, or built for a narrower instruction set:
    AVX-512 without BF16 (fp32 tiles), AVX2, plain C"""
    if request.param == "native":
        rows, decode = load_rows_kernel(), load_decode_kernel()
        if rows is None:
            pytest.fail("the C decode kernel did not build: a C compiler (gcc) is expected on this machine")
        return rows, decode
    flags, needs = NARROWER[request.param]
    lib = narrower_library("paged_decode", flags, tmp_path_factory.mktemp(request.param),
                           {"paged_rows": ROWS_SIGNATURE, "paged_decode": SIGNATURE}, needs)
    return lib.paged_rows, lib.paged_decode


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
# native AVX-512 BF16: bf16 dot products (64, 128, 32), fp32 tiles; 36: plain C tiles on every build
@pytest.mark.parametrize("head_dim", [64, 128, 32, 36])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 20.0), (40, 10.0)])
def test_rows_kernel_matches_reference(build, dtype, tol, head_dim, window, softcap):
    kernel, decode = build
    gen = torch.Generator().manual_seed(head_dim + (window or 0))
    k_cache = torch.randn(20, BS, HKV, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(20, BS, HKV, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(20, generator=gen)[:18].view(2, 9).to(torch.int32).contiguous()
    # tile edges, the whole table, then a chunk's 20 consecutive rows (items of up to 8 rows)
    row_seqs = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 0, 1] + [1] * 20, dtype=torch.int32)
    row_lens = torch.tensor([1, 15, 16, 17, 33, 70, 5, 129, 144, 2, *range(45, 65)], dtype=torch.int32)
    q = (torch.randn(len(row_lens), HQ, head_dim, generator=gen) * 2).to(dtype)
    out = torch.empty_like(q)
    paged_rows(kernel, q, k_cache, v_cache, tables, row_seqs, row_lens, 0.125, out, window, softcap)
    ref = paged_rows_ref(q, k_cache, v_cache, tables, row_seqs, row_lens, 0.125, window, softcap)
    assert (out.float() - ref).abs().max().item() < tol
    for r in range(len(row_lens)):  # a row's bits do not depend on the rows beside it
        alone = torch.empty_like(q[r:r + 1])
        paged_rows(kernel, q[r:r + 1].contiguous(), k_cache, v_cache, tables, row_seqs[r:r + 1], row_lens[r:r + 1],
                   0.125, alone, window, softcap)
        assert torch.equal(alone, out[r:r + 1]), r
    if window is None and softcap is None:  # the decode kernel is the same item
        decoded = torch.empty_like(q)
        paged_decode(decode, q, k_cache, v_cache, tables[row_seqs.long()].contiguous(), row_lens, 0.125, decoded)
        assert torch.equal(decoded, out)


def test_launcher_refuses_row_tables_it_cannot_read():
    kernel = load_rows_kernel()
    q = torch.randn(2, HQ, D).bfloat16()
    cache = torch.randn(4, BS, HKV, D).bfloat16()
    tables = torch.zeros(1, 4, dtype=torch.int32)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="row_seqs int32"):
        paged_rows(kernel, q, cache, cache, tables, torch.zeros(2, dtype=torch.int64), lens, 0.1, torch.empty_like(q))
    with pytest.raises(ValueError, match="lengths int32"):
        paged_rows(kernel, q, cache, cache, tables, torch.zeros(2, dtype=torch.int32), lens[:1], 0.1,
                   torch.empty_like(q))


class Stream:
    """Per sequence: fixed random q/k/v per position and layer, and a block table; run steps of (seq, start, n)."""

    def __init__(self, lengths: dict[str, int], num_blocks: int = 16):
        gen = torch.Generator().manual_seed(7)
        self.qkv = {name: [(torch.randn(n, HQ, D, generator=gen).bfloat16(), torch.randn(n, HKV, D, generator=gen)
                            .bfloat16(), torch.randn(n, HKV, D, generator=gen).bfloat16()) for _ in SPECS]
                    for name, n in lengths.items()}
        blocks = iter(torch.randperm(num_blocks, generator=gen).tolist())
        self.tables = {name: [next(blocks) for _ in range(-(-n // BS))] for name, n in lengths.items()}
        self.caches = [(torch.zeros(num_blocks, BS, HKV, D, dtype=torch.bfloat16),
                        torch.zeros(num_blocks, BS, HKV, D, dtype=torch.bfloat16)) for _ in SPECS]
        self.attn = TorchPagedAttention(self.caches, SPECS, rows_kernel=load_rows_kernel())

    def step(self, feeds: list[tuple[str, int, int]]) -> dict[tuple[str, int], list[torch.Tensor]]:
        """feeds (decodes, n = 1, first): -> {(seq, position): per layer its output [Hq, D]}."""
        width = max(len(self.tables[name]) for name, _, _ in feeds)
        tables = torch.zeros(len(feeds), width, dtype=torch.int32)
        slots, qsl = [], [0]
        for i, (name, start, n) in enumerate(feeds):
            table = self.tables[name]
            tables[i, :len(table)] = torch.tensor(table)
            slots += [table[p // BS] * BS + p % BS for p in range(start, start + n)]
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=tables,
            seq_lens=torch.tensor([s + n for _, s, n in feeds], dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            num_decodes=next((i for i, f in enumerate(feeds) if f[2] != 1), len(feeds)),
            seq_lens_host=[s + n for _, s, n in feeds], query_lens_host=[n for _, _, n in feeds])
        self.attn.begin_step(meta)
        outs = []
        for layer in range(len(SPECS)):
            q, k, v = (torch.cat([self.qkv[name][layer][j][s:s + n] for name, s, n in feeds]) for j in range(3))
            outs.append(self.attn(layer, q, k, v))
        result, row = {}, 0
        for name, start, n in feeds:
            for p in range(start, start + n):
                result[(name, p)] = [o[row] for o in outs]
                row += 1
        return result


def test_a_position_gives_the_same_bits_on_every_path():
    lengths = {"a": 45, "b": 30}
    whole = Stream(lengths).step([("a", 0, 45)])  # one prefill of the prompt
    chunked = Stream(lengths)  # chunks batched with b's prefill and decodes
    got = chunked.step([("b", 0, 10), ("a", 0, 20)])
    got |= chunked.step([("b", 10, 1), ("a", 20, 25)])
    decoded = Stream(lengths)  # every position of a as a decode row, beside b's decodes
    got_decoded = decoded.step([("a", 0, 1), ("b", 0, 12)])
    for p in range(1, 45):
        got_decoded |= decoded.step([("b", 11 + p, 1), ("a", p, 1)] if p < 19 else [("a", p, 1)])
    cached = Stream(lengths)  # a's first two blocks already in the cache (a prefix-cache hit), then the rest
    cached.step([("a", 0, 32)])
    got_cached = cached.step([("a", 32, 13)])
    ref = Stream(lengths)
    for p in range(45):
        for layer in range(len(SPECS)):
            assert torch.equal(got[("a", p)][layer], whole[("a", p)][layer]), (p, layer)
            assert torch.equal(got_decoded[("a", p)][layer], whole[("a", p)][layer]), (p, layer)
            if p >= 32:
                assert torch.equal(got_cached[("a", p)][layer], whole[("a", p)][layer]), (p, layer)
    for layer, spec in enumerate(SPECS):  # and close to the fp32 reference over a's cached K/V
        k_cache, v_cache = chunked.caches[layer]
        table = torch.tensor([chunked.tables["a"]], dtype=torch.int32)
        q = ref.qkv["a"][layer][0]
        expected = paged_rows_ref(q, k_cache, v_cache, table, torch.zeros(45, dtype=torch.int32),
                                  torch.arange(1, 46, dtype=torch.int32), spec.scale, spec.sliding_window,
                                  spec.logit_softcap)
        ours = torch.stack([whole[("a", p)][layer] for p in range(45)])
        assert (ours.float() - expected).abs().max().item() < 2e-2

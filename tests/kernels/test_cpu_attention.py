"""The C paged decode kernel against its plain fp32 torch reference (paged_decode_ref: gather each sequence's K/V,
softmax, sum) on edge sizes: lengths 1 / tile-1 / tile / tile+1, head dims with and without the AVX-512 path, GQA
groups, block sizes; the launcher's refusals of what the C code does not take; and kernels/cpu/build.py through this
kernel (plain C, built on every machine): its cache key and a machine without a compiler."""

from __future__ import annotations

import logging

import pytest
import torch

from quantkit.kernels.cpu import build
from quantkit.kernels.cpu.paged_decode import load_decode_kernel, paged_decode, paged_decode_ref


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
    ref = paged_decode_ref(q, k_cache, v_cache, tables, lens, scale)
    assert (out.float() - ref).abs().max().item() < tol


def decode_problem(dtype=torch.bfloat16, hq=8, hkv=2, d=64):
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, 16, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(4, 16, hkv, d, generator=gen).to(dtype)
    q = torch.randn(2, hq, d, generator=gen).to(dtype)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    return q, k_cache, v_cache, tables, lens, 0.125, torch.empty_like(q)


@pytest.mark.parametrize("bad", ["q-dtype", "q-strided", "head-dim", "group", "tables-int64", "lens-shape",
                                 "out-shape"])
def test_launcher_refuses_what_the_kernel_does_not_take(kernel, bad):
    q, k_cache, v_cache, tables, lens, scale, out = decode_problem()
    if bad == "q-dtype":
        q = q.float()
    elif bad == "q-strided":
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
    elif bad == "head-dim":
        q = q[..., :32].contiguous()
    elif bad == "group":
        q, k_cache, v_cache, tables, lens, scale, out = decode_problem(hq=34, hkv=2)
    elif bad == "tables-int64":
        tables = tables.long()
    elif bad == "lens-shape":
        lens = lens[:1]
    else:
        out = out[:1]
    with pytest.raises(ValueError, match="paged_decode"):
        paged_decode(kernel, q, k_cache, v_cache, tables, lens, scale, out)


def test_the_cache_key_covers_the_source_and_every_header(tmp_path):
    (tmp_path / "k.c").write_text('#include "a.h"\n')
    (tmp_path / "a.h").write_text("#define A 1\n")
    (tmp_path / "b.h").write_text("#define B 1\n")
    first = build._cache_key(tmp_path / "k.c")
    assert build._cache_key(tmp_path / "k.c") == first
    (tmp_path / "b.h").write_text("#define B 2\n")  # any header of the folder, included or not
    second = build._cache_key(tmp_path / "k.c")
    (tmp_path / "k.c").write_text('#include "a.h"\n/* edited */\n')
    assert len({first, second, build._cache_key(tmp_path / "k.c")}) == 3


def test_no_compiler_gives_none_and_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(build, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger="quantkit.serve"):
        assert load_decode_kernel() is None
    assert "CPU kernels paged_decode unavailable" in caplog.text

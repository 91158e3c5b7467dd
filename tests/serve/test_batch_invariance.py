"""Batch-invariant greedy decoding in the default CPU dtype (bf16): a request's greedy tokens are the same whether it
runs alone, batched with others (prompts chunked by a small budget), after its prefix came from the cache, or with
n-gram or draft-model speculation (quantkit/benchmark/invariance.py runs the modes). With batch_invariant off, the
same schedules change some answers: that is what these tests guard against. Also windowed and soft-capped families
(the row attention kernel's window and cap), and fp32 serving left as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from quantkit.benchmark.invariance import MODES, greedy_runs, rtn_draft
from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.models.loader import load_model
from quantkit.serve.config import EngineConfig
from quantkit.serve.cpu_linear import PackedLinear
from quantkit.serve.llm import eos_token_ids
from quantkit.serve.model_runner import ModelRunner
from quantkit.serve.prepare import batch_invariant_mode
from tests.quantkit.families import saved_families
from tests.serve.test_engine import chat_prompts

PROMPTS, MAX_TOKENS = 8, 32
KV = dict(kv_cache_memory=128 << 20, max_model_len=512)
# what serve/prepare.py decides for this CPU (invariance needs oneDNN's bf16 kernels: kernels/cpu/capability.py)
invariant_here = pytest.mark.skipif(
    not batch_invariant_mode(True, torch.device("cpu"), torch.bfloat16, native_kernels=True),
    reason="this CPU serves bf16 without the row-invariant kernels (no oneDNN bf16): nothing to hold invariant")


@pytest.fixture(scope="module")
def bundled_bf16():
    return load_model(None, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def prompts(bundled_bf16, shared_data):
    picked = chat_prompts(shared_data, bundled_bf16.tokenizer, count=PROMPTS)
    assert len(picked) == PROMPTS
    return picked


def runs_of(loaded, prompts, batch_invariant, modes=MODES):
    """The modes on fresh copies of the model and of its W4 RTN draft (serving prepares a model in place)."""
    return greedy_runs(copy.deepcopy(loaded.model), loaded.tokenizer, prompts, MAX_TOKENS, batch_invariant,
                       eos_token_ids(loaded.tokenizer, loaded.path), chunk_budget=48,
                       draft=rtn_draft(loaded.model) if "draft" in modes else None, modes=modes, **KV)


@invariant_here
def test_bf16_greedy_tokens_are_identical_in_every_schedule(bundled_bf16, prompts):
    runs = runs_of(bundled_bf16, prompts, batch_invariant=True)
    alone = runs["alone"].tokens
    assert all(len(t) > 0 for t in alone)
    for mode in MODES:
        assert runs[mode].tokens == alone, mode
    # each mode really ran what it names
    assert runs["prefix_warm"].stats["prefix_cache_hits"] > 0
    for mode in ("ngram", "draft"):
        stats = runs[mode].stats
        assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, mode
    draft = runs["draft"].stats  # the W4 draft is wrong sometimes: rejected drafts were rolled back
    assert draft["spec_decode_num_accepted_tokens"] < draft["spec_decode_num_draft_tokens"]


def test_without_batch_invariance_batching_changes_answers(bundled_bf16, prompts, monkeypatch):
    """The failure the mode removes on CPUs without AMX (oneDNN's kernels by row count, SDPA per chunk vs the decode
    kernel): with it off, batching and chunking the same 8 prompts changes at least one greedy answer. AMX's tile
    GEMM is row-invariant in either mode, so AMX is reported absent here, as on those CPUs."""
    monkeypatch.setattr(cpu_gemm, "available", lambda: False)
    runs = runs_of(bundled_bf16, prompts, batch_invariant=False, modes=("alone", "batched"))
    assert runs["batched"].tokens != runs["alone"].tokens


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory, bundled_dir):
    return saved_families(tmp_path_factory.mktemp("invariance-families"), bundled_dir)


@invariant_here
@pytest.mark.parametrize("name", ["gemma2", "mistral"])  # soft-caps + alternating windows; every layer windowed
def test_windowed_and_softcapped_families_are_invariant_in_bf16(name, family_folders):
    """Tiny random models whose windows (16 tokens) the 40-64-token prompts outgrow: the row kernel's window and
    soft-cap, and (Mistral) KV blocks freed behind the window, keep every schedule's tokens identical."""
    _, folder = family_folders(name)
    loaded = load_model(str(folder), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 17, 40, 64, 23, 50)]
    runs = greedy_runs(loaded.model, loaded.tokenizer, prompts, 24, True, eos_token_ids=[], chunk_budget=20,
                       modes=("alone", "batched", "prefix_warm", "ngram"), kv_cache_memory=8 << 20, max_model_len=128)
    for mode, run in runs.items():
        assert run.tokens == runs["alone"].tokens, mode
    assert all(len(t) == 24 for t in runs["alone"].tokens)


def test_fp32_serving_is_untouched_by_the_flag(bundled_bf16):
    """batch_invariant applies to bf16 CPU serving only: an fp32 runner keeps its plain Linears and torch paths."""
    model = copy.deepcopy(bundled_bf16.model).float()
    runner = ModelRunner(model, EngineConfig(batch_invariant=True, **KV), "cpu", torch.float32, 512)
    assert not runner.batch_invariant and runner.attn.rows_kernel is None
    assert type(model.lm_head) is nn.Linear and not any(isinstance(m, PackedLinear) for m in model.modules())

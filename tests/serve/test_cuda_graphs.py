"""Decode steps bucketed for CUDA graphs (serve/cuda_graphs.py): the bucket of every batch size, which steps take
the bucketed path, the padded forward against the unpadded one on CPU through the same eager forward (logits and
KV bit for bit in batch-invariant bf16, to rounding in fp32; no KV slot but the step's and the padding block's
written), the persistent buffers' storage, the engine's output (fp32 and bf16) against the eager path, and on a
GPU the captured graphs' replay against the eager padded forward and the engine against the eager default."""

from __future__ import annotations

import random

import pytest
import torch

from quantkit.models.llama import LlamaForCausalLM, ModelConfig
from quantkit.serve.config import EngineConfig
from quantkit.serve.cpu_linear import can_pack
from quantkit.serve.cuda_graphs import MAX_CAPTURE_SIZE, DecodeGraphs, bucket_for, capture_sizes
from quantkit.serve.engine import LLMEngine
from quantkit.serve.model_runner import ModelRunner
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.validation import validate_request
from tests.conftest import tiny_hf_config

EOS = 2
BLOCK = 4
MAX_MODEL_LEN = 128


# ---- bucket choice ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_num_seqs, max_tokens, expected", [
    (1, 2048, [1]),
    (3, 2048, [1, 2, 3]),
    (8, 2048, [1, 2, 4, 8]),
    (20, 2048, [1, 2, 4, 8, 16, 20]),
    (128, 2048, [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]),
    (128, 40, [1, 2, 4, 8, 16, 32, 40]),  # a step holds at most max_num_batched_tokens decodes
    (4096, 1 << 20, [1, 2, 4, 8] + list(range(16, MAX_CAPTURE_SIZE + 1, 16))),
])
def test_capture_sizes(max_num_seqs, max_tokens, expected):
    assert capture_sizes(max_num_seqs, max_tokens) == expected


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 20, 128, 600])
def test_bucket_is_the_smallest_size_holding_the_batch(max_num_seqs):
    sizes = capture_sizes(max_num_seqs, 2048)
    for n in range(1, sizes[-1] + 40):
        fits = [s for s in sizes if s >= n]
        assert bucket_for(sizes, n) == (min(fits) if fits else None), n
    assert [bucket_for(capture_sizes(128, 2048), n) for n in (1, 2, 3, 5, 8, 9, 17, 33, 127, 128, 129)] == \
        [1, 2, 4, 8, 8, 16, 32, 48, 128, 128, None]


# ---- the padded forward on CPU ---------------------------------------------------------------------------------

def tiny_model(dtype=torch.float32, device="cpu"):
    """The same random weights every call (a serving runner prepares its model in place: one model per runner)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(tiny_hf_config(vocab_size=512, max_position_embeddings=256)))
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # spread the logits: no near-ties in greedy comparisons
    return model.to(device, dtype).eval()


def tiny_runner(model, device="cpu", dtype=torch.float32, max_num_seqs=20):
    cfg = EngineConfig(block_size=BLOCK, kv_cache_memory=256 * BLOCK * 2 * 2 * 2 * 16 * 4, max_model_len=MAX_MODEL_LEN,
                       max_num_seqs=max_num_seqs, cuda_graphs=True)  # on CPU: wanted nowhere, checked by the tests
    return ModelRunner(model, cfg, device, dtype, MAX_MODEL_LEN)


def prefilled(runner, n, seed=0):
    """n sequences with random prompts of 3-30 tokens prefilled into distinct blocks -> per sequence (next token,
    its position, block table with room for it)."""
    rng = random.Random(seed)
    seqs, next_block = [], 0
    for _ in range(n):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(3, 31))]
        blocks = list(range(next_block, next_block + len(prompt) // BLOCK + 1))
        next_block += len(blocks)
        runner.last_logits([(prompt, 0, blocks)], sample=False)
        seqs.append((rng.randrange(3, 512), len(prompt), blocks))
    assert next_block <= runner.num_blocks
    return seqs


def decode_feeds(seqs):
    return [([token], pos, blocks) for token, pos, blocks in seqs]


@pytest.mark.parametrize("n", [1, 3, 5, 12, 20])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_padded_rows_give_the_unpadded_logits_and_never_touch_real_kv(dtype, n):
    """bf16 batch-invariant (the row-invariant GEMM and attention kernel, serve/prepare.py): bit for bit; fp32
    (oneDNN's GEMM, whose rounding depends on the row count), and bf16 where invariance is off: to its rounding.
    Either way only the step's slots and the padding block's slot 0 change in the KV cache."""
    model = tiny_model(dtype)
    runner = tiny_runner(model, dtype=dtype)
    # bf16 is served invariantly wherever oneDNN's bf16 kernels exist (serve/prepare.py); elsewhere (AVX2) it is not
    assert runner.batch_invariant == (dtype == torch.bfloat16 and can_pack(dtype, torch.device("cpu")))
    runner.use_padded_decode()
    graphs = runner.graphs
    assert not graphs.capture and runner.kv_pool.shape[2] == runner.num_blocks + 1
    bucket = bucket_for(graphs.sizes, n)
    runner.kv_pool.zero_()  # no stray NaN bit patterns of the uninitialised pool in the comparisons
    seqs = prefilled(runner, n)
    pad = runner.kv_pool[:, :, graphs.padding_block]
    pad.fill_(float("nan"))  # the padding block's slot 0 is the only KV a padded row may write
    before = runner.kv_pool.clone()

    expected = runner.last_logits(decode_feeds(seqs))  # the normal eager path, n rows
    expected_kv = runner.kv_pool.clone()
    runner.kv_pool.copy_(before)
    input_ids, positions, meta, _ = runner.flatten(decode_feeds(seqs))
    with torch.inference_mode():
        got = graphs.logits(input_ids, positions, meta, bucket)

    assert got.shape == expected.shape == (n, model.config.vocab_size)
    real = slice(0, runner.num_blocks)
    if runner.batch_invariant:
        assert torch.equal(got, expected)
        assert torch.equal(runner.kv_pool[:, :, real], expected_kv[:, :, real])
    elif dtype == torch.bfloat16:  # torch's bf16 GEMM rounds by row count: to bf16 rounding of these O(1) logits
        torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=0.05)
        torch.testing.assert_close(runner.kv_pool[:, :, real].float(), expected_kv[:, :, real].float(), rtol=0,
                                   atol=0.05)
    else:
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        torch.testing.assert_close(runner.kv_pool[:, :, real], expected_kv[:, :, real], rtol=0, atol=1e-5)
    slots = runner.kv_pool.flatten(3).view(runner.num_layers, 2, -1, 2 * 16)  # [layers, K/V, slot, Hkv * D]
    changed = (slots != before.flatten(3).view_as(slots)).any(-1).any(0).any(0)  # [slots]; NaN != NaN, so the
    # padding block's slots all read changed: left out here, checked below
    step_slots = set(meta.slot_mapping.tolist())
    assert {int(i) for i in changed.nonzero()} - set(range(graphs.padding_slot, graphs.padding_slot + BLOCK)) \
        == step_slots
    written = ~torch.isnan(pad).flatten(3).all(-1)  # [layers, 2, block_size]: padding slots any padded row wrote
    assert written[:, :, 1:].sum() == 0
    assert bool(written[:, :, 0].all()) == (bucket > n)


def test_buffers_are_allocated_once_and_read_by_every_step():
    model = tiny_model()
    runner = tiny_runner(model)
    runner.use_padded_decode()
    graphs = runner.graphs
    names = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc")
    storage = {name: getattr(graphs, name).data_ptr() for name in names}
    assert graphs.block_tables.shape == (20, MAX_MODEL_LEN // BLOCK) and graphs.input_ids.shape == (20,)
    seqs = prefilled(runner, 20, seed=1)
    for n in (1, 3, 20, 5, 12, 2):
        bucket = bucket_for(graphs.sizes, n)
        input_ids, positions, meta, _ = runner.flatten(decode_feeds(seqs[:n]))
        with torch.inference_mode():
            graphs.logits(input_ids, positions, meta, bucket)
        assert {name: getattr(graphs, name).data_ptr() for name in names} == storage
        step = runner.attn.meta  # what the forward's attention read: bucket rows of the persistent buffers
        assert step.num_decodes == bucket and step.block_tables.shape == (bucket, MAX_MODEL_LEN // BLOCK)
        assert step.slot_mapping.data_ptr() == storage["slot_mapping"]
        assert step.block_tables.data_ptr() == storage["block_tables"]
        assert step.seq_lens.data_ptr() == storage["seq_lens"]
        assert graphs.input_ids[:n].tolist() == [s[0] for s in seqs[:n]]
        assert graphs.positions[:bucket].tolist() == [s[1] for s in seqs[:n]] + [0] * (bucket - n)
        assert graphs.input_ids[n:bucket].tolist() == [0] * (bucket - n)
        assert graphs.seq_lens[n:bucket].tolist() == [1] * (bucket - n)
        assert graphs.slot_mapping[n:bucket].tolist() == [graphs.padding_slot] * (bucket - n)


# ---- the engine ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from quantkit.models.loader import load_tokenizer

    return load_tokenizer(None)


def engine_of(model, tokenizer, padded: bool, **kw):
    cfg = EngineConfig(block_size=BLOCK, kv_cache_memory=400 * BLOCK * 2 * 2 * 2 * 16 * 4, max_model_len=MAX_MODEL_LEN,
                       max_num_seqs=8, seed=0, **kw)
    engine = LLMEngine(model, tokenizer, cfg, eos_token_ids=[EOS])
    if padded:
        engine.runner.use_padded_decode()
    return engine


def run(engine, waves):
    """Each wave of (prompt, params) run to its end in turn -> per request its completions' tokens and logprobs."""
    results = []
    for w, requests in enumerate(waves):
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(f"w{w}r{i}", validate_request(prompt, params, engine.vocab_size, engine.max_model_len,
                                                             engine.cfg.max_num_seqs))
        final = {}
        while engine.has_unfinished():
            final.update((out.request_id, out) for out in engine.step() if out.finished)
        results += [[(c.token_ids, c.logprobs) for c in final[f"w{w}r{i}"].outputs] for i in range(len(requests))]
    return results


@torch.inference_mode()
def dense_greedy(model, prompt, max_tokens):
    """Greedy tokens of the model's dense forward, the whole sequence recomputed for every token."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def record_buckets(engine):
    """Every step's (batch, bucket) as DecodeGraphs.bucket answers it (the real method, its answer recorded)."""
    seen, choose = [], engine.runner.graphs.bucket

    def recorded(batch):
        seen.append((batch, choose(batch)))
        return seen[-1][1]

    engine.runner.graphs.bucket = recorded
    return seen


def decode_only(batch) -> bool:
    """One token per sequence and its logits row: token i's row is i, nothing else sampled or verified."""
    n = len(batch.scheduled)
    return (all(s.num_new_tokens == 1 for s in batch.scheduled) and not batch.spec_rows
            and batch.logits_indices.tolist() == list(range(n)))


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_output_with_padded_decode_equals_eager(tokenizer, dtype, speculative):
    """Batches shrink as requests finish (buckets 8, 4, 2, 1); the first step of a fork (n = 2 of a one-token prompt:
    two rows of one sequence) and n-gram speculation's verify steps (a prompt that holds the model's own greedy
    continuation of its tail, so the drafts are proposed and accepted) run
    eagerly; every other decode step through the padded buffers. Tokens equal; logprobs bit for bit in bf16
    (batch-invariant), to fp32 rounding in fp32."""
    rng = random.Random(3)
    spec = dict(speculative_method="ngram", num_speculative_tokens=3) if speculative else {}
    seed = [rng.randrange(3, 512) for _ in range(5)]
    repeating = seed + dense_greedy(tiny_model(dtype), seed, 8) + seed
    waves = [
        [([rng.randrange(3, 512) for _ in range(rng.randrange(2, 40))],
          SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, logprobs=2)) for i in range(6)],
        [([7], SamplingParams(temperature=0.8, n=2, max_tokens=6, seed=5))],
        [(repeating, SamplingParams(temperature=0.0, max_tokens=20, prompt_logprobs=1))],
    ]
    expected = run(engine_of(tiny_model(dtype), tokenizer, padded=False, **spec), waves)
    engine = engine_of(tiny_model(dtype), tokenizer, padded=True, **spec)
    seen = record_buckets(engine)
    got = run(engine, waves)
    if dtype == torch.bfloat16:
        assert got == expected
    else:
        assert [[c[0] for c in r] for r in got] == [[c[0] for c in r] for r in expected]
        for lp, lp_expected in ((c[1], e[1]) for r, er in zip(got, expected) for c, e in zip(r, er)):
            assert (lp is None) == (lp_expected is None)
            for entry, entry_expected in zip(lp or [], lp_expected or []):
                assert list(entry) == list(entry_expected)  # the same top tokens in the same order
                assert list(entry.values()) == pytest.approx(list(entry_expected.values()), abs=1e-5)
    for batch, bucket in seen:
        n = len(batch.scheduled)
        assert bucket == (bucket_for(engine.runner.graphs.sizes, n) if decode_only(batch) else None)
    buckets = {bucket for _, bucket in seen}
    assert {8, 4, 2, 1} <= buckets and None in buckets
    assert any(b is None and all(s.num_new_tokens == 1 for s in batch.scheduled) for batch, b in seen)  # the fork
    assert any(batch.spec_rows for batch, _ in seen) == speculative


def test_a_fork_beside_a_one_token_chunk_runs_eagerly(tokenizer):
    """A budget of 2 tokens: the fork's one-token prompt (two sample rows) beside a one-token prompt chunk (no row)
    is one token per sequence and two rows, but not row i per sequence i."""
    waves = [[([7], SamplingParams(temperature=0.8, n=2, max_tokens=4, seed=1)),
              ([9, 10, 11, 12, 13], SamplingParams(temperature=0.0, max_tokens=4))]]
    expected = run(engine_of(tiny_model(), tokenizer, padded=False, max_num_batched_tokens=2), waves)
    engine = engine_of(tiny_model(), tokenizer, padded=True, max_num_batched_tokens=2)
    seen = record_buckets(engine)
    assert [[c[0] for c in r] for r in run(engine, waves)] == [[c[0] for c in r] for r in expected]
    first = seen[0][0]
    assert [s.num_new_tokens for s in first.scheduled] == [1, 1] and first.logits_indices.tolist() == [0, 0]
    assert seen[0][1] is None
    assert all(bucket == (bucket_for(engine.runner.graphs.sizes, len(batch.scheduled)) if decode_only(batch)
                          else None) for batch, bucket in seen)


# ---- on a GPU: capture and replay ------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replay_equals_the_eager_padded_forward():
    model = tiny_model(torch.float16, "cuda")
    runner = tiny_runner(model, "cuda", torch.float16)
    graphs = runner.graphs
    assert graphs is not None and graphs.capture
    eager = DecodeGraphs(runner, capture=False)  # the same forward over its own buffers, no graph
    seqs = prefilled(runner, 20, seed=2)
    for n in (1, 3, 8, 13, 20):
        bucket = bucket_for(graphs.sizes, n)
        input_ids, positions, meta, _ = runner.flatten(decode_feeds(seqs[:n]))
        with torch.inference_mode():
            kv = runner.kv_pool.clone()
            replayed = graphs.logits(input_ids, positions, meta, bucket)
            kv_replayed = runner.kv_pool.clone()
            runner.kv_pool.copy_(kv)
            reference = eager.logits(input_ids, positions, meta, bucket)
            kv_reference = runner.kv_pool.clone()  # before the unpadded forward rewrites the step's slots with
            unpadded = runner.last_logits(decode_feeds(seqs[:n]))  # its own rounding (cuBLAS picks by shape)
        assert bucket in graphs.graphs
        assert torch.equal(replayed, reference), n
        real = slice(0, runner.num_blocks)
        assert torch.equal(kv_replayed[:, :, real], kv_reference[:, :, real]), n
        assert torch.equal(replayed.argmax(-1), unpadded.argmax(-1)), n
        torch.testing.assert_close(replayed, unpadded, atol=2e-2, rtol=1e-2)
    off = ModelRunner(model, EngineConfig(block_size=BLOCK, kv_cache_memory=1 << 20, max_model_len=MAX_MODEL_LEN,
                                          cuda_graphs=False), "cuda", torch.float16, MAX_MODEL_LEN)
    assert off.graphs is None and off.kv_pool.shape[2] == off.num_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_engine_greedy_with_graphs_equals_eager(tokenizer):
    rng = random.Random(5)
    waves = [[([rng.randrange(3, 512) for _ in range(rng.randrange(2, 40))],
               SamplingParams(temperature=0.0, max_tokens=4 + 3 * i)) for i in range(7)]]
    eager = engine_of(tiny_model(torch.float16, "cuda"), tokenizer, padded=False)
    assert eager.runner.graphs is None
    engine = engine_of(tiny_model(torch.float16, "cuda"), tokenizer, padded=False, cuda_graphs=True)
    assert [[c[0] for c in r] for r in run(engine, waves)] == [[c[0] for c in r] for r in run(eager, waves)]
    assert {8, 4, 2, 1} <= set(engine.runner.graphs.graphs)  # captured as the batch shrank

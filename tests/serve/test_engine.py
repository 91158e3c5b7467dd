"""LLMEngine end to end on a tiny random model (against the model's own dense forward, recomputed from scratch
each token) and on the bundled model (against transformers' generate)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch

from quantkit.models.llama import LlamaForCausalLM, ModelConfig
from quantkit.serve.config import EngineConfig
from quantkit.serve.engine import LLMEngine
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.validation import context_length_message, validate_request
from tests.conftest import tiny_hf_config

EOS = 2  # the bundled tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer():
    from quantkit.models.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(tiny_hf_config(vocab_size=49152, max_position_embeddings=512)))
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # spread the logits: no near-ties in greedy comparisons
    return model.eval()


def tiny_engine(tiny, tokenizer, blocks=400, max_model_len=256, **kw):
    bytes_per_token = 2 * 2 * 2 * 16 * 4  # K and V x layers x kv heads x head_dim x fp32
    kw.setdefault("block_size", 4)
    cfg = EngineConfig(kv_cache_memory=blocks * kw["block_size"] * bytes_per_token, max_model_len=max_model_len, **kw)
    return LLMEngine(tiny, tokenizer, cfg, eos_token_ids=[EOS])


_dense_cache: dict = {}


@torch.inference_mode()
def dense_greedy(model, prompt, max_tokens):
    """Greedy tokens from the dense (non-paged) forward, the whole sequence recomputed for every token."""
    key = (id(model), tuple(prompt), max_tokens)
    if key not in _dense_cache:
        _dense_cache[key] = _dense_greedy(model, prompt, max_tokens)
    return _dense_cache[key]


def _dense_greedy(model, prompt, max_tokens):
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        token = int(model.logits(model.hidden(torch.tensor([ids]))[0, -1]).argmax())
        out.append(token)
        ids.append(token)
        if token == EOS:
            break
    return out


def add(engine, request_id, prompt, params):
    """Queue a request the way the entry points do: validated first, then handed to the engine."""
    engine.add_request(request_id, validate_request(prompt, params, engine.vocab_size, engine.max_model_len,
                                                    engine.cfg.max_num_seqs))


def run_all(engine, prompts, params):
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        add(engine, f"r{i}", p, sp)
    final, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        assert steps < 10000
    return [final[f"r{i}"] for i in range(len(prompts))]


def random_prompts(n, seed=0, shared=40):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 49152) for _ in range(shared)]
    return [(prefix if i % 2 else [])[: rng.randrange(shared + 1)] + [rng.randrange(3, 49152)
            for _ in range(rng.randrange(1, 60))] for i in range(n)]


@pytest.mark.parametrize("schedule", ["roomy", "chunked", "preempting", "bs16-preempting", "no-prefix-cache"])
def test_greedy_equals_dense_reference(tiny, tokenizer, schedule):
    options = {
        "roomy": dict(),
        "chunked": dict(max_num_batched_tokens=24, block_size=8),
        "preempting": dict(blocks=40, max_model_len=160, max_num_batched_tokens=64),
        "bs16-preempting": dict(block_size=16, blocks=36, max_model_len=192, max_num_batched_tokens=256),
        "no-prefix-cache": dict(enable_prefix_caching=False, max_num_batched_tokens=50),
    }[schedule]
    engine = tiny_engine(tiny, tokenizer, **options)
    long = schedule == "bs16-preempting"  # 32 requests of 94-184 tokens, the pool holds about 3 at once
    rng = random.Random(1)
    prompts = ([[rng.randrange(3, 49152) for _ in range(rng.randrange(70, 161))] for _ in range(32)] if long
               else random_prompts(24))
    max_tokens = 24 if long else 12
    outs = run_all(engine, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == dense_greedy(tiny, prompt, max_tokens)
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    stats = engine.stats()
    assert stats["kv_used_blocks"] == 0  # everything returned to the pool
    if schedule.endswith("preempting"):
        assert stats["num_preemptions"] > 0
        assert stats["kv_slot_utilization_samples"] > 0 and stats["kv_slot_utilization_mean"] >= 0.9
    if schedule == "chunked":  # later arrivals find the shared prefix of earlier ones
        assert stats["prefix_cache_hits"] > 0


def test_prompt_and_output_logprobs_match_dense(tiny, tokenizer):
    engine = tiny_engine(tiny, tokenizer, max_num_batched_tokens=16)  # prompt logprobs across prefill chunks
    prompt = random_prompts(2, seed=4)[1]
    out = run_all(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, prompt_logprobs=2))[0]
    completion = out.outputs[0]
    full = prompt + completion.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(tiny(torch.tensor([full]))[0], dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert set(ref[pos - 1].topk(2).indices.tolist()) | {prompt[pos]} == set(entry)
        for token, lp in entry.items():
            assert lp == pytest.approx(float(ref[pos - 1, token]), abs=1e-4)
    for i, token in enumerate(completion.token_ids):
        entry = completion.logprobs[i]
        assert list(entry)[:3] == ref[len(prompt) - 1 + i].topk(3).indices.tolist()
        assert entry[token] == pytest.approx(float(ref[len(prompt) - 1 + i, token]), abs=1e-4)
    assert completion.cumulative_logprob == pytest.approx(sum(e[t] for e, t in zip(completion.logprobs, completion.token_ids)))


def test_abort_and_finish_free_blocks_in_the_same_step(tiny, tokenizer):
    engine = tiny_engine(tiny, tokenizer, enable_prefix_caching=False)
    prompts = random_prompts(3, seed=5)
    for i, p in enumerate(prompts):
        add(engine, f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=1 if i == 2 else 10))
    outs = {o.request_id: o for o in engine.step()}
    assert outs["r2"].finished  # max_tokens=1: done at its first token, blocks already back
    held = {s.request.request_id: len(s.block_table) for s in engine.scheduler.running}
    assert set(held) == {"r0", "r1"} and engine.block_manager.num_used_blocks == sum(held.values())
    engine.step()
    victim = engine.requests["r0"].seqs[0]
    used = engine.block_manager.num_used_blocks
    assert engine.abort_request("r0") and not engine.abort_request("r0")
    assert engine.block_manager.num_used_blocks == used - (len(prompts[0]) + 2 + 3) // 4 and victim.block_table == []
    assert engine.stats()["request_success"] == {"length": 1, "abort": 1}
    rest = run_all_existing(engine)
    assert rest["r1"].outputs[0].token_ids == dense_greedy(tiny, prompts[1], 10)
    assert engine.block_manager.num_used_blocks == 0


def run_all_existing(engine):
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return final


def test_stop_strings_and_ids_never_leak_into_streamed_text(tiny, tokenizer):
    prompt = random_prompts(1, seed=6, shared=0)[0]
    free = run_all(tiny_engine(tiny, tokenizer), [prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=40))[0]
    text = free.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3
    engine = tiny_engine(tiny, tokenizer)
    add(engine, "s", prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=40, stop=[stop]))
    seen = []
    while engine.has_unfinished():
        seen += [o.outputs[0] for o in engine.step()]
    final = seen[-1]
    assert final.text == text[: text.index(stop)] and final.finish_reason == "stop" and final.stop_reason == stop
    for partial in seen:
        assert stop not in partial.text and final.text.startswith(partial.text)
    token = free.outputs[0].token_ids[5]
    by_id = run_all(tiny_engine(tiny, tokenizer), [prompt],
                    SamplingParams(temperature=1.0, seed=3, max_tokens=40, stop_token_ids=[token]))[0].outputs[0]
    cut = free.outputs[0].token_ids.index(token) + 1
    assert by_id.token_ids == free.outputs[0].token_ids[:cut] and by_id.stop_reason == token
    assert by_id.text == tokenizer.decode(by_id.token_ids[:-1])


def test_n_forks_share_the_prompt_and_match_single_seeded_runs(tiny, tokenizer):
    prompt = random_prompts(1, seed=7, shared=0)[0][:10] + [5] * 9  # 19 tokens: 4 full blocks + 3 in a 5th
    engine = tiny_engine(tiny, tokenizer)
    add(engine, "n", prompt, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8))
    engine.step()
    seqs = engine.requests["n"].seqs
    assert len(seqs) == 3
    tables = [s.block_table for s in seqs]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert len({t[4] for t in tables}) == 3  # the partial block was copied for each child
    assert [engine.block_manager.ref_counts[b] for b in tables[0][:4]] == [3, 3, 3, 3]
    forked = run_all_existing(engine)["n"]
    for i, completion in enumerate(forked.outputs):
        single = run_all(tiny_engine(tiny, tokenizer), [prompt],
                         SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8))[0]
        assert completion.index == i and completion.token_ids == single.outputs[0].token_ids


def test_seeded_sampling_does_not_depend_on_the_batch(tiny, tokenizer):
    prompts = random_prompts(6, seed=8)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=10)
    alone = run_all(tiny_engine(tiny, tokenizer), [prompts[0]], params)[0]
    crowd = run_all(tiny_engine(tiny, tokenizer), prompts, [params] + [SamplingParams(temperature=1.0, max_tokens=10)] * 5)
    assert crowd[0].outputs[0].token_ids == alone.outputs[0].token_ids


def test_max_tokens_none_runs_to_max_model_len(tiny, tokenizer):
    engine = tiny_engine(tiny, tokenizer, max_model_len=64)
    prompt = random_prompts(1, seed=9, shared=0)[0][:20]
    out = run_all(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 64 - 20 and out.outputs[0].finish_reason == "length"


def test_bad_requests_are_refused(tiny, tokenizer):
    engine = tiny_engine(tiny, tokenizer)
    with pytest.raises(ValueError) as e:
        add(engine, "a", [5] * 250, SamplingParams(max_tokens=10))
    assert str(e.value) == context_length_message(256, 10, 250)
    assert str(e.value) == (
        "This model's maximum context length is 256 tokens. However, you requested 10 output tokens and your "
        "prompt contains at least 250 input tokens, for a total of at least 260 tokens. Please reduce the length "
        "of the input prompt or the number of requested output tokens.")
    with pytest.raises(ValueError, match="out of vocabulary"):
        add(engine, "a", [49152], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        add(engine, "a", [5], SamplingParams(top_p=0.0))
    add(engine, "a", [5], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        add(engine, "a", [5], SamplingParams())
    assert not engine.step()[0].finished


def test_async_engine_streams_aborts_and_frees(tiny, tokenizer):
    from quantkit.serve.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(tiny_engine(tiny, tokenizer, enable_prefix_caching=False))
    prompts = random_prompts(2, seed=10)

    async def full():
        outs = [o async for o in engine.generate("full", prompts[0], SamplingParams(temperature=0.0, max_tokens=6))]
        return outs

    async def abandoned():
        async for out in engine.generate("gone", prompts[1], SamplingParams(temperature=0.0, max_tokens=200)):
            if len(out.outputs[0].token_ids) == 3:
                break

    async def main():
        outs, _ = await asyncio.gather(full(), abandoned())
        for _ in range(100):
            if not engine.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        return outs

    try:
        outs = asyncio.run(main())
        assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5, 6] and outs[-1].finished
        assert outs[-1].outputs[0].token_ids == dense_greedy(tiny, prompts[0], 6)
        stats = engine.stats()
        assert stats["kv_used_blocks"] == 0 and stats["request_success"] == {"length": 1, "abort": 1}
        with pytest.raises(ValueError, match="max_tokens"):
            asyncio.run(anext(engine.generate("bad", [5], SamplingParams(max_tokens=0))))
    finally:
        engine.shutdown()
    assert not engine.is_running


# ---------------------------------------------------------------- the bundled model against transformers

def chat_prompts(shared_data, tokenizer, count=16, max_prompt_tokens=100):
    """Real user prompts (8 ShareGPT, 8 AlpacaEval) under the model's chat template."""
    picked = []
    for name, path in (("sharegpt", "chat-sharegpt/sharegpt_v3_filtered_1000.jsonl"),
                       ("alpacaeval", "chat-alpacaeval/alpaca_eval_gpt4ref.jsonl")):
        rows = [json.loads(line) for line in (shared_data / path).read_text().split("\n") if line.strip()]
        taken = 0
        for row in rows:
            ids = tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            if len(ids) <= max_prompt_tokens:
                picked.append(list(ids))
                taken += 1
            if taken == count // 2:
                break
    return picked


@pytest.fixture(scope="module")
def bundled_reference(bundled, shared_data):
    from transformers import AutoModelForCausalLM

    from quantkit.models.loader import bundled_model_dir

    hf = AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32).eval()
    prompts = chat_prompts(shared_data, bundled.tokenizer)
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=EOS)
            refs.append(out.sequences[0, len(p):].tolist())
    return prompts, refs


MAX_NEW = 16


def assert_same_or_tie(ours, ref):
    """Token-identical, or identical up to a position where our top-2 logprobs are within 1e-3 (a tie).
    ours: a CompletionOutput generated with logprobs=2 (the runner-up is in every entry)."""
    ids = ours.token_ids
    for pos, (a, b) in enumerate(zip(ids, ref)):
        if a != b:
            top = sorted(ours.logprobs[pos].values(), reverse=True)[:2]
            assert top[0] - top[1] < 1e-3, f"diverged at {pos} without a tie: {top}"
            return pos
    assert len(ids) == len(ref)
    return None


@pytest.mark.slow
def test_bundled_greedy_matches_transformers_at_batch_1_and_16(bundled, bundled_reference):
    from quantkit.serve.llm import LLM

    prompts, refs = bundled_reference
    assert len(prompts) == 16
    llm = LLM(bundled, kv_cache_memory=256 << 20, max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2)
    for p, ref in zip(prompts, refs):
        assert_same_or_tie(llm.generate([p], params)[0].outputs[0], ref)
    batch = llm.generate(prompts, params)
    ties = [assert_same_or_tie(o.outputs[0], ref) for o, ref in zip(batch, refs)]
    assert ties.count(None) >= 14
    assert llm.engine.stats()["kv_used_blocks"] == 0


@pytest.mark.slow
def test_bundled_small_pool_preempts_and_matches(bundled, bundled_reference):
    from quantkit.serve.llm import LLM

    prompts, refs = bundled_reference
    longest = max(len(p) for p in prompts) + MAX_NEW
    bytes_per_token = 2 * 30 * 3 * 64 * 4
    llm = LLM(bundled, kv_cache_memory=3 * longest * bytes_per_token, max_model_len=longest, block_size=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2))
    for o, ref in zip(outs, refs):
        assert_same_or_tie(o.outputs[0], ref)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_used_blocks"] == 0

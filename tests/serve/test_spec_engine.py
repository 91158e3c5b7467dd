"""Speculative decoding in the engine: greedy output identical to no speculation (both proposers, every schedule:
batch 1, concurrent, chunked, preempting), the sampled distribution preserved (chi-square against the exact
target distribution), and the automatic switch-offs."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from quantkit.models.llama import LlamaForCausalLM, ModelConfig
from quantkit.serve.config import EngineConfig
from quantkit.serve.engine import LLMEngine
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.speculative import target_probs
from tests.conftest import tiny_hf_config
from tests.serve.test_engine import EOS, assert_same_or_tie, chat_prompts, dense_greedy, random_prompts, run_all
from tests.serve.test_spec_decode import ALPHA, chi_square_pvalue

KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny config: K and V x 2 layers x 2 kv heads x head_dim 16 x fp32


@pytest.fixture(scope="module")
def tokenizer():
    from quantkit.models.loader import load_tokenizer

    return load_tokenizer(None)


def tiny_model(seed: int, vocab_size: int = 49152, logit_scale: float = 4.0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(ModelConfig.from_hf(tiny_hf_config(vocab_size=vocab_size, max_position_embeddings=512)))
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)  # spread the logits: no near-ties in greedy comparisons
    return model.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


def spec_engine(model, tokenizer, draft=None, blocks=400, block_size=4, **kw) -> LLMEngine:
    pools = 2 if draft is not None else 1  # the draft's pool mirrors the target's blocks
    kw.setdefault("max_model_len", 256)
    kw.setdefault("speculative_min_acceptance", 0.0)
    kw.setdefault("speculative_disable_by_batch_size", 1024)
    if draft is not None:
        kw.update(speculative_method="draft", speculative_model="in-memory")
    cfg = EngineConfig(kv_cache_memory=pools * blocks * block_size * KV_BYTES_PER_TOKEN, block_size=block_size, **kw)
    return LLMEngine(model, tokenizer, cfg, eos_token_ids=[EOS], draft_model=draft)


SCHEDULES = {
    "roomy": dict(),
    "chunked": dict(max_num_batched_tokens=24, block_size=8),
    "preempting": dict(blocks=40, max_model_len=160, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("proposer", ["self-draft", "other-draft", "ngram"])
def test_greedy_with_speculation_equals_dense_reference(target, tokenizer, schedule, proposer):
    """24 requests at once (and under preemption): every output equals the target's own greedy decode."""
    opts = dict(SCHEDULES[schedule])
    if proposer == "ngram":  # a 16-token vocabulary repeats itself, so prompt lookup finds matches
        model, draft, opts = tiny_model(0, vocab_size=16, logit_scale=1.0), None, {**opts, "speculative_method": "ngram"}
        rng = random.Random(2)
        prompts = [[rng.randrange(3, 16) for _ in range(rng.randrange(2, 40))] for _ in range(24)]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    else:
        model, draft = target, (target if proposer == "self-draft" else tiny_model(5))
        prompts = random_prompts(24)
        params = SamplingParams(temperature=0.0, max_tokens=24)
    engine = spec_engine(model, tokenizer, draft, **opts)
    outs = run_all(engine, prompts, params)
    for prompt, out in zip(prompts, outs):
        ref = dense_greedy(model, prompt, 24)
        if params.ignore_eos:
            ref = _dense_greedy_ignore_eos(model, prompt, 24)
        assert out.outputs[0].token_ids == ref
    stats = engine.stats()
    assert stats["kv_used_blocks"] == 0
    assert stats["spec_decode_num_draft_tokens"] > 0
    accepted = stats["spec_decode_num_accepted_tokens"]
    if proposer == "self-draft":  # the target drafting for itself: everything accepted
        assert accepted == stats["spec_decode_num_draft_tokens"]
    elif proposer == "ngram":
        assert accepted > 0
    assert sum(stats["spec_decode_accepted_per_position"].values()) == accepted
    if schedule == "preempting":
        assert stats["num_preemptions"] > 0


@torch.inference_mode()
def _dense_greedy_ignore_eos(model, prompt, max_tokens):
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model.logits(model.hidden(torch.tensor([ids]))[0, -1]).argmax()))
    return ids[len(prompt):]


@torch.inference_mode()
def exact_pair_distribution(model, prompt, params) -> torch.Tensor:
    """P(t1, t2) [V, V] of the 2nd and 3rd sampled tokens, summed over the 1st, under the sampler's filtered
    distribution (temperature, top-p) of the dense target."""
    vocab = model.config.vocab_size
    logits0 = model.logits(model.hidden(torch.tensor([prompt]))[0, -1])[None]
    p0 = target_probs(logits0, params)[0].double()  # [V]
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for t0 in range(vocab):
        seqs = torch.tensor([prompt + [t0, t1] for t1 in range(vocab)])  # [V, L + 2]
        logits = model.logits(model.hidden(seqs))  # [V, L + 2, V]
        p1 = target_probs(logits[0, -2][None], params)[0].double()  # P(t1 | t0)
        p2 = target_probs(logits[:, -1], params).double()  # [t1, t2] P(t2 | t0, t1)
        joint += p0[t0] * p1[:, None] * p2
    return joint


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_sampled_distribution_is_preserved(tokenizer, proposer):
    """A 6-token vocabulary: 3000 requests sample 4 tokens each with speculation on (rejections happen: the draft is
    a different model). The 2nd and 3rd tokens, which speculation proposed and verified, must follow the exact
    target distribution: chi-square over the 36 cells at significance ALPHA (seeded, so deterministic)."""
    vocab, n = 6, 3000
    model = tiny_model(0, vocab_size=vocab, logit_scale=1.0)
    draft = tiny_model(7, vocab_size=vocab, logit_scale=1.0) if proposer == "draft" else None
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=4, ignore_eos=True)
    opts = {} if draft is not None else {"speculative_method": "ngram", "ngram_prompt_lookup_min": 1}
    engine = spec_engine(model, tokenizer, draft, blocks=4000, max_num_seqs=256, max_num_batched_tokens=4096,
                         num_speculative_tokens=2, seed=11, **opts)
    prompt = [3, 4, 5, 3, 4]
    outs = run_all(engine, [prompt] * n, params)
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for out in outs:
        t = out.outputs[0].token_ids
        counts[t[1], t[2]] += 1
    stats = engine.stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert drafted > n and 0 < accepted < drafted  # speculation ran, with rejections
    expected = exact_pair_distribution(model, prompt, params)
    assert chi_square_pvalue(counts.flatten(), expected.flatten()) > ALPHA


def test_speculation_switches_off_by_batch_size_and_by_poor_acceptance(target, tokenizer):
    prompts = random_prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    busy = spec_engine(target, tokenizer, tiny_model(5), speculative_disable_by_batch_size=4)
    run_all(busy, prompts, params)  # 8 decoding at once, then fewer as they finish
    few = spec_engine(target, tokenizer, tiny_model(5), speculative_disable_by_batch_size=4)
    run_all(few, prompts[:4], params)
    assert busy.stats()["spec_decode_num_drafts"] < few.stats()["spec_decode_num_drafts"]

    poor = spec_engine(target, tokenizer, tiny_model(5), speculative_min_acceptance=0.5)
    outs = run_all(poor, prompts[:1], params)  # an unrelated draft: nothing accepted, off after 16 drafts
    assert outs[0].outputs[0].token_ids == dense_greedy(target, prompts[0], 24)
    assert poor.stats()["spec_decode_num_draft_tokens"] == 16


# ---- the bundled model: 32 real prompts, fp32, greedy


@pytest.fixture(scope="module")
def bundled_w4_draft(bundled):
    """The W4 g64 RTN copy of the bundled model, the self-draft quantization makes, with its packed weights
    dequantized once into fp32 Linears (the same function; QLinear's fp32 path would dequantize every forward)."""
    from quantkit.config import CalibConfig
    from quantkit.quant.calibrate import calibrate
    from quantkit.quant.qlinear import QLinear
    from quantkit.quant.scheme import dequantize

    draft = copy.deepcopy(bundled.model)
    calibrate(draft, bundled.hf_config, None, CalibConfig.from_flat({"method": "rtn", "group_size": 64}),
              progress=False, log=lambda _: None)
    for block in draft.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, QLinear):
                    linear = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                    linear.weight.data = dequantize(child.qtensor())
                    if child.bias is not None:
                        linear.bias.data = child.bias.float()
                    setattr(parent, name, linear)
    assert not any(isinstance(m, QLinear) for m in draft.modules())
    return draft.eval()


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["w4-self-draft", "ngram"])
def test_bundled_greedy_with_speculation_matches_without(bundled, bundled_w4_draft, shared_data, proposer):
    """32 real chat prompts: every fourth one at a time, and all 32 at once in a pool small enough to preempt; every
    output equals the engine's own output without speculation (or diverges only at a numerical tie)."""
    prompts = chat_prompts(shared_data, bundled.tokenizer, count=32)
    assert len(prompts) == 32
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    longest = max(len(p) for p in prompts) + 16
    kv_per_token = 2 * 30 * 3 * 64 * 4
    spec = (dict(speculative_method="draft", speculative_model="w4") if proposer == "w4-self-draft"
            else dict(speculative_method="ngram"))
    draft = bundled_w4_draft if proposer == "w4-self-draft" else None

    def engine(memory_tokens, **kw):
        pools = 2 if kw.get("speculative_method") == "draft" else 1
        cfg = EngineConfig(kv_cache_memory=pools * memory_tokens * kv_per_token, max_model_len=longest, **kw)
        return LLMEngine(bundled.model, bundled.tokenizer, cfg, eos_token_ids=[EOS], draft_model=draft)

    refs = [o.outputs[0].token_ids for o in run_all(engine(32 * longest), prompts, params)]
    one = engine(2 * longest, **spec)
    singles = [run_all(one, [p], params)[0] for p in prompts[::4]]  # batch 1: 8 prompts, 4 from each source
    crowded = engine(4 * longest, speculative_disable_by_batch_size=64, speculative_min_acceptance=0.0, **spec)
    together = run_all(crowded, prompts, params)
    for outs, expected in ((singles, refs[::4]), (together, refs)):
        ties = [assert_same_or_tie(o.outputs[0], ref) for o, ref in zip(outs, expected, strict=True)]
        assert ties.count(None) >= len(outs) - 2
    stats = crowded.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_used_blocks"] == 0
    assert one.stats()["spec_decode_num_accepted_tokens"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow
def test_http_server_with_ngram_speculation_streams_the_same_text_and_exports_metrics(bundled):
    """`quantkit serve --speculative-method ngram` behind the real HTTP API and the official openai client: the
    streamed text of a repetitive prompt equals the non-streamed one and the engine without speculation (fp32),
    and /metrics counts drafts, accepted tokens and acceptance by position."""
    import httpx
    from openai import OpenAI

    from quantkit.serve.llm import LLM
    from tests.serve.api_live import live_server, serving_app

    lines = "\n".join(f"{i}. the quick brown fox jumps over the lazy dog" for i in range(1, 9))
    prompt = f"{lines}\n9."
    expected = LLM(bundled, kv_cache_memory=64 << 20, max_model_len=512).generate(prompt, SamplingParams(temperature=0.0, max_tokens=40))
    with serving_app(bundled, "spec", kv_cache_memory=64 << 20, max_model_len=512, speculative_method="ngram") as app:
        with live_server(app) as url:
            client = OpenAI(base_url=url + "/v1", api_key="none")
            whole = client.completions.create(model="spec", prompt=prompt, max_tokens=40, temperature=0)
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model="spec", prompt=prompt, max_tokens=40, temperature=0, stream=True) if c.choices)
            metrics = httpx.get(url + "/metrics").text
    assert whole.choices[0].text == streamed == expected[0].outputs[0].text
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("quantkit:spec_decode") and "position=\"0\"" not in line}
    assert counts["quantkit:spec_decode_num_accepted_tokens_total"] > 0
    assert counts["quantkit:spec_decode_num_draft_tokens_total"] >= counts["quantkit:spec_decode_num_accepted_tokens_total"]
    assert 'quantkit:spec_decode_num_accepted_tokens_per_pos_total{model_name="spec",position="0"}' in metrics

"""Speculative decoding of constrained sequences (structured output under xgrammar, speculative.py + structured.py).

Greedy (fp32, a tiny random target over the bundled tokenizer): with n-gram, self-draft and other-draft speculation a
json_schema, a guided_choice and a regex request emit the tokens they emit without speculation, and drafts were
accepted for them; a batch mixing them with unconstrained requests leaves every output as it was. Sampled: the
token paths of a regex request follow the exact masked target distribution (chi-square against a dense forward
masked by its own xgrammar matcher), with a draft model that is rejected often.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.speculative import target_probs
from quantkit.serve.structured import GuidedDecoding
from tests.serve.test_engine import EOS, add, dense_greedy, random_prompts, run_all
from tests.serve.test_spec_decode import ALPHA, chi_square_pvalue
from tests.serve.test_spec_engine import spec_engine, tiny_model
from tests.serve.test_structured_output import REGEX, SCHEMA, check_schema

CHOICES = ["positive", "negative", "neutral"]
SAMPLE = '{"name": "abc", "color": "red", "ok": false}'  # in every prompt: the outputs' shapes
CASES = {
    "json": (GuidedDecoding("response_format", {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
                            "response_format"), 60),
    "choice": (GuidedDecoding("choice", CHOICES, "guided_choice"), 12),
    "regex": (GuidedDecoding("regex", REGEX, "guided_regex"), 12),
}
PROPOSERS = {
    "ngram": dict(speculative_method="ngram", ngram_prompt_lookup_min=1),
    "self-draft": {},
    "other-draft": {},
}


@pytest.fixture(scope="module")
def tokenizer():
    from quantkit.models.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def other_draft():
    return tiny_model(5)


@pytest.fixture
def speculative(target, tokenizer, other_draft):
    """proposer name -> a fresh engine speculating with it."""
    def make(proposer):
        draft = {"ngram": None, "self-draft": target, "other-draft": other_draft}[proposer]
        return spec_engine(target, tokenizer, draft, **PROPOSERS[proposer])
    return make


def base_prompts(tokenizer, count):
    return [tokenizer(f"{SAMPLE}\n{' or '.join(CHOICES)}? xqz-42, {SAMPLE}\nItem {i}:").input_ids
            for i in range(count)]


@pytest.fixture(scope="module")
def greedy_case(target, tokenizer):
    """case -> (requests, their outputs without speculation). Each prompt ends with a base prompt's greedy
    output and the base's last 3 tokens again, so prompt lookup drafts what the target is about to emit."""
    cache = {}

    def get(case):
        if case not in cache:
            guided, max_tokens = CASES[case]
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, guided=guided)
            base = {f"r{i}": (p, params) for i, p in enumerate(base_prompts(tokenizer, 3))}
            first, _ = run_requests(spec_engine(target, tokenizer), base)
            requests = {rid: (p + first[rid].token_ids[:-1] + p[-3:], params) for rid, (p, _) in base.items()}
            cache[case] = requests, run_requests(spec_engine(target, tokenizer), requests)[0]
        return cache[case]
    return get


def check_output(case: str, text: str) -> None:
    if case == "json":
        check_schema(json.loads(text))
    elif case == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(REGEX, text), text


def run_requests(engine, requests):
    """requests: {id: (prompt, params)} -> ({id: CompletionOutput}, {id: its Request, kept for its counters})."""
    for rid, (prompt, params) in requests.items():
        add(engine, rid, prompt, params)
    kept = {rid: engine.requests[rid] for rid in requests}
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    return final, kept


def compile_grammar(tokenizer, vocab: int, grammar):
    """The test's own xgrammar compile (EOS the stop token), independent of the engine's."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=max(len(tokenizer), vocab), stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info).compile_grammar(grammar)


def allowed_by(matcher, vocab: int) -> torch.Tensor:
    """[vocab] bool: what the (independent) matcher allows next, unpacked from its xgrammar bitmask."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    return ((bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab].bool()


def test_draft_rows_are_masked_by_the_grammar_after_the_drafts_before_them(tokenizer):
    import xgrammar as xgr

    from quantkit.serve.spec_decode import verify_greedy
    from quantkit.serve.structured import StructuredOutputs, mask_drafts

    vocab = 49152
    structured = StructuredOutputs(tokenizer, vocab, {EOS})
    state = structured.start(GuidedDecoding("choice", CHOICES, "guided_choice"))
    p, osit, ive, x = tokenizer.convert_tokens_to_ids(["p", "osit", "ive", "x"])
    before = allowed_by(state.matcher, vocab)
    assert state.valid_prefix([p, osit, ive, EOS, p]) == 4  # nothing after the grammar's end
    assert state.valid_prefix([p, x, ive]) == 1
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    drafts = [p, osit, ive, EOS]
    masked = mask_drafts(logits, state, drafts)
    choices = xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in CHOICES))
    reference = xgr.GrammarMatcher(compile_grammar(tokenizer, vocab, choices))
    for i, token in enumerate(drafts):
        ok = allowed_by(reference, vocab)
        assert torch.equal(masked[i], torch.where(ok, logits[i], float("-inf")))
        assert reference.accept_token(token)
    assert torch.equal(masked[4], logits[4])  # past the grammar's end: left as it was (verify stops at EOS)
    logits[0, p] = logits[1, x] = 100.0  # the target's unmasked argmax: the drafts
    refused = mask_drafts(logits[:4], state, [p, x, ive])
    assert torch.isinf(refused[1, x]) and torch.equal(refused[2:], logits[2:4])  # rows past x are never used
    emitted = verify_greedy(refused.max(dim=-1).indices.tolist(), [p, x, ive])
    after_p = xgr.GrammarMatcher(compile_grammar(tokenizer, vocab, choices))
    assert after_p.accept_token(p)
    assert emitted[:1] == [p] and len(emitted) == 2 and allowed_by(after_p, vocab)[emitted[1]]  # x rejected
    assert torch.equal(allowed_by(state.matcher, vocab), before)  # every walk was rolled back


@pytest.mark.parametrize("proposer", list(PROPOSERS))
@pytest.mark.parametrize("case", list(CASES))
def test_constrained_greedy_with_speculation_equals_without(greedy_case, speculative, case, proposer):
    requests, ref = greedy_case(case)
    engine = speculative(proposer)
    outs, _ = run_requests(engine, requests)
    for rid in requests:
        assert outs[rid].token_ids == ref[rid].token_ids
        assert outs[rid].finish_reason == "stop"
        check_output(case, outs[rid].text)
    stats = engine.stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert accepted > 0  # speculation ran for the constrained sequences (they are the only ones)
    if proposer == "self-draft":  # the target drafting for itself under the same mask: every draft accepted
        assert accepted == drafted
    elif proposer == "other-draft":
        assert accepted < drafted  # drafts the target refused were rejected
    assert stats["kv_used_blocks"] == 0


@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_mixed_batch_of_constrained_and_unconstrained_sequences(target, tokenizer, greedy_case, speculative,
                                                                 proposer):
    """Constrained and unconstrained requests in the same steps: every output equals its output without
    speculation (the unconstrained ones the dense reference too), and each constrained sequence had drafts accepted."""
    requests = {case: greedy_case(case)[0]["r0"] for case in CASES}
    plain = random_prompts(3, seed=4)
    if proposer == "ngram":  # repetitive prompts: prompt lookup drafts for them too
        plain = [p[:8] * 4 for p in plain]
    requests.update({f"plain{i}": (p, SamplingParams(temperature=0.0, max_tokens=24)) for i, p in enumerate(plain)})
    ref, _ = run_requests(spec_engine(target, tokenizer), requests)
    outs, kept = run_requests(speculative(proposer), requests)
    for rid, (prompt, _) in requests.items():
        assert outs[rid].token_ids == ref[rid].token_ids, rid
    for i, p in enumerate(plain):
        assert outs[f"plain{i}"].token_ids == dense_greedy(target, p, 24)
    for case in CASES:
        check_output(case, outs[case].text)
        assert kept[case].seqs[0].spec_accepted > 0, case


# ---- sampled: the masked distribution is preserved

SAMPLED_REGEX = "[ab]{3}"


@torch.inference_mode()
def exact_path_distribution(model, tokenizer, prompt, params) -> dict[tuple[int, ...], float]:
    """Every token path (EOS included) the regex admits -> its probability under the sampler's rule: the dense
    forward's logits masked by an xgrammar matcher of the regex, then temperature / top-p (target_probs)."""
    import xgrammar as xgr

    compiled = compile_grammar(tokenizer, model.config.vocab_size, xgr.Grammar.from_regex(SAMPLED_REGEX))
    out: dict[tuple[int, ...], float] = {}

    def walk(path: list[int], prob: float, matcher) -> None:
        if matcher.is_terminated():
            out[tuple(path)] = prob
            return
        logits = model.logits(model.hidden(torch.tensor([prompt + path]))[0, -1])[None].clone()
        bitmask = xgr.allocate_token_bitmask(1, max(len(tokenizer), model.config.vocab_size))
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1])
        p = target_probs(logits, params)[0].double()
        for token in p.nonzero().flatten().tolist():
            child = matcher.fork()
            assert child.accept_token(token)
            walk(path + [token], prob * float(p[token]), child)

    walk([], 1.0, xgr.GrammarMatcher(compiled))
    return out


def test_sampled_constrained_distribution_is_preserved(tokenizer):
    """600 seeded requests sample a regex's token paths with a draft model (2 drafts a step, many rejected):
    the paths' frequencies fit the exact masked distribution (chi-square at ALPHA; cells under 5 expected merged).
    The draft model is the harder proposer: its q is masked too (an n-gram draft's q is one-hot)."""
    n = 600
    model, draft = tiny_model(0, logit_scale=2.0), tiny_model(7, logit_scale=2.0)  # at 600: T 0.8 told from 0.6, 1.1
    guided = GuidedDecoding("regex", SAMPLED_REGEX, "guided_regex")
    params = SamplingParams(temperature=0.8, max_tokens=4, guided=guided)
    engine = spec_engine(model, tokenizer, draft, blocks=1200, max_num_seqs=256, max_num_batched_tokens=4096,
                         num_speculative_tokens=2, seed=5)
    prompt = tokenizer("ab ba aab bab abb a b aa bb").input_ids
    outs = run_all(engine, [prompt] * n, params)
    exact = exact_path_distribution(model, tokenizer, prompt, params)
    paths = sorted(exact, key=exact.get, reverse=True)
    counts = torch.zeros(len(paths), dtype=torch.float64)
    for out in outs:
        path = tuple(out.outputs[0].token_ids)
        assert path in exact, path  # the grammar held (and the path ends with EOS)
        counts[paths.index(path)] += 1
    expected = torch.tensor([exact[p] for p in paths], dtype=torch.float64)
    assert abs(float(expected.sum()) - 1.0) < 1e-6
    big = int((expected * n >= 5).sum())  # the rare paths pooled into one cell
    counts = torch.cat([counts[:big], counts[big:].sum(0, keepdim=True)])
    expected = torch.cat([expected[:big], expected[big:].sum(0, keepdim=True)])
    stats = engine.stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert drafted > n / 2 and 0 < accepted < drafted  # speculation ran, with rejections
    assert big >= 4
    assert chi_square_pvalue(counts, expected) > ALPHA

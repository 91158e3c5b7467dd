"""Sampler against numpy references: greedy, temperature frequencies, top-k / top-p / min-p supports, penalties,
min_tokens, seeds independent of the batch, and logprobs from the raw distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantkit.serve.sampler import Sampler, apply_penalties, filter_logits
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.sequence import Request

EOS = 3


def make_seq(params, prompt=(1, 2), outputs=()):
    seq = Request("r", list(prompt), params, None, 100).seqs[0]
    seq.token_ids.extend(outputs)
    return seq


def logits_rows(rows, vocab=8, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_greedy_is_argmax():
    logits = logits_rows(5, vocab=50)
    seqs = [make_seq(SamplingParams(temperature=0.0))] * 5
    out = Sampler({EOS})(logits, seqs, [None] * 5)
    assert out.tokens == logits.argmax(-1).tolist()


def test_temperature_sampling_matches_softmax():
    rows = 40000
    base = logits_rows(1)[0]
    seq = make_seq(SamplingParams(temperature=0.7))
    out = Sampler({EOS}, seed=1)(base.expand(rows, -1).clone(), [seq] * rows, [None] * rows)
    freq = np.bincount(out.tokens, minlength=8) / rows
    expected = np_softmax(base.double().numpy() / 0.7)
    assert np.abs(freq - expected).max() < 0.012, (freq, expected)


def reference_mask(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """True where a token stays samplable (vLLM semantics), one row."""
    keep = np.ones_like(logits, dtype=bool)
    order = np.argsort(-logits, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        probs = np_softmax(np.where(keep, logits, -np.inf))
        cumulative = 0.0
        for tok in order:
            if not keep[tok]:
                continue
            if cumulative >= top_p:
                keep[tok] = False
            cumulative += probs[tok]
    if min_p > 0:
        probs = np_softmax(np.where(keep, logits, -np.inf))
        keep &= probs >= min_p * probs.max()
    return keep


@pytest.mark.parametrize("top_k,top_p,min_p", [(3, 1.0, 0.0), (-1, 0.6, 0.0), (5, 0.8, 0.0), (-1, 1.0, 0.2),
                                               (4, 0.9, 0.1), (1, 1.0, 0.0), (-1, 0.01, 0.0)])
def test_filters_keep_exactly_the_reference_support(top_k, top_p, min_p):
    logits = logits_rows(6, vocab=32, seed=3)
    params = [SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p)] * 6
    kept = torch.isfinite(filter_logits(logits, params)).numpy()
    for row in range(6):
        assert (kept[row] == reference_mask(logits[row].double().numpy(), top_k, top_p, min_p)).all()


def test_sampled_tokens_stay_in_the_top_k():
    rows = 2000
    base = logits_rows(1, vocab=16, seed=5)[0]
    seq = make_seq(SamplingParams(temperature=1.5, top_k=3))
    out = Sampler({EOS})(base.expand(rows, -1).clone(), [seq] * rows, [None] * rows)
    assert set(out.tokens) == set(base.topk(3).indices.tolist())


def test_penalties_follow_vllm_formulas():
    vocab = 10
    logits = logits_rows(2, vocab=vocab, seed=7)
    prompts, outputs = [[1, 2, 2], [5]], [[2, 4, 4, 4], []]
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0)]
    got = apply_penalties(logits.clone(), prompts, outputs, params).numpy()
    for row in range(2):
        p = params[row]
        for tok in range(vocab):
            x = float(logits[row, tok])
            if tok in prompts[row] or tok in outputs[row]:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            count = outputs[row].count(tok)
            x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            assert got[row, tok] == pytest.approx(x, abs=1e-5)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, 8)
    logits[:, EOS] = 10.0
    logits[:, 6] = 9.0
    logits[:, 5] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6])
    early, late = make_seq(params, outputs=[0]), make_seq(params, outputs=[0, 0])
    out = Sampler({EOS})(logits, [early, late], [None, None])
    assert out.tokens == [5, EOS]
    ignore = make_seq(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True))
    assert Sampler({EOS})(logits[:1], [ignore], [None]).tokens == [EOS]  # ignore_eos: EOS is just a token


def test_seeded_rows_do_not_depend_on_the_batch():
    base = logits_rows(1, vocab=64, seed=9)[0]
    params = SamplingParams(temperature=1.0, seed=123)
    seq = make_seq(params)

    def draws(extra_rows):
        gen = torch.Generator().manual_seed(123)
        sampler, tokens = Sampler({EOS}, seed=extra_rows), []
        for _ in range(20):
            rows = 1 + extra_rows
            other = make_seq(SamplingParams(temperature=1.0))
            out = sampler(base.expand(rows, -1).clone(), [other] * extra_rows + [seq], [None] * extra_rows + [gen])
            tokens.append(out.tokens[-1])
        return tokens

    alone = draws(0)
    assert alone == draws(5) == draws(17)
    assert len(set(alone)) > 3  # really sampling


def test_logprobs_are_raw_log_softmax_with_top_k_then_chosen():
    logits = logits_rows(3, vocab=12, seed=11)
    seqs = [make_seq(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5), outputs=[0, 1]),
            make_seq(SamplingParams(temperature=0.0, logprobs=0)),
            make_seq(SamplingParams(temperature=0.0))]
    out = Sampler({EOS})(logits, seqs, [None] * 3)
    x = logits.double().numpy()
    ref = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
    top2 = np.argsort(-ref[0])[:2]
    entry = out.logprobs[0]
    assert list(entry)[:2] == top2.tolist()
    assert set(entry) == set(top2.tolist()) | {out.tokens[0]}
    for tok, lp in entry.items():
        assert lp == pytest.approx(ref[0, tok], abs=1e-5)
    assert out.chosen_logprobs[0] == pytest.approx(ref[0, out.tokens[0]], abs=1e-5)
    assert list(out.logprobs[1]) == [out.tokens[1]]
    assert out.logprobs[2] is None and out.chosen_logprobs[2] is None

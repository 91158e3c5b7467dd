"""Speculative decoding's acceptance rule preserves the target distribution; proposers are exact."""

from __future__ import annotations

import pytest
import torch

from quantkit.serve.spec_decode import ngram_propose, verify_greedy, verify_sampled

ALPHA = 1e-3  # significance of the chi-square tests: a correct sampler fails one in a thousand runs (seeded: never)


def chi_square_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; p-value from the regularised upper incomplete gamma function."""
    n = counts.sum()
    keep = expected_probs > 0
    assert counts[~keep].sum() == 0, "a zero-probability outcome was sampled"
    exp = expected_probs[keep] * n
    stat = ((counts[keep] - exp) ** 2 / exp).sum()
    dof = keep.sum() - 1
    return float(torch.special.gammaincc(dof.double() / 2, stat.double() / 2))


def test_ngram_finds_latest_longest_match():
    tokens = [5, 6, 7, 8, 1, 2, 5, 6, 7, 9, 4, 5, 6, 7]
    # last 3 tokens (5,6,7) occur at 0 (-> 8,1,...) and 6 (-> 9,4,...): the most recent wins
    assert ngram_propose(tokens, k=3) == [9, 4, 5]
    assert ngram_propose([1, 2, 3], k=4) == []  # no earlier occurrence
    assert ngram_propose([3, 1, 2, 3], k=4, max_n=2) == [1, 2, 3]  # falls back to n=1
    assert ngram_propose([7], k=2) == []


def test_verify_greedy_accepts_prefix_then_target_token():
    assert verify_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all accepted + bonus
    assert verify_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]  # first mismatch -> target's token
    assert verify_greedy([1, 2], [3]) == [1]
    assert verify_greedy([8], []) == [8]


def _random_probs(gen, *shape):
    return torch.softmax(torch.randn(*shape, generator=gen) * 1.5, dim=-1).double()


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_rejection_sampling_reproduces_the_target_joint_distribution(deterministic_draft):
    """Target: a 2-step 'model' over V=5 tokens, p0(t0) then p1(t1 | t0). The draft proposes 2 tokens from its own
    (different) q; the emitted first two tokens must follow p0(t0) p1(t1|t0) exactly (chi-square over 25 cells)."""
    V, N = 5, 20_000
    gen = torch.Generator().manual_seed(1234)
    p0, p1, p2 = _random_probs(gen, V), _random_probs(gen, V, V), _random_probs(gen, V, V, V)
    q0, q1 = _random_probs(gen, V), _random_probs(gen, V, V)
    counts = torch.zeros(V, V, dtype=torch.float64)
    emitted_lengths = torch.zeros(4)
    for _ in range(N):
        if deterministic_draft:  # n-gram-like: fixed proposal [2, 3]
            draft, q = [2, 3], None
        else:
            d0 = int(torch.multinomial(q0.float(), 1, generator=gen))
            d1 = int(torch.multinomial(q1[d0].float(), 1, generator=gen))
            draft, q = [d0, d1], torch.stack([q0, q1[d0]])
        p = torch.stack([p0, p1[draft[0]], p2[draft[0], draft[1]]])  # target scored on the drafted prefix
        out = verify_sampled(p, draft, q, generator=gen)
        emitted_lengths[len(out)] += 1
        if len(out) == 1:  # rejected at position 0: continue with the target alone for t1
            out.append(int(torch.multinomial(p1[out[0]].float(), 1, generator=gen)))
        counts[out[0], out[1]] += 1
    joint = p0[:, None] * p1
    assert chi_square_pvalue(counts.flatten(), joint.flatten()) > ALPHA
    assert emitted_lengths[3] > 0 and emitted_lengths[1] > 0  # both full acceptance and early rejection happened


def test_identical_draft_is_always_accepted():
    gen = torch.Generator().manual_seed(0)
    p = _random_probs(gen, 4, 7)
    for _ in range(200):
        draft = [int(torch.multinomial(p[i].float(), 1, generator=gen)) for i in range(3)]
        assert len(verify_sampled(p, draft, p[:3], generator=gen)) == 4

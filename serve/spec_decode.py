"""Speculative decoding: proposers and the acceptance rule (pure functions; the engine wires them into its step).

A proposer drafts k tokens per sequence; the target scores all k+1 positions in one pass; `verify` keeps the
accepted prefix plus one token of the target's own, so every step emits between 1 and k+1 tokens and the
emitted sequence has exactly the target's distribution (Leviathan et al. 2023, Chen et al. 2023):

  accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i));
  at the first rejection emit a sample of the residual norm(max(0, p_i - q_i)) and stop;
  when all k are accepted emit a sample of p_k (the bonus token).

Greedy requests (temperature 0) are the degenerate case: accept while x_i == argmax p_i, then emit argmax p_i.
A deterministic proposer (n-gram lookup) has q_i = one-hot(x_i), so acceptance is p_i(x_i) and the residual is
p_i with x_i removed.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def ngram_propose(tokens: Sequence[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens (longest n first,
    max_n down to min_n) and propose up to k tokens that followed it. [] when nothing matches."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n:])
        # scan right to left over earlier windows; the window may not be the suffix itself
        for start in range(length - n - 1, -1, -1):
            if list(tokens[start:start + n]) == suffix:
                follow = list(tokens[start + n:start + n + k])
                if follow:
                    return follow
    return []


def verify_greedy(target_argmax: Sequence[int], draft: Sequence[int]) -> list[int]:
    """target_argmax [k+1] (argmax of p_0..p_k), draft [k] -> emitted tokens (1..k+1)."""
    out: list[int] = []
    for i, token in enumerate(draft):
        if token != target_argmax[i]:
            break
        out.append(token)
    out.append(int(target_argmax[len(out)]))
    return out


def verify_sampled(p: torch.Tensor, draft: Sequence[int], q: Optional[torch.Tensor] = None,
                   generator: Optional[torch.Generator] = None) -> list[int]:
    """Rejection sampling. p [k+1, V] target probabilities (after temperature/top-k/top-p, exactly as the
    non-speculative sampler would use them); draft [k]; q [k, V] draft probabilities, or None for a
    deterministic draft (one-hot). -> emitted tokens (1..k+1), distributed exactly as sampling from p."""
    k = len(draft)
    assert p.dim() == 2 and p.shape[0] >= k + 1, (p.shape, k)
    p = p.double()  # the residual subtracts nearly equal numbers
    for i, token in enumerate(draft):
        q_tok = 1.0 if q is None else float(q[i, token])
        p_tok = float(p[i, token])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if q_tok > 0 and u * q_tok < p_tok:  # u < p/q without dividing by a tiny q
            continue
        residual = p[i].clone()
        if q is None:
            residual[token] = 0.0
        else:
            residual = (residual - q[i].double()).clamp_min_(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q: the rejection had probability 0; fall back to p itself
            residual, total = p[i], float(p[i].sum())
        emitted = int(torch.multinomial((residual / total).float(), 1, generator=generator))
        return list(draft[:i]) + [emitted]
    bonus = int(torch.multinomial(p[k].float() / float(p[k].sum()), 1, generator=generator))
    return list(draft) + [bonus]

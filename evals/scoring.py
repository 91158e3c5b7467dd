"""Log-likelihood of continuations given a context, batched as prefix trees through the model's paged path.

A group is one context with K continuations (the choices of a multiple-choice row). It runs as one sequence: the
context once, then each continuation's tokens as a branch that sees the context and itself (positions restart at
the context's end), so the context is computed once per group instead of once per choice. Groups of similar length
share a batch [B, L]; only the positions that predict continuation tokens go through the LM head.
The numbers equal scoring every (context, continuation) as its own sequence, as lm-eval's HF backend does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's causal encoding: trailing spaces of the context move to the continuation; the pair is encoded whole
    and split at the length of the context's own encoding. tokenizer.encode's default special tokens, as HFLM."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx):]


class TreeAttention:
    """AttentionBackend over a padded batch [B, L] flattened to T = B*L tokens, with an explicit mask [B, L, L]."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask[:, None]  # [B, 1, L, L] bool, True = may attend
        self.B, self.L = mask.shape[0], mask.shape[1]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [T, Hq, D], k/v [T, Hkv, D] -> [B, H, L, D]
        B, L = self.B, self.L
        qb, kb, vb = (t.view(B, L, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=self.mask, enable_gqa=kb.shape[1] != qb.shape[1])
        return out.transpose(1, 2).reshape(q.shape)


@dataclass
class _Tree:
    ids: list[int]  # context then each branch's inputs (continuation[:-1])
    positions: list[int]
    branch_of: list[int]  # -1 for context tokens, k for branch k
    targets: list[tuple[list[int], list[int]]]  # per continuation: (row indices predicting it, its tokens)


def _build_tree(ctx: list[int], conts: Sequence[list[int]], max_len: int) -> _Tree:
    longest = max(len(c) for c in conts)
    if longest == 0 or longest > max_len:
        raise QuantkitError(f"a continuation of {longest} tokens cannot be scored (model context {max_len})")
    ctx = ctx[-(max_len - longest + 1):]  # left-truncate like lm-eval: context + continuation[:-1] fits
    m = len(ctx)
    ids, positions, branch_of, targets = list(ctx), list(range(m)), [-1] * m, []
    for k, cont in enumerate(conts):
        start = len(ids)
        ids += cont[:-1]
        positions += range(m, m + len(cont) - 1)
        branch_of += [k] * (len(cont) - 1)
        targets.append(([m - 1] + list(range(start, start + len(cont) - 1)), list(cont)))
    return _Tree(ids, positions, branch_of, targets)


def _tree_mask(tree: _Tree, L: int) -> torch.Tensor:
    """[L, L] bool: context causal; a branch token sees the context and the earlier tokens of its own branch."""
    n = len(tree.ids)
    branch = torch.tensor(tree.branch_of)
    idx = torch.arange(n)
    causal = idx[:, None] >= idx[None, :]
    same_or_ctx = (branch[None, :] == -1) | (branch[:, None] == branch[None, :])
    mask = torch.eye(L, dtype=torch.bool)  # padding attends to itself only (no empty softmax rows)
    mask[:n, :n] = causal & same_or_ctx
    return mask


@torch.inference_mode()
def score_groups(
    model,
    groups: Sequence[tuple[list[int], Sequence[list[int]]]],
    max_batch_tokens: int = 4096,
    advance: Optional[Callable[[int], None]] = None,
) -> list[list[tuple[float, bool]]]:
    """groups: (context ids, [continuation ids, ...]) -> per group, per continuation (sum log p, greedy-exact).

    The context must be non-empty (lm-eval puts its prefix token there for an empty context).
    """
    max_len = model.config.max_position_embeddings
    trees = [_build_tree(ctx, conts, max_len) for ctx, conts in groups]
    order = sorted(range(len(trees)), key=lambda i: -len(trees[i].ids))
    results: list[Optional[list[tuple[float, bool]]]] = [None] * len(trees)
    device = next(model.parameters()).device
    start = 0
    while start < len(order):
        L = len(trees[order[start]].ids)  # longest first: the batch is padded to its first tree
        B = max(1, min(len(order) - start, max_batch_tokens // max(L, 1)))
        batch = [trees[i] for i in order[start : start + B]]
        ids = torch.zeros(B, L, dtype=torch.int64)
        pos = torch.zeros(B, L, dtype=torch.int64)
        mask = torch.zeros(B, L, L, dtype=torch.bool) if any(len(t.targets) > 1 for t in batch) else None
        gather, target_tokens = [], []
        for b, t in enumerate(batch):
            ids[b, : len(t.ids)] = torch.tensor(t.ids)
            pos[b, : len(t.ids)] = torch.tensor(t.positions)
            if mask is not None:
                mask[b] = _tree_mask(t, L)
            for rows, toks in t.targets:
                gather += [b * L + r for r in rows]
                target_tokens += toks
        if mask is None:  # plain sequences: the dense causal path, no [L, L] mask
            hidden = model.hidden(ids.to(device)).reshape(B * L, -1)
        else:
            hidden = model.hidden(ids.view(-1).to(device), pos.view(-1).to(device), TreeAttention(mask.to(device)))
        token_logp, greedy = _target_logp(model, hidden, torch.tensor(gather, device=device),
                                          torch.tensor(target_tokens, device=device))
        offset = 0
        for i, t in zip(order[start : start + B], batch):
            out = []
            for _, toks in t.targets:
                n = len(toks)
                out.append((float(token_logp[offset : offset + n].sum()), bool(greedy[offset : offset + n].all())))
                offset += n
            results[i] = out
        if advance is not None:
            advance(len(batch))
        start += B
    return results


def _target_logp(model, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, chunk: int = 1024):
    """hidden [T, H]; rows, targets [S] -> log p(target) float64 [S] and argmax == target bool [S], through the LM
    head `chunk` rows at a time (the [S, V] log-softmax of a long window would not fit)."""
    logps, greedy = [], []
    for c in range(0, rows.shape[0], chunk):
        logp = torch.log_softmax(model.logits(hidden[rows[c : c + chunk]]), dim=-1)  # [chunk, V]
        tgt = targets[c : c + chunk]
        logps.append(logp.gather(1, tgt[:, None])[:, 0].double().cpu())
        greedy.append((logp.argmax(-1) == tgt).cpu())
    return torch.cat(logps), torch.cat(greedy)

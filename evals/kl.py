"""Baseline vs candidate on the same tokens: NLL of each, KL(P_base || P_cand) of the next-token distributions and
top-1 agreement. Each batch runs through both models once; the baseline's logits serve its NLL and the KL."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch


@dataclass
class TokenComparison:
    """Per unit (a window or a row) sums over its scored tokens; `kl_tokens` holds every scored token's KL."""

    base_nll: np.ndarray  # float64 [U]
    cand_nll: np.ndarray  # float64 [U]
    count: np.ndarray  # float64 [U] scored tokens
    kl: np.ndarray  # float64 [U]
    agree: np.ndarray  # float64 [U] tokens whose argmax matches
    kl_tokens: np.ndarray  # float64 [sum(count)]

    @property
    def kl_p99(self) -> float:
        return float(np.percentile(self.kl_tokens, 99)) if self.kl_tokens.size else 0.0


def kl_from_logp(lb: torch.Tensor, lc: torch.Tensor) -> torch.Tensor:
    """log-probs [..., V] of base and candidate -> KL(P_base || P_cand) [...] in nats (rounding below 0 clamped)."""
    return (lb.exp() * (lb - lc)).sum(-1).clamp_min(0.0)


@torch.inference_mode()
def compare(
    base,
    cand,
    units: Sequence[tuple[list[int], list[bool]]],
    max_batch_tokens: int = 2048,
    advance: Optional[Callable[[int], None]] = None,
) -> TokenComparison:
    """units: (token ids, scored) with scored[t] = token t is predicted from tokens < t (scored[0] is False).

    Units of similar length share a right-padded batch (causal attention: padding after real tokens is inert).
    """
    n = len(units)
    out = {k: np.zeros(n) for k in ("base_nll", "cand_nll", "count", "kl", "agree")}
    kl_tokens = [None] * n
    device = next(base.parameters()).device
    order = sorted(range(n), key=lambda i: -len(units[i][0]))
    start = 0
    while start < n:
        L = len(units[order[start]][0])
        idx = order[start : start + max(1, max_batch_tokens // max(L, 1))]
        ids = torch.zeros(len(idx), L, dtype=torch.int64)
        scored = torch.zeros(len(idx), L, dtype=torch.bool)
        for b, i in enumerate(idx):
            toks, mask = units[i]
            ids[b, : len(toks)] = torch.tensor(toks)
            scored[b, : len(toks)] = torch.tensor(mask)
        ids = ids.to(device)
        target = ids[:, 1:]
        sel = scored[:, 1:].to(device)  # [B, L-1]: prediction at position t scores token t+1
        lb = torch.log_softmax(base(ids)[:, :-1], dim=-1)  # [B, L-1, V]
        lc = torch.log_softmax(cand(ids)[:, :-1], dim=-1)
        base_nll = -lb.gather(-1, target[..., None])[..., 0]
        cand_nll = -lc.gather(-1, target[..., None])[..., 0]
        kl = kl_from_logp(lb, lc)
        agree = (lb.argmax(-1) == lc.argmax(-1)).float()
        for b, i in enumerate(idx):
            m = sel[b]
            out["base_nll"][i] = base_nll[b][m].double().sum()
            out["cand_nll"][i] = cand_nll[b][m].double().sum()
            out["count"][i] = m.sum()
            out["kl"][i] = kl[b][m].double().sum()
            out["agree"][i] = agree[b][m].sum()
            kl_tokens[i] = kl[b][m].double().cpu().numpy()
        if advance is not None:
            advance(len(idx))
        start += len(idx)
    return TokenComparison(**out, kl_tokens=np.concatenate(kl_tokens) if n else np.zeros(0))

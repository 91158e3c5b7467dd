"""Token perplexity, FORMATS.md protocol: join with "\\n\\n", tokenize once (no BOS), non-overlapping windows of L
tokens, mean NLL over every predicted token (L-1 per window), exp. The window length and count go with the number."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from quantkit.errors import QuantkitError


@dataclass
class PerplexityResult:
    ppl: float
    seq_len: int
    windows: int
    window_nll: torch.Tensor  # float64 [W]: mean NLL of each window's L-1 predictions (bootstrap units)


def text_windows(tokenizer, text: str, seq_len: int, max_windows: Optional[int] = None) -> torch.Tensor:
    """int64 [W, L]: the text tokenized once without special tokens, cut into non-overlapping windows (tail dropped)."""
    ids = _leading_tokens(tokenizer, text, None if max_windows is None else max_windows * seq_len)
    count = len(ids) // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    if count == 0:
        raise QuantkitError(f"the text has {len(ids)} tokens: fewer than one window of {seq_len} (lower --seq-len)")
    return torch.tensor(ids[: count * seq_len], dtype=torch.int64).view(count, seq_len)


def _leading_tokens(tokenizer, text: str, need: Optional[int], margin: int = 64) -> list[int]:
    """The first `need` tokens of the whole text's tokenization (all when need is None), tokenizing only a prefix cut
    at a newline: tokens far from the cut do not depend on it, so `margin` spare tokens make the result exact."""
    chars = 8 * need if need is not None else len(text)
    while True:
        cut = text.find("\n", chars)
        if need is None or cut < 0:
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = tokenizer(text[:cut], add_special_tokens=False)["input_ids"]
        if len(ids) >= need + margin:
            return ids[:need]
        chars *= 2


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits [B, L, V], ids [B, L] -> NLL [B, L-1] of token t+1 given tokens <= t (float32)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -logp.gather(-1, ids[:, 1:, None])[..., 0]


@torch.inference_mode()
def perplexity(model, windows: torch.Tensor, batch_size: int = 4,
               advance: Optional[Callable[[int], None]] = None) -> PerplexityResult:
    """One model's perplexity over windows [W, L], each window evaluated independently."""
    device = next(model.parameters()).device
    nll = []
    for i in range(0, windows.shape[0], batch_size):
        ids = windows[i : i + batch_size].to(device)
        nll.append(token_nll(model(ids), ids).double().mean(dim=1).cpu())
        if advance is not None:
            advance(ids.shape[0])
    window_nll = torch.cat(nll)
    return PerplexityResult(float(torch.exp(window_nll.mean())), windows.shape[1], windows.shape[0], window_nll)

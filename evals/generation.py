"""Greedy generation for prompt + answer rows: exact match (the output's first line equals the answer, both stripped)
and contains (the stripped answer appears in the output). Batched decoding through the model's paged path with a
dense per-batch KV cache (the AttentionBackend below)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from quantkit.data import Row


class DenseKVCache:
    """AttentionBackend for a batch of B sequences writing `Lnew` tokens each at positions `pos` [B, Lnew].

    cache k/v per layer: [B, Hkv, S_max, D]; token i of sequence b attends to slots j <= pos[b, i].
    """

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype, device):
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.pos = None  # [B, Lnew] int64, set before each forward

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, Lnew = self.pos.shape
        qb = q.view(B, Lnew, q.shape[1], q.shape[2]).transpose(1, 2)  # [B, Hq, Lnew, D]
        slot = self.pos[:, None, :, None].expand(B, k.shape[1], Lnew, k.shape[2])
        self.k[layer_idx].scatter_(2, slot, k.view(B, Lnew, k.shape[1], k.shape[2]).transpose(1, 2))
        self.v[layer_idx].scatter_(2, slot, v.view(B, Lnew, v.shape[1], v.shape[2]).transpose(1, 2))
        keys = torch.arange(self.k[layer_idx].shape[2], device=q.device)
        mask = keys[None, None, None, :] <= self.pos[:, None, :, None]  # [B, 1, Lnew, S_max]
        out = F.scaled_dot_product_attention(qb, self.k[layer_idx], self.v[layer_idx], attn_mask=mask,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2).reshape(q.shape)


@torch.inference_mode()
def greedy_generate(
    model,
    tokenizer,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    stop: Sequence[str] = (),
    batch_size: int = 8,
    advance: Optional[Callable[[int], None]] = None,
) -> list[str]:
    """Greedy continuation text of each prompt, ended by EOS, max_new_tokens or the first stop string (removed)."""
    cfg = model.config
    device = next(model.parameters()).device
    dtype = model.model.embed_tokens.weight.dtype
    eos = tokenizer.eos_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    texts: list[Optional[str]] = [None] * len(prompts)
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        lens = torch.tensor([len(prompts[i]) for i in idx])
        B, Lp = len(idx), int(lens.max())
        cache = DenseKVCache(cfg.num_hidden_layers, B, Lp + max_new_tokens, cfg.num_key_value_heads, cfg.head_dim,
                             dtype, device)
        ids = torch.zeros(B, Lp, dtype=torch.int64)
        for b, i in enumerate(idx):
            ids[b, : lens[b]] = torch.tensor(prompts[i])
        cache.pos = torch.arange(Lp).expand(B, Lp).contiguous().to(device)
        hidden = model.hidden(ids.view(-1).to(device), cache.pos.reshape(-1), cache).view(B, Lp, -1)
        last = hidden[torch.arange(B), (lens - 1).to(device)]  # [B, H] at each prompt's last token
        out = [[] for _ in range(B)]
        done = [False] * B
        pos = lens.clone().to(device)
        for _ in range(max_new_tokens):
            nxt = model.logits(last).argmax(-1)  # [B]
            for b in range(B):
                if not done[b]:
                    out[b].append(int(nxt[b]))
                    done[b] = int(nxt[b]) == eos or _hits_stop(tokenizer, out[b], stop)
            if all(done):
                break
            cache.pos = pos[:, None]
            last = model.hidden(nxt.to(device), pos, cache)  # [B, H]
            pos = pos + 1
        for b, i in enumerate(idx):
            texts[i] = _cut(tokenizer.decode(out[b], skip_special_tokens=True), stop)
        if advance is not None:
            advance(B)
    return texts


def _hits_stop(tokenizer, generated: list[int], stop: Sequence[str]) -> bool:
    return bool(stop) and any(s in tokenizer.decode(generated[-16:]) for s in stop)


def _cut(text: str, stop: Sequence[str]) -> str:
    for s in stop:
        if s in text:
            text = text[: text.index(s)]
    return text


@dataclass
class GenerationScores:
    outputs: list[str]
    exact_match: np.ndarray  # float64 [R] 0/1
    contains: np.ndarray  # float64 [R] 0/1


def answer_prompts(rows: Sequence[Row], tokenizer) -> list[list[int]]:
    return [tokenizer.encode(r.prompt) for r in rows]


def score_generation(model, tokenizer, rows: Sequence[Row], prompts: Sequence[list[int]], max_new_tokens: int = 32,
                     advance: Optional[Callable[[int], None]] = None) -> GenerationScores:
    outputs = greedy_generate(model, tokenizer, prompts, max_new_tokens, advance=advance)
    exact = np.array([float(_first_line(o) == r.answer.strip()) for o, r in zip(outputs, rows)])
    contains = np.array([float(r.answer.strip() in o) for o, r in zip(outputs, rows)])
    return GenerationScores(outputs, exact, contains)


def _first_line(text: str) -> str:
    stripped = text.strip()
    return stripped.splitlines()[0].strip() if stripped else ""

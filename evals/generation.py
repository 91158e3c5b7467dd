"""Greedy generation for prompt + answer rows through the serving engine (quantkit.LLM: the served numbers).
exact_match: the output's first line equals the answer (both stripped); contains: the stripped answer appears in it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from quantkit.data import Row

ENGINE_SEQS = 16  # sequences the KV pool holds at the longest length


def greedy_generate(loaded, prompts: Sequence[list[int]], max_new_tokens: int, stop: Sequence[str] = (),
                    advance: Optional[Callable[[int], None]] = None) -> list[str]:
    """Greedy continuation text of each prompt (token ids), ended by EOS, max_new_tokens or a stop string."""
    from quantkit import LLM, SamplingParams

    if not prompts:
        return []
    cfg = loaded.model.config
    max_len = min(cfg.max_position_embeddings, max(len(p) for p in prompts) + max_new_tokens)
    dtype_bytes = loaded.model.model.embed_tokens.weight.element_size()
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes  # K and V
    llm = LLM(loaded, max_model_len=max_len, kv_cache_memory=per_token * max_len * ENGINE_SEQS,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop=list(stop))
    texts = []
    for s in range(0, len(prompts), ENGINE_SEQS):
        chunk = [list(p) for p in prompts[s : s + ENGINE_SEQS]]
        texts += [out.outputs[0].text for out in llm.generate(chunk, params)]
        if advance is not None:
            advance(len(chunk))
    return texts


@dataclass
class GenerationScores:
    outputs: list[str]
    exact_match: np.ndarray  # float64 [R] 0/1
    contains: np.ndarray  # float64 [R] 0/1


def answer_prompts(rows: Sequence[Row], tokenizer) -> list[list[int]]:
    return [tokenizer.encode(r.prompt) for r in rows]


def generation_metrics(rows: Sequence[Row], outputs: Sequence[str]) -> GenerationScores:
    exact = np.array([float(first_line(o) == r.answer.strip()) for o, r in zip(outputs, rows)])
    contains = np.array([float(r.answer.strip() in o) for o, r in zip(outputs, rows)])
    return GenerationScores(list(outputs), exact, contains)


def score_generation(loaded, rows: Sequence[Row], prompts: Sequence[list[int]], max_new_tokens: int = 32,
                     advance: Optional[Callable[[int], None]] = None) -> GenerationScores:
    return generation_metrics(rows, greedy_generate(loaded, prompts, max_new_tokens, advance=advance))


def first_line(text: str) -> str:
    stripped = text.strip()
    return stripped.splitlines()[0].strip() if stripped else ""

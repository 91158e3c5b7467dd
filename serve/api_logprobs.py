"""Engine logprobs ({token_id: logprob} per position) -> the two OpenAI wire shapes.

Completions (legacy, what lm-eval's local-completions parses): {tokens, token_logprobs, top_logprobs, text_offset};
an echoed prompt's first token has no context, so its logprob and top_logprobs are null.
Chat: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
JSON has no -inf: logprobs are clamped at -9999.0 as vLLM does.
"""

from __future__ import annotations

from functools import lru_cache

from quantkit.serve.protocol import ChatLogProbs, ChatTokenLogprob, CompletionLogProbs, TopLogprob

MIN_LOGPROB = -9999.0


def _clamp(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


class TokenTexts:
    """Each token id's own text (`decode([id])`, cached) and its label in logprobs: the text, or "token_id:{id}"
    with `as_ids` (vLLM's return_tokens_as_token_ids)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self.decoded = lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))
        self.label = (lambda token_id: f"token_id:{token_id}") if as_ids else self.decoded

    def completion_logprobs(self, token_ids: list[int], steps: list[dict[int, float] | None], top_k: int,
                            text_offset: int) -> tuple[CompletionLogProbs, int]:
        """Legacy logprobs for `token_ids` (steps[i] holds token i's entry; None = no context), offsets counted
        from `text_offset` (the text already sent before the first of these tokens); also the offset after them."""
        out = CompletionLogProbs()
        for token_id, step in zip(token_ids, steps):
            out.tokens.append(self.label(token_id))
            out.text_offset.append(text_offset)
            text_offset += len(self.decoded(token_id))
            if step is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_clamp(step[token_id]))
            out.top_logprobs.append(self._top_dict(step, token_id, top_k))
        return out, text_offset

    def _top_dict(self, step: dict[int, float], chosen: int, top_k: int) -> dict[str, float]:
        """The top_k entries plus the chosen token, keyed by label (two ids with one text keep the higher)."""
        ranked = sorted(step.items(), key=lambda kv: kv[1], reverse=True)
        top: dict[str, float] = {}
        for token_id, logprob in ranked[:top_k] + [(chosen, step[chosen])]:
            top.setdefault(self.label(token_id), _clamp(logprob))
        return top

    def chat_logprobs(self, token_ids: list[int], steps: list[dict[int, float]], top_k: int) -> ChatLogProbs:
        content = []
        for token_id, step in zip(token_ids, steps):
            ranked = sorted(step.items(), key=lambda kv: kv[1], reverse=True)[:top_k]
            content.append(ChatTokenLogprob(
                **self._entry(token_id, step[token_id]),
                top_logprobs=[TopLogprob(**self._entry(t, lp)) for t, lp in ranked],
            ))
        return ChatLogProbs(content=content)

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.label(token_id), "logprob": _clamp(logprob),
                "bytes": list(self.decoded(token_id).encode("utf-8"))}

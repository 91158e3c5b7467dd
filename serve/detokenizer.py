"""Incremental detokenization and stop strings: text grows token by token, never shows a partial character or
anything a stop string could still claim.
"""

from __future__ import annotations

PREFIX_CONTEXT = 5  # prompt tokens decoded with the first output tokens (leading-space rules of some tokenizers)


class IncrementalDetokenizer:
    """Decodes the output one step at a time (vLLM's windowed rule).

    new text = decode(ids[prefix:]) minus decode(ids[prefix:read]), emitted only when it does not end in an
    incomplete UTF-8 character; then prefix, read = read, len(ids).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-PREFIX_CONTEXT:])
        self.prefix = 0  # ids[prefix:read] were already emitted (context for the next decode)
        self.read = len(self.ids)

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        head = decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip)
        full = decode(self.ids[self.prefix :], skip_special_tokens=self.skip)
        if full.endswith("\ufffd") or len(full) < len(head):
            return ""
        # only ids[prefix:] is ever decoded again: keep the window short
        self.ids = self.ids[self.read :]
        self.prefix, self.read = 0, len(self.ids)
        return full[len(head) :]


    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes to U+FFFD, as decode() does)."""
        decode = self.tokenizer.decode
        head = decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip)
        full = decode(self.ids[self.prefix :], skip_special_tokens=self.skip)
        self.ids = self.ids[len(self.ids) :]
        self.prefix = self.read = 0
        return full[len(head) :]


def find_stop(text: str, new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends within the last new_chars characters: (its start, it), or None."""
    best = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of some stop string (not to be shown yet)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest

"""Per-request sampling parameters (the fields and defaults of vLLM's SamplingParams).

`validate()` raises ValueError with one clear line that starts with the field's name; validate_request
(validation.py) calls it as part of the one check of a request, and the HTTP API turns it into a 400 BadRequestError.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quantkit.serve.structured import GuidedDecoding

MAX_LOGPROBS = 20  # top logprobs per token the engine will return (OpenAI's limit for chat top_logprobs)
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # vLLM's: a signed 64-bit integer (torch.Generator takes it)
# Stop conditions are checked on every token of every sequence: a request may bring at most MAX_STOP stop strings
# (OpenAI allows 4) of at most MAX_STOP_CHARS characters each, and at most MAX_STOP stop token ids.
MAX_STOP = 32
MAX_STOP_CHARS = 256
FLOAT32_MAX = 3.4028234663852886e38  # the sampler computes in float32: a larger number would be inf there (and NaN)


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    n: completions per prompt (forked sequences sharing the prompt's KV blocks).
    temperature: 0 = greedy.  top_p in (0, 1].  top_k <= 0 = off.  min_p in [0, 1].
    seed: per-request generator seed (reproducible across batches); None = the engine's generator.
    stop / stop_token_ids: end the completion; a stop string is cut from the text (never streamed).
    max_tokens: None = up to max_model_len.  min_tokens: EOS and stop_token_ids are masked before this many.
    logprobs: top logprobs per generated token (0 = only the chosen token's); None = none.
    prompt_logprobs: the same for every prompt token (echo); None = none.
    guided: structured output (structured.py): a grammar the output must follow; None = unconstrained.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    guided: GuidedDecoding | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> "SamplingParams":
        """Raise ValueError naming the field when a value is out of range; return self."""
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        _check_number("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k)
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
                raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] (a signed 64-bit integer), "
                                 f"got {self.seed}.")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty.")
        if len(self.stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop must hold at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters, got "
                             f"{len(self.stop)}, the longest of {max(map(len, self.stop))}.")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}.")
        if len(self.stop_token_ids) > MAX_STOP:
            raise ValueError(f"stop_token_ids must hold at most {MAX_STOP} ids, got {len(self.stop_token_ids)}.")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _check_int(name, value)
            if not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}.")
        if not isinstance(self.ignore_eos, bool) or not isinstance(self.skip_special_tokens, bool):
            raise ValueError("ignore_eos and skip_special_tokens must be booleans.")
        if self.guided is not None:
            self.guided.validate()
        return self


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}.")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}.")
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"{name} must be at most {FLOAT32_MAX:.6g} in magnitude, got {value!r}.")

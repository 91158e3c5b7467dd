"""What the engine hands back each step, shaped like vLLM's RequestOutput.

Text and token_ids are cumulative (each step's output replaces the previous one). A stop string never appears in
`text`, not even while streaming: text that could be the start of a stop string is held back until it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass
class CompletionOutput:
    """One of the request's n completions.

    logprobs: one dict per generated token, {token_id: logprob} holding the chosen token plus the top-k
    (k = SamplingParams.logprobs), from the model's log_softmax before penalties/temperature; None when not asked.
    stop_reason: the stop string or stop token id that ended it; None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request's life; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after a step.

    prompt_logprobs: one entry per prompt token (None for the first, which has no context), each {token_id:
    logprob} with the actual prompt token plus the top-k (k = SamplingParams.prompt_logprobs); None when not asked.
    finished: every completion is finished (or the request was aborted).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

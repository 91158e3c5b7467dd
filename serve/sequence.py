"""Requests and their sequences: token ids, how many have KV in the cache, the block table, output state.

A Request holds n Sequences (one per completion). Only the first exists until its prompt is computed; at the
first sample it forks n-1 children that share the prompt's KV blocks.
Invariant: seq.token_ids = prompt + generated; KV for token_ids[:num_computed_tokens] is in the blocks of
seq.block_table (slot of token t = block_table[t // block_size] * block_size + t % block_size), except for entries
released behind a sliding window (block_manager.FREED), which no query reads any more.
"""

from __future__ import annotations

import enum
import itertools
import time

from quantkit.serve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from quantkit.serve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED)


_seq_ids = itertools.count()


class Sequence:
    """One completion: what the scheduler, block manager and runner see."""

    def __init__(self, request: "Request", index: int, token_ids: list[int]):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # prefix-cache key of each full block of token_ids, filled lazily
        self.num_cached_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        self.num_released_blocks = 0  # leading entries of block_table released behind a sliding window (FREED)
        # speculative decoding (serve/speculative.py)
        self.spec_token_ids: list[int] = []  # draft tokens to verify in this step, after token_ids
        self.spec_probs = None  # float32 [k, V]: the draft model's distribution per draft (None: deterministic)
        self.draft_computed = 0  # tokens whose KV the draft model holds (same block table, its own pool)
        self.spec_drafted = 0  # draft tokens proposed for this sequence so far
        self.spec_accepted = 0  # of which accepted
        self.spec_off = False  # switched off for this sequence: acceptance was poor
        self.status = SequenceStatus.WAITING
        self.num_preemptions = 0
        # output state (text is the detokenized output, already cut at a stop string when finished)
        self.text = ""
        self.held_back = 0  # trailing chars of text that may start a stop string (not shown yet)
        self.detok = None  # IncrementalDetokenizer, set by the engine
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] | None = [] if request.params.logprobs is not None else None
        self.stop_reason: str | int | None = None
        self.generator = request.generators[index] if request.generators else None
        self.matcher = None  # structured.GuidedState: the output follows a grammar (set by the engine)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def reset_for_recompute(self) -> None:
        """Preempted: its blocks were freed; the whole token list is prefilled again later."""
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0
        self.num_released_blocks = 0
        self.spec_token_ids = []
        self.spec_probs = None
        self.draft_computed = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def completion(self) -> CompletionOutput:
        finished = self.is_finished
        shown = self.text if finished or not self.held_back else self.text[: len(self.text) - self.held_back]
        reason = self.status.value if self.status in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH) else None
        return CompletionOutput(
            index=self.index,
            text=shown,
            token_ids=self.output_token_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=reason,
            stop_reason=self.stop_reason,
        )


class Request:
    """A client request: one prompt, n completions, one set of sampling parameters."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        max_tokens: int,
        arrival_time: float | None = None,
    ):
        import torch

        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # effective: params.max_tokens capped by max_model_len - prompt length
        self.metrics = RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time)
        # one generator per completion: completion i uses seed + i (reproducible whatever the batch)
        self.generators = None
        if params.seed is not None:
            self.generators = [torch.Generator().manual_seed(params.seed + i) for i in range(params.n)]
        self.prompt_logprobs: list[dict[int, float] | None] | None = [None] if params.prompt_logprobs is not None else None
        self.seqs: list[Sequence] = [Sequence(self, 0, list(prompt_token_ids))]
        self.forked = params.n == 1

    @property
    def is_finished(self) -> bool:
        return self.forked and all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        completions = [s.completion() for s in self.seqs]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            outputs=completions,
            finished=self.is_finished,
            metrics=self.metrics,
        )

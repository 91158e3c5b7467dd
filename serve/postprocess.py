"""After the forward: the step's tokens join their sequences, and whatever finished leaves the engine now.

    apply(batch, logits, sampled, now):
      scheduled tokens are computed      seq.num_computed_tokens += num_new_tokens
      prompt-logprob rows                -> request.prompt_logprobs (echo)
      sample rows                        -> one token a sequence; a request's first sample forks it into n
      draft-verifying rows               -> the accepted drafts + one token; rejected drafts' KV is given up
      every token                        -> the grammar's matcher (structured output) advances with it;
                                            logprobs, metrics, EOS / stop ids / stop strings / grammar end /
                                            length, text
      a finished sequence                -> out of the scheduler, its blocks back in the pool in this step
      a finished request                 -> out of `requests`, its finish reasons counted

A stop token's text is never shown; a stop string is cut from the text, and text that may still grow into one
is held back from the output (seq.held_back).
"""

from __future__ import annotations

import torch

from quantkit.serve.detokenizer import IncrementalDetokenizer, find_stop, held_back
from quantkit.serve.engine_stats import EngineStats
from quantkit.serve.model_runner import StepBatch
from quantkit.serve.sampler import SamplerOutput, logprob_dicts
from quantkit.serve.scheduler import Scheduler
from quantkit.serve.sequence import Request, Sequence, SequenceStatus
from quantkit.serve.speculative import Speculator


class Postprocessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int, scheduler: Scheduler,
                 speculator: Speculator | None, requests: dict[str, Request], stats: EngineStats):
        """requests: the engine's unfinished requests by id (finished ones are removed here)."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.speculator = speculator
        self.requests = requests
        self.stats = stats

    def apply(self, batch: StepBatch, logits: torch.Tensor, sampled: SamplerOutput, now: float) -> list[Request]:
        """logits [R, V]: every row of the step; sampled: the sample rows' tokens. The requests this step touched,
        in the order of their rows (each once)."""
        for s in batch.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        self._prompt_logprobs(batch, logits)
        touched = self._append_samples(batch, sampled, now)
        for seq, row in batch.spec_rows:
            self._append_verified(seq, logits[row : row + len(seq.spec_token_ids) + 1], now, touched)
        return list(touched.values())

    def _prompt_logprobs(self, batch: StepBatch, logits: torch.Tensor) -> None:
        for pr in batch.prompt_rows:
            request = pr.seq.request
            rows = torch.log_softmax(logits[pr.row : pr.row + pr.count], dim=-1)
            targets = torch.tensor(request.prompt_token_ids[pr.first_token : pr.first_token + pr.count],
                                   device=rows.device)
            k = request.params.prompt_logprobs
            request.prompt_logprobs.extend(logprob_dicts(rows, targets, [k] * pr.count))

    def _append_samples(self, batch: StepBatch, sampled: SamplerOutput, now: float) -> dict[str, Request]:
        """Sample row i belongs to batch.sample_seqs[i]; a forking parent has n rows, one for it and each child."""
        touched: dict[str, Request] = {}
        seqs, i = batch.sample_seqs, 0
        while i < len(seqs):
            seq = seqs[i]
            request = seq.request
            family = [seq]
            if not request.forked:
                family += self._fork(seq, request.params.n)
                request.forked = True
            for seq_i in family:
                self._append_token(seq_i, sampled.tokens[i], sampled.logprobs[i], sampled.chosen_logprobs[i], now)
                i += 1
            touched[request.request_id] = request
            if request.is_finished:
                self._finish_request(request, now)
        return touched

    def _append_verified(self, seq: Sequence, logits: torch.Tensor, now: float, touched: dict[str, Request]) -> None:
        """Speculation: logits [d + 1, V] verify seq's d drafts; the emitted tokens are appended until one stops
        the sequence, and the KV of rejected drafts is given up (num_computed_tokens moves back)."""
        num_drafts = len(seq.spec_token_ids)
        emitted = self.speculator.verify(seq, logits)
        seq.num_computed_tokens -= num_drafts - (len(emitted) - 1)
        k = seq.request.params.logprobs
        dicts = [None] * len(emitted)
        if k is not None:
            rows = torch.log_softmax(logits[: len(emitted)], dim=-1)
            dicts = logprob_dicts(rows, torch.tensor(emitted, device=rows.device), [k] * len(emitted))
        for token, entry in zip(emitted, dicts):
            self._append_token(seq, token, entry, entry[token] if entry is not None else None, now)
            if seq.is_finished:
                break
        request = seq.request
        touched[request.request_id] = request
        if request.is_finished:
            self._finish_request(request, now)

    def _fork(self, parent: Sequence, n: int) -> list[Sequence]:
        """n - 1 children sharing the parent's computed prompt blocks (or recomputing it when the pool is full)."""
        request = parent.request
        children = []
        for index in range(1, n):
            child = Sequence(request, index, list(parent.token_ids))
            child.matcher = parent.matcher.fork() if parent.matcher is not None else None
            self.scheduler.add_forked(parent, child)
            request.seqs.append(child)
            children.append(child)
        return children

    def _append_token(self, seq: Sequence, token: int, logprobs: dict | None, chosen: float | None,
                      now: float) -> None:
        request, params = seq.request, seq.request.params
        seq.token_ids.append(token)
        grammar_done = seq.matcher is not None and seq.matcher.advance(token)
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += chosen
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self.stats.prompt_tokens += len(request.prompt_token_ids)
        metrics.last_token_time = now
        self.stats.generation_tokens += 1
        status = None
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            status = SequenceStatus.FINISHED_STOPPED
        elif may_stop and token in params.stop_token_ids:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        else:  # a stop token's text is never shown
            if seq.detok is None:
                seq.detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
            new_text = seq.detok.add([token])
            seq.text += new_text
            if params.stop and may_stop and new_text:
                hit = find_stop(seq.text, len(new_text), params.stop)
                if hit is not None:
                    seq.text = seq.text[: hit[0]]
                    status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, hit[1]
        if status is None and grammar_done:
            status = SequenceStatus.FINISHED_STOPPED
        if status is None and (seq.num_output_tokens >= request.max_tokens or seq.num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is None:
            seq.held_back = held_back(seq.text, params.stop) if params.stop else 0
            return
        if seq.stop_reason is None or isinstance(seq.stop_reason, int):  # not cut at a stop string
            seq.text += seq.detok.flush() if seq.detok is not None else ""
        seq.held_back = 0
        self.scheduler.remove(seq)
        seq.status = status

    def _finish_request(self, request: Request, now: float) -> None:
        request.metrics.finished_time = now
        self.requests.pop(request.request_id, None)
        for seq in request.seqs:
            self.stats.request_success[seq.status.value] += 1

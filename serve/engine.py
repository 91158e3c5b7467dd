"""The serving loop. step(): schedule -> run the model once -> sample -> append, detokenize, stop -> outputs.

    sched = scheduler.schedule()              # token budget: running decodes first, then waiting prefill chunks
    batch = runner.prepare(sched)             # flat input ids, positions, paged-attention metadata
    logits = runner.execute(batch)            # one forward over every scheduled token; logits only where needed
    tokens = sampler(logits, ...)             # penalties, greedy / top-k / top-p / min-p, per-request seeds
    outputs = self._append(...)               # forks for n > 1, text, stop strings, finished -> blocks freed now

A request is a Request with n Sequences; blocks of finished or aborted sequences return to the pool in the same
step. Everything here runs on one thread (AsyncLLMEngine drives it from a background thread).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

import torch

from quantkit.serve.block_manager import BlockManager
from quantkit.serve.capacity import kv_bytes_per_token
from quantkit.serve.config import EngineConfig
from quantkit.serve.detokenizer import IncrementalDetokenizer, find_stop, held_back
from quantkit.serve.model_runner import ModelRunner, StepBatch
from quantkit.serve.outputs import RequestOutput
from quantkit.serve.sampler import Sampler, SamplerOutput, logprob_dicts
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.scheduler import Scheduler
from quantkit.serve.sequence import Request, Sequence, SequenceStatus
from quantkit.serve.speculative import build_speculator, spec_stats

log = logging.getLogger("quantkit.serve")

KV_SAMPLE_EVERY = 4  # steps between samples of the KV slot utilisation


def context_length_message(max_model_len: int, max_tokens: int, num_prompt: int) -> str:
    """vLLM's too-long error, byte for byte (clients parse it)."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested {max_tokens} "
        f"output tokens and your prompt contains at least {num_prompt} input tokens, for a total of at least "
        f"{max_tokens + num_prompt} tokens. Please reduce the length of the input prompt or the number of "
        f"requested output tokens."
    )


def check_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> int:
    """ValueError for bad parameters or a prompt that does not fit; returns the effective max_tokens."""
    params.validate()
    if not prompt_token_ids:
        raise ValueError("the prompt is empty: give at least one token")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is out of range for a vocabulary of {vocab_size}")
    num_prompt, max_tokens = len(prompt_token_ids), params.max_tokens
    if max_tokens is None:
        if num_prompt >= max_model_len:
            raise ValueError(context_length_message(max_model_len, 1, num_prompt))
        return max_model_len - num_prompt
    if num_prompt + max_tokens > max_model_len:
        raise ValueError(context_length_message(max_model_len, max_tokens, num_prompt))
    return max_tokens


class LLMEngine:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None, eos_token_ids: list[int] | None = None,
                 draft_model=None):
        """draft_model: the proposer model when config.speculative_method is "draft" (same vocabulary)."""
        self.cfg = config or EngineConfig()
        self.loaded = None  # the quantkit Loaded this engine serves, when built by llm.build_engine
        self.model = model
        self.tokenizer = tokenizer
        param = next(model.parameters())
        self.device, self.dtype = str(param.device), param.dtype
        self.max_model_len = self.cfg.max_model_len or model.config.max_position_embeddings
        self.vocab_size = model.config.vocab_size
        if eos_token_ids is None:
            eos_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.eos_token_ids = set(eos_token_ids)
        draft_kv = 0
        if self.cfg.speculative_method == "draft":
            if draft_model is None or draft_model.config.vocab_size != self.vocab_size:
                raise ValueError("speculative_method 'draft' needs a draft model with the target's vocabulary "
                                 f"({self.vocab_size} tokens)")
            draft_kv = kv_bytes_per_token(draft_model.config, torch.empty((), dtype=self.dtype).element_size())
        self.runner = ModelRunner(model, self.cfg, self.device, self.dtype, self.max_model_len,
                                  shared_kv_bytes_per_token=draft_kv)
        self.block_manager = BlockManager(self.runner.num_blocks, self.cfg.block_size, self.cfg.enable_prefix_caching)
        self.speculator = build_speculator(self.cfg, self.runner, self.block_manager, self.max_model_len, draft_model)
        self.scheduler = Scheduler(self.block_manager, self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs)
        self.sampler = Sampler(self.eos_token_ids, self.cfg.seed)
        self.requests: dict[str, Request] = {}
        # counters (cumulative) and the KV-slot utilisation samples
        self.num_steps = 0
        self.prompt_tokens = 0  # prompt tokens of requests that produced a first token
        self.generation_tokens = 0
        self.computed_tokens = 0  # tokens run through the model (prefill chunks, recompute, decodes)
        self.request_success: Counter[str] = Counter()
        self.kv_slot_samples: deque[float] = deque(maxlen=1024)  # the most recent samples
        self.kv_slot_total = [0.0, 0, 1.0]  # sum, count, min over every sample of the engine's life
        self._last_log = (time.time(), 0, 0)

    # ---- requests
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """ValueError for bad parameters or a prompt that does not fit; returns the effective max_tokens."""
        return check_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    prompt: str | None = None, arrival_time: float | None = None) -> None:
        """Queue a request. ValueError for bad parameters, an id in use, or a prompt that does not fit."""
        params = params or SamplingParams()
        ids = list(prompt_token_ids)
        max_tokens = self.check_request(ids, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, ids, params, prompt, max_tokens, arrival_time)
        self.requests[request_id] = request
        self.scheduler.add(request.seqs[0])

    def abort_request(self, request_id: str) -> bool:
        """Drop a request now (its blocks are free on return). False when it is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.status = SequenceStatus.FINISHED_ABORTED
        request.metrics.finished_time = time.time()
        self.request_success["abort"] += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the loop
    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        batch = self.runner.prepare(sched)
        logits = self.runner.execute(batch, sched.blocks_to_copy)
        for s in batch.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        self.computed_tokens += sched.num_batched_tokens
        self._prompt_logprobs(batch, logits)
        sampled = self.sampler(logits[batch.sample_row0 : batch.spec_row0], batch.sample_seqs,
                               batch.sample_generators)
        now = time.time()
        touched = self._append_samples(batch, sampled, now)
        for seq, row in batch.spec_rows:
            self._append_verified(seq, logits[row : row + len(seq.spec_token_ids) + 1], now, touched)
        self.num_steps += 1
        if self.num_steps % KV_SAMPLE_EVERY == 0 and self.scheduler.running:
            sample = self.kv_slot_utilization()
            self.kv_slot_samples.append(sample)
            total = self.kv_slot_total
            total[0], total[1], total[2] = total[0] + sample, total[1] + 1, min(total[2], sample)
        self._maybe_log()
        return [r.output() for r in touched.values()]

    def _prompt_logprobs(self, batch: StepBatch, logits: torch.Tensor) -> None:
        for pr in batch.prompt_rows:
            request = pr.seq.request
            rows = torch.log_softmax(logits[pr.row : pr.row + pr.count], dim=-1)
            targets = torch.tensor(request.prompt_token_ids[pr.first_token : pr.first_token + pr.count],
                                   device=rows.device)
            k = request.params.prompt_logprobs
            request.prompt_logprobs.extend(logprob_dicts(rows, targets, [k] * pr.count))

    def _append_samples(self, batch: StepBatch, sampled: SamplerOutput, now: float) -> dict[str, Request]:
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
            if self.block_manager.fork(parent, child):
                self.scheduler.add_running(child)
            else:
                self.scheduler.waiting.appendleft(child)
            request.seqs.append(child)
            children.append(child)
        return children

    def _append_token(self, seq: Sequence, token: int, logprobs: dict | None, chosen: float | None,
                      now: float) -> None:
        request, params = seq.request, seq.request.params
        seq.token_ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += chosen
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self.prompt_tokens += len(request.prompt_token_ids)
        metrics.last_token_time = now
        self.generation_tokens += 1
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
            self.request_success[seq.status.value] += 1

    # ---- state
    def kv_slot_utilization(self) -> float:
        """Fraction of slots in allocated blocks that hold a real token's KV (shared blocks counted once)."""
        bs = self.cfg.block_size
        full: set[int] = set()
        partial = 0
        for seq in self.scheduler.running:
            n_full, rest = divmod(seq.num_computed_tokens, bs)
            full.update(seq.block_table[:n_full])
            partial += rest
        used = self.block_manager.num_used_blocks
        return (len(full) * bs + partial) / (used * bs) if used else 1.0

    def stats(self) -> dict:
        """A snapshot of gauges and cumulative counters (metric names of SERVING.md, without the prefix)."""
        running = {s.request.request_id for s in self.scheduler.running}
        waiting = {s.request.request_id for s in self.scheduler.waiting} - running
        bm = self.block_manager
        slot_sum, slot_count, slot_min = self.kv_slot_total
        return {
            "num_requests_running": len(running),
            "num_requests_waiting": len(waiting),
            "kv_cache_usage_perc": bm.usage,
            "kv_capacity_tokens": self.runner.capacity_tokens,
            "kv_num_blocks": bm.num_blocks,
            "kv_used_blocks": bm.num_used_blocks,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "computed_tokens": self.computed_tokens,
            "num_steps": self.num_steps,
            "request_success": dict(self.request_success),
            "kv_slot_utilization_mean": slot_sum / slot_count if slot_count else None,
            "kv_slot_utilization_min": slot_min if slot_count else None,
            "kv_slot_utilization_samples": slot_count,
            **spec_stats(self.speculator),
        }

    def _maybe_log(self) -> None:
        now = time.time()
        last_time, last_gen, last_computed = self._last_log
        if now - last_time < self.cfg.log_stats_interval:
            return
        s = self.stats()
        span = now - last_time
        hit_rate = s["prefix_cache_hits"] / s["prefix_cache_queries"] if s["prefix_cache_queries"] else 0.0
        drafted = s["spec_decode_num_draft_tokens"]
        spec = f", draft acceptance {100 * s['spec_decode_num_accepted_tokens'] / drafted:.1f}%" if drafted else ""
        log.info(
            "engine: %.1f gen tok/s, %.1f computed tok/s, running %d, waiting %d, KV usage %.1f%%, "
            "prefix hit rate %.1f%%, preemptions %d%s",
            (self.generation_tokens - last_gen) / span, (self.computed_tokens - last_computed) / span,
            s["num_requests_running"], s["num_requests_waiting"], 100 * s["kv_cache_usage_perc"], 100 * hit_rate,
            s["num_preemptions"], spec,
        )
        self._last_log = (now, self.generation_tokens, self.computed_tokens)

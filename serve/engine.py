"""The serving loop. step(): schedule -> run the model once -> sample -> postprocess -> outputs.

    sched = scheduler.schedule()              # token budget: running decodes first, then waiting prefill chunks
    batch = runner.prepare(sched)             # flat input ids, positions, paged-attention metadata
    logits = runner.execute(batch)            # one forward over every scheduled token; logits only where needed
    sampled = sampler(logits, ...)            # penalties, greedy / top-k / top-p / min-p, per-request seeds
    touched = postprocessor.apply(...)        # forks for n > 1, text, stop strings, finished -> blocks freed now

A request is a Request with n Sequences; blocks of finished or aborted sequences return to the pool in the same
step. A request with structured output (params.guided) gets its grammar's matcher at add_request (structured.py):
the sampler masks its rows, the postprocessor advances the matcher. Requests arrive validated (validation.py: the
entry points check them, the engine trusts them). Everything here runs on one thread (AsyncLLMEngine drives it
from a background thread).

The drivers call guarded_step(): a step that raises (a request some bound missed, a kernel error) fails the requests
it was running, logs one traceback, and the engine goes on with the others; MAX_FAILED_STEPS failures in a row
mean the engine itself is broken, and the error is raised (the engine stops; the server exits). A FatalStepError
(a tensor-parallel rank died: serve/tp_group.py) is raised at once: no later step can succeed.
Embeddings (add_embedding, pooling.py) wait in their own queue; guarded_step runs one bounded prefill-only forward
of them before each generation step, and delivers their EmbeddingOutputs with the step's outputs.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from quantkit.serve.block_manager import BlockManager
from quantkit.serve.capacity import kv_bytes_per_token
from quantkit.serve.config import EngineConfig
from quantkit.serve.engine_stats import EngineStats
from quantkit.serve.model_runner import FatalStepError, ModelRunner
from quantkit.serve.outputs import RequestOutput
from quantkit.serve.pooling import EmbeddingJob, EmbeddingOutput, Pooler
from quantkit.serve.postprocess import Postprocessor
from quantkit.serve.sampler import Sampler
from quantkit.serve.scheduler import Scheduler
from quantkit.serve.sequence import Request, SequenceStatus
from quantkit.serve.speculative import build_speculator
from quantkit.serve.structured import StructuredOutputs
from quantkit.serve.validation import ValidRequest

log = logging.getLogger("quantkit.serve")

MAX_FAILED_STEPS = 5


class LLMEngine:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None, eos_token_ids: list[int] | None = None,
                 draft_model=None, tensor_parallel=None):
        """draft_model: the proposer model when config.speculative_method is "draft" (same vocabulary);
        tensor_parallel: this process's rank-0 TensorParallel (serve/tp_group.py) when `model` is its shard."""
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
        if tensor_parallel is None:
            self.runner = ModelRunner(model, self.cfg, self.device, self.dtype, self.max_model_len,
                                      shared_kv_bytes_per_token=draft_kv)
        else:
            from quantkit.serve.tp_runner import TPModelRunner

            self.runner = TPModelRunner(model, self.cfg, self.device, self.dtype, self.max_model_len, tensor_parallel)
        self.tensor_parallel = tensor_parallel
        self.block_manager = BlockManager(self.runner.num_blocks, self.cfg.block_size, self.cfg.enable_prefix_caching,
                                          self.runner.kv_window if draft_model is None else None)  # a draft reads all
        self.speculator = build_speculator(self.cfg, self.runner, self.block_manager, self.max_model_len, draft_model)
        self.scheduler = Scheduler(self.block_manager, self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs)
        self.sampler = Sampler(self.eos_token_ids, self.cfg.seed)
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, self.eos_token_ids)  # grammars, on demand
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self.counters = EngineStats(self.scheduler, self.block_manager, self.speculator, self.runner.capacity_tokens,
                                    self.cfg.log_stats_interval)
        self.postprocessor = Postprocessor(self.tokenizer, self.eos_token_ids, self.max_model_len, self.scheduler,
                                           self.speculator, self.requests, self.counters)
        self.failed_steps = 0  # in a row
        pooled = model if tensor_parallel is None else self.runner.pooling_model  # /v1/embeddings
        self.pooler = Pooler(pooled, self.cfg.pooling, self.cfg.max_num_batched_tokens, self.runner.threads)

    # ---- requests
    def add_request(self, request_id: str, request: ValidRequest, prompt: str | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request checked by validate_request. ValueError when the id is in use by an unfinished one."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        queued = Request(request_id, request.prompt_token_ids, request.params, prompt, request.max_tokens,
                         arrival_time)
        if request.params.guided is not None:  # structured output: its grammar starts compiling now
            queued.seqs[0].matcher = self.structured.start(request.params.guided)
        self.requests[request_id] = queued
        self.scheduler.add(queued.seqs[0])

    def add_embedding(self, request_id: str, job: EmbeddingJob) -> None:
        """Queue one input to embed (its ids checked by validate_embedding_input). ValueError when the id is in use."""
        if request_id in self.requests or request_id in self.pooler:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.pooler.add(request_id, job)

    def abort_request(self, request_id: str) -> bool:
        """Drop a request now (its blocks are free on return). False when it is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return self.pooler.abort(request_id)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.status = SequenceStatus.FINISHED_ABORTED
        request.metrics.finished_time = time.time()
        self.counters.request_success["abort"] += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self.pooler.pending

    # ---- the loop
    def step(self) -> list[RequestOutput]:
        """One forward over the scheduled tokens; the outputs of the requests it advanced (finished ones freed)."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        batch = self.runner.prepare(sched)
        logits = self.runner.execute(batch, sched.blocks_to_copy)
        sampled = self.sampler(logits[batch.sample_row0 : batch.spec_row0], batch.sample_seqs, batch.sample_generators)
        touched = self.postprocessor.apply(batch, logits, sampled, time.time())
        self.counters.record_step(sched.num_batched_tokens)
        self.counters.maybe_log()
        return [request.output() for request in touched]

    def guarded_step(self) -> tuple[list[RequestOutput | EmbeddingOutput], dict[str, str]]:
        """The next embeddings (Pooler.run), then step(); when the step raises, (the embeddings only, {failed request
        id: error}) for the requests it was running (or, running none, the one it was scheduling: the head of the
        queue). Their state may be half updated, so they are aborted, and the prefix cache is forgotten (blocks
        cached for the step may never have had their KV written). The other waiting requests stay queued. Raises
        after MAX_FAILED_STEPS failures in a row."""
        embedded, failed_embeddings = self.pooler.run()
        try:
            outputs = self.step()
        except Exception as e:
            self.failed_steps += 1
            if self.failed_steps >= MAX_FAILED_STEPS or isinstance(e, FatalStepError):
                raise
            seqs = self.scheduler.running or list(itertools.islice(self.scheduler.waiting, 1))
            failed = list(dict.fromkeys(seq.request.request_id for seq in seqs))
            log.exception("engine step failed: failing the %d requests it ran (%s) and going on", len(failed),
                          ", ".join(failed))
            for request_id in failed:
                self.abort_request(request_id)
            self.block_manager.reset_prefix_cache()
            return embedded, {**failed_embeddings, **dict.fromkeys(failed, f"{type(e).__name__}: {e}")}
        self.failed_steps = 0
        return embedded + outputs, failed_embeddings

    # ---- state
    def stats(self) -> dict:
        """A snapshot of gauges and cumulative counters (metric names of SERVING.md, without the prefix)."""
        return self.counters.snapshot()

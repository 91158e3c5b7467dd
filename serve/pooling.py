"""Embeddings in the engine: the pooled final-normed hidden state of whole inputs, between generation steps.

An EmbeddingJob is one input whose token ids validation.validate_embedding_input has checked. The engine's Pooler
queues them (FCFS) and LLMEngine.guarded_step runs `Pooler.run` once per engine iteration, before the generation
step: one dense, prefill-only forward (`model.hidden`, attention over the input itself, no KV cache: the pool and
the block tables are never touched) over the head of the queue, as many inputs as fit in max_num_batched_tokens
padded tokens (B x the longest), at least one (an input is at most max_model_len tokens). A queue of embeddings so
delays each generation step by at most one such forward.
Pooling (vLLM's pooling types, `--pooling`): last = the last token's state (vLLM's default for a *ForCausalLM
served as an embedding model), mean = the average over the input's tokens, cls = the first token's. The vector is
L2-normalised unless the request says not to (vLLM's embed pooler normalises by default).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger("quantkit.serve")

PAD_ID = 0  # right padding of a dense batch: causal attention never lets a real token see it


@dataclass(frozen=True)
class EmbeddingJob:
    token_ids: list[int]  # validated: 1 .. max_model_len ids in the vocabulary
    normalize: bool = True


@dataclass
class EmbeddingOutput:
    """The pooled vector of one job; delivered like a request's final RequestOutput (request_id, finished)."""

    request_id: str
    embedding: np.ndarray  # float32 [hidden_size] (numpy: pickled plainly to the server, never as shared memory)
    num_prompt_tokens: int
    finished: bool = True


def pool(hidden: torch.Tensor, lengths: torch.Tensor, method: str) -> torch.Tensor:
    """hidden [B, L, H] of right-padded inputs of lengths [B] (int64, >= 1) -> float32 [B, H]."""
    hidden = hidden.float()
    if method == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    if method == "cls":
        return hidden[:, 0]
    real = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]  # [B, L]
    return (hidden * real[..., None]).sum(dim=1) / lengths[:, None]


class Pooler:
    def __init__(self, model, method: str, max_batched_tokens: int, threads=None):
        """method: last | mean | cls (EngineConfig.pooling); max_batched_tokens: padded tokens of one forward;
        threads: the runner's cpu_threads.ThreadGovernor (or None), consulted before each forward as before a step."""
        self.model = model
        self.method = method
        self.max_batched_tokens = max_batched_tokens
        self.threads = threads
        self.device = next(model.parameters()).device
        self.queue: OrderedDict[str, EmbeddingJob] = OrderedDict()  # by request id, oldest first

    @property
    def pending(self) -> bool:
        return bool(self.queue)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.queue

    def add(self, request_id: str, job: EmbeddingJob) -> None:
        self.queue[request_id] = job

    def abort(self, request_id: str) -> bool:
        return self.queue.pop(request_id, None) is not None

    def take(self) -> list[tuple[str, EmbeddingJob]]:
        """The head of the queue that fits one forward: B x longest <= max_batched_tokens, at least one job."""
        batch, longest = [], 0
        for request_id, job in self.queue.items():
            longest_then = max(longest, len(job.token_ids))
            if batch and (len(batch) + 1) * longest_then > self.max_batched_tokens:
                break
            batch.append((request_id, job))
            longest = longest_then
        for request_id, _ in batch:
            del self.queue[request_id]
        return batch

    def run(self) -> tuple[list[EmbeddingOutput], dict[str, str]]:
        """Embed the next batch: (outputs, {request id: error} when its forward raised: those jobs are dropped, the
        queue goes on)."""
        batch = self.take()
        if not batch:
            return [], {}
        try:
            vectors = self.embed([job for _, job in batch])
        except Exception as e:
            log.exception("embedding forward failed: failing its %d requests", len(batch))
            return [], {request_id: f"{type(e).__name__}: {e}" for request_id, _ in batch}
        return [EmbeddingOutput(request_id, vector, len(job.token_ids))
                for (request_id, job), vector in zip(batch, vectors.numpy())], {}

    @torch.inference_mode()
    def embed(self, jobs: list[EmbeddingJob]) -> torch.Tensor:
        """-> float32 [len(jobs), H] on the CPU: one dense forward over the right-padded inputs."""
        if self.threads is not None:
            self.threads.update()
        lengths = torch.tensor([len(job.token_ids) for job in jobs], dtype=torch.int64)
        ids = torch.full((len(jobs), int(lengths.max())), PAD_ID, dtype=torch.int64)
        for i, job in enumerate(jobs):
            ids[i, : len(job.token_ids)] = torch.tensor(job.token_ids, dtype=torch.int64)
        hidden = self.model.hidden(ids.to(self.device))  # [B, L, H], final-normed
        vectors = pool(hidden, lengths.to(self.device), self.method)
        normalize = torch.tensor([job.normalize for job in jobs], device=self.device)
        vectors = torch.where(normalize[:, None], F.normalize(vectors, p=2, dim=-1), vectors)
        return vectors.cpu()

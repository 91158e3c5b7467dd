"""/v1/embeddings: inputs -> one engine embedding job each (pooling.py) -> {"object": "list", "data": [...]}.

input: a string, a list of strings, a list of token ids or a list of lists of token ids (OpenAI's forms), at most
MAX_INPUTS inputs and MAX_TOTAL_TOKENS tokens in all (OpenAI's limits per request), each 1 .. max_model_len tokens
(validation.validate_embedding_input); a 400 naming the field otherwise. Text is tokenized with special tokens
unless add_special_tokens is false; truncate_prompt_tokens k (vLLM's; -1 = max_model_len) keeps the last k tokens
of each input. encoding_format "float" (a JSON list) or "base64" (the little-endian float32 bytes: what the openai
client asks for when the caller does not say). dimensions must be the model's hidden size when given (its vectors
are not matryoshka embeddings: vLLM's 400 otherwise). normalize (vLLM's): false returns the pooled vector as is.
The jobs run in the engine's Pooler (LLMEngine.guarded_step), so embeddings never stall generation for more than
one bounded forward per step; parsing and tokenizing run in Serving's pool, as for the generation routes.
"""

from __future__ import annotations

import asyncio
import base64
import uuid

import numpy as np

from quantkit.serve.api_generate import Serving, aborted_by_shutdown, check_model, engine_errors, tokenize_text
from quantkit.serve.pooling import EmbeddingJob, EmbeddingOutput
from quantkit.serve.protocol import APIError, EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from quantkit.serve.validation import validate_embedding_input

MAX_INPUTS = 2048
MAX_TOTAL_TOKENS = 300_000


def input_token_ids(serving: Serving, request: EmbeddingRequest) -> list[list[int]]:
    """The token ids of every input, truncated as asked, each validated."""
    raw = request.input
    if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
        raw = [raw]
    if not raw:
        raise APIError(400, "input: must not be empty", "input")
    if len(raw) > MAX_INPUTS:
        raise APIError(400, f"input: at most {MAX_INPUTS} inputs per request, got {len(raw)}", "input")
    keep = request.truncate_prompt_tokens
    if keep == -1:
        keep = serving.max_model_len
    if keep is not None and not 1 <= keep <= serving.max_model_len:
        raise APIError(400, f"truncate_prompt_tokens value ({keep}) must be -1 or between 1 and max_model_len "
                            f"({serving.max_model_len}).", "truncate_prompt_tokens")
    inputs = []
    for item in raw:
        ids = tokenize_text(serving, item, "input", request.add_special_tokens) if isinstance(item, str) else item
        ids = ids[-keep:] if keep is not None else ids
        inputs.append(validate_embedding_input(ids, serving.prompt_vocab_size, serving.max_model_len, "input"))
    total = sum(len(ids) for ids in inputs)
    if total > MAX_TOTAL_TOKENS:
        raise APIError(400, f"input: {total} tokens in all, over the limit of {MAX_TOTAL_TOKENS} per request: send "
                            "fewer or shorter inputs", "input")
    return inputs


def prepare_embeddings(serving: Serving, request: EmbeddingRequest) -> tuple[str, list[EmbeddingJob]]:
    check_model(serving, request.model)
    hidden_size = serving.engine.hidden_size
    if request.dimensions is not None and request.dimensions != hidden_size:
        raise APIError(400, f'Model "{serving.model_name}" does not support matryoshka representation, changing '
                            f"output dimensions will lead to poor results (its embeddings have {hidden_size}).",
                       "dimensions")
    jobs = [EmbeddingJob(ids, request.normalize) for ids in input_token_ids(serving, request)]
    return f"embd-{uuid.uuid4().hex}", jobs


async def run_jobs(serving: Serving, request_id: str, jobs: list[EmbeddingJob]) -> list[EmbeddingOutput]:
    """Every job's output, in order; any failure (or cancellation) drops the jobs not done from the engine."""
    tasks = [asyncio.ensure_future(serving.engine.embed(f"{request_id}-{i}", job)) for i, job in enumerate(jobs)]
    try:
        with engine_errors("embedding the input"):
            outputs = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # no-op for the finished ones; the others leave the engine's queue
            task.cancel()
    if any(out is None for out in outputs):
        raise aborted_by_shutdown()
    return outputs


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """vector: float32 [H] -> a JSON list of floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector.tolist()


async def embeddings_response(serving: Serving, request: EmbeddingRequest, request_id: str,
                              jobs: list[EmbeddingJob]) -> EmbeddingResponse:
    outputs = await run_jobs(serving, request_id, jobs)
    data = [EmbeddingData(index=i, embedding=encoded(out.embedding, request.encoding_format))
            for i, out in enumerate(outputs)]
    tokens = sum(len(job.token_ids) for job in jobs)
    return EmbeddingResponse(id=request_id, model=serving.model_name, data=data,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

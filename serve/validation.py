"""The one check of a request, made once where it enters; the engine trusts the ValidRequest it is handed.

Entry points: the HTTP API (api_generate.py), `quantkit.LLM` (llm.py) and the front ends' `generate`
(AsyncLLMEngine, EngineProcess) call validate_request; LLMEngine.add_request takes its ValidRequest as is.
validate_request checks, in this order: the prompt holds a token, every id is in the vocabulary, the sampling
parameters (SamplingParams.validate), what the engine can run (top_k at most the vocabulary, n at most the
sequences it runs at once: a larger n could never be scheduled and would hold up the queue behind it), and
prompt + max_tokens fits max_model_len (vLLM's message, byte for byte: clients parse it). A refusal is an
InvalidRequest naming the request field at fault (the HTTP error's `param`). An input of /v1/embeddings is checked
by validate_embedding_input (a token at least, ids in the vocabulary, at most max_model_len tokens: nothing is
generated after it).
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.serve.sampling_params import SamplingParams


class InvalidRequest(ValueError):
    """A refused request: str(e) is the message for the client, `param` the request field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed validate_request (made only there)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # effective: params.max_tokens, or all that fits after the prompt when that is None


def context_length_message(max_model_len: int, max_tokens: int, num_prompt: int) -> str:
    """vLLM's too-long error, byte for byte (clients parse it)."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested {max_tokens} "
        f"output tokens and your prompt contains at least {num_prompt} input tokens, for a total of at least "
        f"{max_tokens + num_prompt} tokens. Please reduce the length of the input prompt or the number of "
        f"requested output tokens."
    )


def check_token_ids(token_ids: list[int], vocab_size: int, field: str) -> None:
    """InvalidRequest naming `field` when an id is outside [0, vocab_size)."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{field}: token id {bad} is out of vocabulary (size {vocab_size})", field)


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                     max_num_seqs: int) -> ValidRequest:
    """The request as the engine may run it, or InvalidRequest (the first problem found). max_num_seqs: the
    engine's (a request's n sequences must fit in one batch, or it could never be scheduled)."""
    ids = list(prompt_token_ids)
    if not ids:
        raise InvalidRequest("prompt: must contain at least one token", "prompt")
    check_token_ids(ids, vocab_size, "prompt")
    try:
        params.validate()
    except ValueError as e:  # the message starts with the field's name
        raise InvalidRequest(str(e), str(e).split(" ", 1)[0]) from None
    if params.top_k > vocab_size:
        raise InvalidRequest(f"top_k must be at most the vocabulary size {vocab_size} (-1 or 0: no top-k), "
                             f"got {params.top_k}.", "top_k")
    if params.n > max_num_seqs:
        raise InvalidRequest(f"n must be at most {max_num_seqs}, the sequences the engine runs at once "
                             f"(--max-num-seqs), got {params.n}.", "n")
    requested = 1 if params.max_tokens is None else params.max_tokens  # None: at least one output token
    if len(ids) + requested > max_model_len:
        raise InvalidRequest(context_length_message(max_model_len, requested, len(ids)), "max_tokens")
    max_tokens = max_model_len - len(ids) if params.max_tokens is None else params.max_tokens
    return ValidRequest(ids, params, max_tokens)


def fitting_max_tokens(num_prompt: int, max_model_len: int) -> int:
    """All the output that fits after a prompt (the chat default); InvalidRequest, in vLLM's words, when none does."""
    if num_prompt >= max_model_len:
        raise InvalidRequest(f"This model's maximum context length is {max_model_len} tokens. However, your request "
                             f"has {num_prompt} input tokens. Please reduce the length of the input messages.",
                             "messages")
    return max_model_len - num_prompt


def validate_embedding_input(token_ids: list[int], vocab_size: int, max_model_len: int, field: str) -> list[int]:
    """The ids of one /v1/embeddings input as the engine may pool them, or InvalidRequest naming `field` (vLLM's
    message for an input over max_model_len, byte for byte)."""
    ids = list(token_ids)
    if not ids:
        raise InvalidRequest(f"{field}: each input must contain at least one token", field)
    check_token_ids(ids, vocab_size, field)
    if len(ids) > max_model_len:
        raise InvalidRequest(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                             f"{len(ids)} tokens in the input for embedding generation. Please reduce the length of "
                             f"the input.", field)
    return ids

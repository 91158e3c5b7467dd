"""/v1/completions and /v1/chat/completions: request -> engine requests -> JSON response or SSE stream.

One API request becomes one engine request per prompt (n completions each; choice index = prompt_index * n +
completion index). The engine yields cumulative RequestOutputs whose text already has stop strings removed and
held back, so a stream sends `text[len(sent):]` each step and a stop string never leaks across chunks. Leaving
early (client disconnect, error, cancellation) aborts every unfinished engine request so its KV blocks are freed.
Parsing, tokenizing and chat templates run in Serving's thread pool (`offload`), never on the event loop: the Rust
tokenizer releases the GIL, so a prompt of megabytes stalls no other client.
Structured output (response_format, guided_*, structured_outputs) becomes SamplingParams.guided, checked with the
rest of the request (structured.py); chat `tools` / `tool_choice` are rendered and parsed by tools.py (a required
or named tool_choice is a grammar too), and a choice that called tools finishes with "tool_calls".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import AsyncIterator, Iterator

from quantkit.serve.api_logprobs import TokenTexts
from quantkit.serve.async_engine import EngineDeadError, RequestFailedError
from quantkit.serve.metrics import RequestTracker, ServerMetrics
from quantkit.serve.outputs import RequestOutput
from quantkit.serve.protocol import (
    APIError, AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatStreamChoice, CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse, DeltaMessage,
    SamplingFields, UsageInfo,
)
from quantkit.serve import tools as tool_calls
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.structured import GuidedDecoding
from quantkit.serve.tool_parsers import ToolParser
from quantkit.serve.validation import ValidRequest, fitting_max_tokens, validate_request

logger = logging.getLogger("quantkit.serve.api")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
PREPARE_THREADS = 4  # requests parsed, tokenized and templated at once; more wait their turn


@dataclass
class Serving:
    """What the handlers share: the engine, the tokenizer and the server's settings."""

    engine: object
    tokenizer: object
    model_name: str
    max_model_len: int
    chat_template: str | None
    metrics: ServerMetrics
    tool_parser: ToolParser  # the chat template family's (tool_parsers.choose)

    def __post_init__(self):
        self.token_texts = TokenTexts(self.tokenizer)
        self.token_ids_as_texts = TokenTexts(self.tokenizer, as_ids=True)
        self.vocab_size = len(self.tokenizer)  # the ids the tokenizer decodes
        self.prompt_vocab_size = min(self.vocab_size, self.engine.vocab_size)  # ... that the model embeds too
        self.pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="quantkit-prepare")

    async def offload(self, fn):
        """fn() in the pool, awaited: CPU work on a request (parse, tokenize, template) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    def validated(self, token_ids: list[int], params: SamplingParams) -> ValidRequest:
        """The one check of an engine request (validation.py), against this server's limits. InvalidRequest becomes
        a 400 naming the field (api.py)."""
        return validate_request(token_ids, params, self.prompt_vocab_size, self.max_model_len,
                                self.engine.max_num_seqs)


@dataclass
class Prompt:
    request: ValidRequest
    text: str

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_token_ids


# ---- request -> prompts and sampling parameters --------------------------------------------------------------


def check_model(serving: Serving, name: str | None) -> None:
    if name is not None and name != serving.model_name:
        raise APIError(404, f"The model `{name}` does not exist.", "model")


# request field -> GuidedDecoding kind (structured.py)
GUIDED_FIELDS = {"response_format": "response_format", "guided_json": "json", "guided_regex": "regex",
                 "guided_choice": "choice", "guided_grammar": "grammar", "structured_outputs": "structured_outputs"}


def tokenize_text(serving: Serving, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
    """The token ids of `text`; what the tokenizer cannot take is a 400 naming the request field it came from."""
    try:
        return serving.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    except Exception as e:
        raise APIError(400, f"{field}: could not be tokenized: {e}", field) from None


def completion_prompts(serving: Serving, request: CompletionRequest, params: SamplingParams) -> list[Prompt]:
    """str | [str] | [int] | [[int]] -> one validated Prompt per prompt (text prompts tokenized with special
    tokens; token ids decoded once they are known to be in the vocabulary)."""
    raw = request.prompt
    if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
        raw = [raw]
    if not raw:
        raise APIError(400, "prompt: must not be empty", "prompt")
    prompts = []
    for item in raw:
        token_ids = tokenize_text(serving, item, "prompt") if isinstance(item, str) else item
        valid = serving.validated(token_ids, params)
        prompts.append(Prompt(valid, item if isinstance(item, str) else serving.tokenizer.decode(item)))
    return prompts


def chat_prompt(serving: Serving, request: ChatCompletionRequest,
                tools: list[dict] | None = None) -> tuple[list[int], str]:
    """Messages rendered with the chat template (the tokenizer's or --chat-template), with `tools` as tools.py
    renders them, then tokenized as is: (token ids, text)."""
    template = serving.chat_template or getattr(serving.tokenizer, "chat_template", None)
    if not template:
        raise APIError(400, "This model has no chat template: start the server with --chat-template FILE, "
                            "or use /v1/completions", "messages")
    messages = [m.for_template() for m in request.messages]
    messages, tool_kwargs = tool_calls.render_messages(messages, tools, template, serving.tool_parser)
    try:
        text = serving.tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, **tool_kwargs,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, **(request.chat_template_kwargs or {}),
        )
    except Exception as e:  # jinja2 TemplateError or ValueError from transformers: the request's fault
        raise APIError(400, f"messages: the chat template could not render them: {e}", "messages") from None
    token_ids = tokenize_text(serving, text, "messages", add_special_tokens=False)
    if not token_ids:
        raise APIError(400, "messages: render to an empty prompt", "messages")
    return token_ids, text


def guided_decoding(request: SamplingFields, tool: GuidedDecoding | None = None) -> GuidedDecoding | None:
    """The structured-output field the request set (or the tool call tool_choice requires), as sent: checked with
    the rest of the request (SamplingParams.validate), where a second one set too is refused."""
    asked = [tool] if tool is not None else []
    for field, kind in GUIDED_FIELDS.items():
        value = getattr(request, field)
        if value in (None, [], {}) or (field == "response_format" and value.get("type") == "text"):
            continue
        asked.append(GuidedDecoding(kind, value, field))
    if not asked:
        return None
    return asked[0] if len(asked) == 1 else replace(asked[0], conflict=asked[1].field)


def sampling_params(request: SamplingFields, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None, tool: GuidedDecoding | None = None) -> SamplingParams:
    """The request's sampling fields as SamplingParams (checked with the prompt by Serving.validated)."""
    return SamplingParams(
        n=request.n,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=-1 if request.top_k is None else request.top_k,
        min_p=0.0 if request.min_p is None else request.min_p,
        seed=request.seed,
        stop=request.stop or [],
        stop_token_ids=request.stop_token_ids or [],
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        guided=guided_decoding(request, tool),
    )


def _texts(serving: Serving, request: SamplingFields) -> TokenTexts:
    return serving.token_ids_as_texts if request.return_tokens_as_token_ids else serving.token_texts


# ---- running engine requests ---------------------------------------------------------------------------------


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams as their outputs arrive, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, end))
        except Exception as e:  # handed to the consumer, which re-raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


class Generation:
    """The engine requests of one API request; abandoning the iteration aborts the unfinished ones."""

    def __init__(self, serving: Serving, request_id: str, prompts: list[Prompt], tool_parser: ToolParser | None = None):
        self.serving = serving
        self.prompts = prompts
        self.tool_parser = tool_parser  # chat with tools: parses tool calls out of the output (tools.py)
        self.engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.trackers = [RequestTracker(serving.metrics) for _ in prompts]

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        engine = self.serving.engine
        streams = [engine.generate_validated(rid, p.request, prompt=p.text)
                   for rid, p in zip(self.engine_ids, self.prompts)]
        try:
            with engine_errors("running the request"):
                async for i, out in _merge(streams):
                    self.trackers[i].observe(out)
                    yield i, out
        finally:
            for rid, tracker in zip(self.engine_ids, self.trackers):
                if not tracker.done:
                    engine.abort(rid)
        if not all(tracker.done for tracker in self.trackers):  # streams ended unfinished: the engine aborted them
            raise aborted_by_shutdown()


@contextlib.contextmanager
def engine_errors(failed_while: str) -> Iterator[None]:
    """The engine's exceptions inside the block as API errors: 400 when it refuses a request (its id is in use),
    500 "The engine failed while {failed_while}: ..." when the step running it raised (the engine logged it and goes
    on), 503 when the engine is dead."""
    try:
        yield
    except ValueError as e:
        raise APIError(400, str(e)) from None
    except RequestFailedError as e:
        raise APIError(500, f"The engine failed while {failed_while}: {e}") from None
    except EngineDeadError as e:
        raise APIError(503, str(e)) from None


def aborted_by_shutdown() -> APIError:
    """A request whose engine work ended unfinished: the engine aborts everything when the server shuts down."""
    return APIError(503, "The request was aborted before it finished: the server is shutting down.")


async def unless_disconnected(raw_request, work):
    """Await `work` (a coroutine), cancelling it when the client goes away first (its requests get aborted)."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its cleanup aborts the engine requests
    if task.cancelled():
        raise APIError(499, "client disconnected")
    return task.result()


def sse(payload) -> str:
    body = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {body}\n\n"


async def stream_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The SSE body: the events, an error event if generation fails midway, then always `data: [DONE]`."""
    try:
        async for event in events:
            yield event
    except APIError as e:
        yield sse(json.dumps(e.body()))
    except Exception as e:  # the stream has started: the error can only travel as an event
        logger.exception("generation failed mid-stream")
        yield sse(json.dumps(APIError(500, f"generation failed: {e}").body()))
    yield "data: [DONE]\n\n"


# ---- /v1/completions -----------------------------------------------------------------------------------------


def prepare_completion(serving: Serving, request: CompletionRequest) -> tuple[str, Generation]:
    check_model(serving, request.model)
    if request.suffix is not None:
        raise APIError(400, "suffix: is not supported", "suffix")
    requested = request.requested_max_tokens()
    prompt_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
    params = sampling_params(request, COMPLETIONS_DEFAULT_MAX_TOKENS if requested is None else requested,
                             request.logprobs, prompt_logprobs)
    prompts = completion_prompts(serving, request, params)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    return request_id, Generation(serving, request_id, prompts)


class _CompletionChoiceState:
    """What one choice has sent so far (text characters, tokens, logprob text offset)."""

    def __init__(self):
        self.text_sent = 0
        self.tokens_sent = 0
        self.offset = 0
        self.started = False
        self.finished = False


def _completion_piece(serving: Serving, request: CompletionRequest, prompt: Prompt, out: RequestOutput, completion,
                      state: _CompletionChoiceState) -> tuple[str, object]:
    """The text and logprobs a choice has not sent yet (the echoed prompt first, once)."""
    text = completion.text[state.text_sent:]
    token_ids = completion.token_ids[state.tokens_sent:]
    steps = (completion.logprobs or [])[state.tokens_sent:] if request.logprobs is not None else []
    if not state.started and request.echo:
        text = prompt.text + text
        if request.logprobs is not None:
            token_ids = prompt.token_ids + token_ids
            steps = list(out.prompt_logprobs or [None] * len(prompt.token_ids)) + steps
    logprobs = None
    if request.logprobs is not None:
        logprobs, state.offset = _texts(serving, request).completion_logprobs(token_ids, steps, request.logprobs,
                                                                              state.offset)
    state.started = True
    state.text_sent = len(completion.text)
    state.tokens_sent = len(completion.token_ids)
    return text, logprobs


async def completion_response(serving: Serving, request: CompletionRequest, request_id: str,
                              generation: Generation) -> CompletionResponse:
    n = request.n
    states = [_CompletionChoiceState() for _ in range(len(generation.prompts) * n)]
    choices: dict[int, CompletionChoice] = {}
    final: dict[int, RequestOutput] = {}
    async for i, out in generation.outputs():
        final[i] = out
    for i, out in sorted(final.items()):
        for completion in out.outputs:
            index = i * n + completion.index
            text, logprobs = _completion_piece(serving, request, generation.prompts[i], out, completion,
                                               states[index])
            choices[index] = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                              finish_reason=completion.finish_reason,
                                              stop_reason=completion.stop_reason)
    return CompletionResponse(id=request_id, model=serving.model_name, choices=[choices[k] for k in sorted(choices)],
                              usage=_usage(generation, final.values()))


async def completion_stream(serving: Serving, request: CompletionRequest, request_id: str,
                            generation: Generation) -> AsyncIterator[str]:
    n = request.n
    created = int(time.time())
    states = [_CompletionChoiceState() for _ in range(len(generation.prompts) * n)]
    final: dict[int, RequestOutput] = {}
    usage_field = {"usage": None} if request.include_usage() else {}
    async for i, out in generation.outputs():
        final[i] = out
        for completion in out.outputs:
            index = i * n + completion.index
            state = states[index]
            if state.finished:
                continue
            has_new = completion.text[state.text_sent:] or len(completion.token_ids) > state.tokens_sent
            if not (has_new or completion.finished or (request.echo and not state.started)):
                continue
            text, logprobs = _completion_piece(serving, request, generation.prompts[i], out, completion, state)
            state.finished = completion.finished
            choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                      finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)
            yield sse(CompletionChunk(id=request_id, created=created, model=serving.model_name, choices=[choice],
                                      **usage_field))
    if request.include_usage():
        yield sse(CompletionChunk(id=request_id, created=created, model=serving.model_name, choices=[],
                                  usage=_usage(generation, final.values())))


def _usage(generation: Generation, outputs) -> UsageInfo:
    outputs = list(outputs)
    prompt_tokens = sum(len(p.token_ids) for p in generation.prompts)
    completion_tokens = sum(out.num_generated_tokens for out in outputs)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


# ---- /v1/chat/completions ------------------------------------------------------------------------------------


def prepare_chat(serving: Serving, request: ChatCompletionRequest) -> tuple[str, Generation]:
    check_model(serving, request.model)
    if request.top_logprobs and not request.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
    tools = tool_calls.plan(request, serving.tool_parser)
    token_ids, text = chat_prompt(serving, request, tools.tools)
    requested = request.requested_max_tokens()
    max_tokens = fitting_max_tokens(len(token_ids), serving.max_model_len) if requested is None else requested
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = sampling_params(request, max_tokens, logprobs, None, tools.guided)
    if tools.parser is not None:  # a family's call marker may be a special token (tools.py)
        params = replace(params, skip_special_tokens=False)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    return request_id, Generation(serving, request_id, [Prompt(serving.validated(token_ids, params), text)],
                                  tool_parser=tools.parser)


def _chat_logprobs(serving: Serving, request: ChatCompletionRequest, completion, start: int):
    if not request.logprobs:
        return None
    steps = (completion.logprobs or [])[start:]
    return _texts(serving, request).chat_logprobs(completion.token_ids[start:], steps, request.top_logprobs or 0)


async def chat_response(serving: Serving, request: ChatCompletionRequest, request_id: str,
                        generation: Generation) -> ChatCompletionResponse:
    final = None
    async for _, out in generation.outputs():
        final = out
    choices = []
    for c in sorted(final.outputs, key=lambda c: c.index):
        content, calls = generation.tool_parser.parse(c.text) if generation.tool_parser else (c.text, [])
        choices.append(ChatChoice(index=c.index, message=AssistantMessage(content=content, tool_calls=calls or None),
                                  logprobs=_chat_logprobs(serving, request, c, 0),
                                  finish_reason="tool_calls" if calls else c.finish_reason, stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=request_id, model=serving.model_name, choices=choices,
                                  usage=_usage(generation, [final]))


async def chat_stream(serving: Serving, request: ChatCompletionRequest, request_id: str,
                      generation: Generation) -> AsyncIterator[str]:
    created = int(time.time())
    usage_field = {"usage": None} if request.include_usage() else {}

    def chunk(choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=serving.model_name, choices=[choice],
                                       **usage_field))

    text_sent = [0] * request.n
    tokens_sent = [0] * request.n
    finished = [False] * request.n
    final = None
    async for _, out in generation.outputs():
        if final is None:
            for index in range(request.n):  # the role comes first, in a delta of its own
                yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
        final = out
        for c in out.outputs:
            if finished[c.index]:
                continue
            parser = generation.tool_parser
            shown = len(c.text) if c.finished or parser is None else parser.streamable(c.text)
            delta = c.text[text_sent[c.index]:shown]
            if not (delta or len(c.token_ids) > tokens_sent[c.index] or c.finished):
                continue
            logprobs = _chat_logprobs(serving, request, c, tokens_sent[c.index])
            message, finish_reason = DeltaMessage(content=delta), c.finish_reason
            if c.finished and parser is not None:
                message, finish_reason = _final_tool_delta(parser, c.text, text_sent[c.index], message,
                                                           finish_reason)
            text_sent[c.index], tokens_sent[c.index] = max(shown, text_sent[c.index]), len(c.token_ids)
            finished[c.index] = c.finished
            yield chunk(ChatStreamChoice(index=c.index, delta=message, logprobs=logprobs,
                                         finish_reason=finish_reason, stop_reason=c.stop_reason))
    if request.include_usage() and final is not None:
        yield sse(ChatCompletionChunk(id=request_id, created=created, model=serving.model_name, choices=[],
                                      usage=_usage(generation, [final])))


def _final_tool_delta(parser: ToolParser, text: str, sent: int, message: DeltaMessage, finish_reason):
    """The last delta of a streamed choice that may hold tool calls: the content not sent yet, and the calls."""
    content, calls = parser.parse(text)
    if not calls:
        return message, finish_reason
    rest = (content or "")[sent:] if (content or "").startswith(text[:sent]) else ""
    return DeltaMessage(content=rest or None, tool_calls=tool_calls.call_deltas(calls)), "tool_calls"

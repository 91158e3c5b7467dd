"""The OpenAI wire format (as vLLM's server speaks it): request models, response models, the error body.

Requests: parse_request takes the raw body. It must be JSON (no NaN or Infinity, no number beyond a double), an
object, nested at most MAX_JSON_DEPTH levels, every string valid Unicode (a lone surrogate such as "\\ud800" is
refused: no tokenizer or encoder takes it); names (model, user, role) hold at most MAX_NAME_CHARS characters.
Every request object, nested ones included (messages, their content parts and tool_calls, tools, tool_choice,
response_format, structured_outputs, stream_options), takes only the fields its model declares (OpenAI's and
vLLM's fields for it that this server serves or refuses by name): any other is a 400 naming its path
("messages.0.foo"), never dropped. A declared field whose effect this server does not implement (Unsupported:
logit_bias, best_of > 1, an assistant message's audio, ...) passes only when it asks for nothing (null, empty, its
default), else it is a 400 naming it. Numeric fields are strict (a string or a bool
where a number belongs is a 400 naming the field). Responses are plain pydantic models dumped to JSON.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StringConstraints, ValidationError,
    model_serializer, with_config,
)
from pydantic_core import PydanticCustomError
from typing_extensions import Required, TypedDict

from quantkit.serve.sampling_params import MAX_LOGPROBS

# The default --max-request-bytes. A prompt is bounded by max_model_len tokens anyway: 128K tokens are about 1 MB
# as token ids or as escaped non-ASCII text; 4 MiB leaves room for a batch of prompts and refuses, before
# parsing, a body that could only be too long after seconds of tokenizing.
MAX_REQUEST_BYTES = 4 << 20
# Levels of arrays and objects in a body: OpenAI's bodies nest under 10 (a tool's JSON schema a little deeper);
# Python's parser fails near 1000, and every walk over the request (validation, templates, logging) recurses.
MAX_JSON_DEPTH = 64
MAX_NAME_CHARS = 1024  # model, user, message role and name, content part type

Name = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)]
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff in JSON text: a surrogate, maybe unpaired


class APIError(Exception):
    """A request the server refuses: becomes `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def type(self) -> str:
        return {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError",
                503: "ServiceUnavailableError"}.get(self.status, "InternalServerError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class RequestModel(BaseModel):
    """A request object: a field it does not declare is a 400 naming its path (parse_request)."""

    model_config = ConfigDict(extra="forbid")


def Unsupported(*asks_nothing):  # noqa: N802 (a type, used as one)
    """The type of a field OpenAI or vLLM defines whose effect this server does not implement: null, [], {} or one
    of `asks_nothing` passes (and is ignored: it asks for nothing); any other value is a 400 naming the field (a
    client that sets it expects its effect)."""

    def check(value):
        if value in (None, [], {}, *asks_nothing):
            return value
        raise PydanticCustomError("unsupported", "is not supported by this server")

    return Annotated[Any, AfterValidator(check)]


class StreamOptions(RequestModel):
    include_usage: StrictBool = False
    continuous_usage_stats: Unsupported(False) = None  # vLLM's: usage in every chunk


@with_config(ConfigDict(extra="forbid"))
class JsonSchemaFormat(TypedDict, total=False):
    """response_format.json_schema; the values are checked where the grammar is built (structured.py)."""

    name: Any
    description: Any
    schema: Any
    strict: Any


@with_config(ConfigDict(extra="forbid"))
class ResponseFormat(TypedDict, total=False):
    type: Required[Any]  # "text" | "json_object" | "json_schema" (structured.py says which it is not)
    json_schema: JsonSchemaFormat


@with_config(ConfigDict(extra="forbid"))
class StructuredOutputsField(TypedDict, total=False):
    """vLLM's structured_outputs: exactly one of them set (structured.py checks that and the values)."""

    json: Any
    regex: Any
    choice: Any
    grammar: Any
    json_object: Any


class SamplingFields(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""

    model: Name | None = None
    max_tokens: int | None = Field(default=None, strict=True, ge=1)
    max_completion_tokens: int | None = Field(default=None, strict=True, ge=1)
    temperature: float | None = Field(default=None, strict=True, ge=0.0)
    top_p: float | None = Field(default=None, strict=True, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, strict=True, ge=-1)
    min_p: float | None = Field(default=None, strict=True, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, strict=True)
    n: int = Field(default=1, strict=True, ge=1)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    min_tokens: int = Field(default=0, strict=True, ge=0)
    presence_penalty: float = Field(default=0.0, strict=True, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, strict=True, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, strict=True, gt=0.0)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: StrictBool = True
    return_tokens_as_token_ids: StrictBool = False  # vLLM's extension: logprob tokens as "token_id:{id}"
    user: Name | None = None
    # structured output (serve/structured.py): at most one of them; checked with the request (SamplingParams.validate)
    response_format: ResponseFormat | None = None  # {"type": "text" | "json_object" | "json_schema", "json_schema"}
    guided_json: Union[dict[str, Any], str, None] = None  # vLLM's extensions
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None  # vLLM's newer form: {"json" | "regex" | ...}
    guided_decoding_backend: Unsupported("xgrammar") = None  # vLLM's; xgrammar is the one this server runs
    # defined by OpenAI or vLLM, not implemented here (a 400 unless they ask for nothing). The chat route declares
    # and serves tools, tool_choice and parallel_tool_calls (tools.py); completions' suffix is its own field.
    tools: Unsupported() = None
    tool_choice: Unsupported("none", "auto") = None
    parallel_tool_calls: Unsupported(True, False) = None
    functions: Unsupported() = None
    function_call: Unsupported("none", "auto") = None
    logit_bias: Unsupported() = None
    best_of: Unsupported(1) = None
    use_beam_search: Unsupported(False) = None
    suffix: Unsupported("") = None
    prediction: Unsupported() = None
    modalities: Unsupported(["text"]) = None
    audio: Unsupported() = None
    store: Unsupported(False) = None
    metadata: Unsupported() = None
    service_tier: Unsupported("auto", "default") = None
    include_stop_str_in_output: Unsupported(False) = None
    spaces_between_special_tokens: Unsupported(True) = None
    priority: Unsupported(0) = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = None


class ContentPart(RequestModel):
    """A part of a message's content: text (or an assistant's refusal); OpenAI's other kinds are refused."""

    type: Literal["text", "refusal", "image_url", "input_audio", "file"]
    text: str | None = None
    refusal: str | None = None
    image_url: Unsupported() = None  # this server takes text only
    input_audio: Unsupported() = None
    file: Unsupported() = None


class MessageFunctionCall(RequestModel):
    name: Name
    arguments: str  # JSON text, as the response sent it


class MessageToolCall(RequestModel):
    """An entry of an assistant message's tool_calls (a call the model made earlier in the conversation)."""

    id: Name
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(RequestModel):
    """One message, with the keys OpenAI's and vLLM's message objects define (by role: an assistant's
    tool_calls and refusal, a tool result's tool_call_id)."""

    role: Name
    content: Union[str, list[ContentPart], None] = None
    name: Name | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Name | None = None
    refusal: str | None = None
    audio: Unsupported() = None  # an earlier audio reply: there are none here
    function_call: Unsupported() = None  # the deprecated form of tool_calls

    def text(self) -> str:
        """The message content as one string (text and refusal parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join((part.text if part.type == "text" else part.refusal) or "" for part in self.content)

    def for_template(self) -> dict:
        """The message as chat templates take it: role and content, and the other keys it set; a tool call's
        arguments as an object (the templates of Qwen, Llama 3.1 and Mistral write `arguments | tojson`)."""
        message = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id", "refusal"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        return message


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(RequestModel):
    name: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDefinition(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(RequestModel):
    name: Name


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None  # serve/tools.py
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: StrictBool | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(RequestModel):
    model: Name | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class EmbeddingRequest(RequestModel):
    """/v1/embeddings: OpenAI's fields plus vLLM's truncate_prompt_tokens, add_special_tokens and normalize."""

    model: Name | None = None
    input: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, strict=True, ge=1)
    user: Name | None = None
    truncate_prompt_tokens: int | None = Field(default=None, strict=True, ge=-1)  # keep the last k; -1: max_model_len
    add_special_tokens: StrictBool = True
    normalize: StrictBool = True  # L2-normalise the pooled vector


class DetokenizeRequest(RequestModel):
    model: Name | None = None
    tokens: list[StrictInt]


def parse_request(model_cls: type[BaseModel], raw: bytes) -> BaseModel:
    """Decode and validate a request body; the first problem becomes a 400 naming the field."""
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise _too_deep(None) from None
    except ValueError as e:  # also bytes that are not UTF-8 and integers of more digits than Python converts
        raise APIError(400, f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    _check_body(body, strings=SURROGATE_ESCAPE.search(text) is not None)
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        # a field it does not take first: the union members it failed for do not say so (content: "not a string")
        err = next((x for x in errors if x["type"] in ("extra_forbidden", "unsupported")), errors[0])
        param = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p)) or None
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"{param}: unrecognized request field: this server does not take it (the README's "
                                "Serving section lists what it does)", param) from None
        if param in ("prompt", "input"):  # the completions prompt, the embeddings input
            raise APIError(400, f"{param}: must be a string, a list of strings, a list of token ids or a list of "
                                f"lists of token ids (got {_short(body.get(param))})", param) from None
        raise APIError(400, f"{param or 'body'}: {err['msg']} (got {_short(err.get('input'))})", param) from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is beyond the range of a double")
    return value


def _too_deep(field: str | None) -> APIError:
    return APIError(400, f"The request body is nested too deeply: at most {MAX_JSON_DEPTH} levels of arrays and "
                         "objects.", field)


def _check_body(body: dict, strings: bool) -> None:
    """Walk the body without recursing: nesting within MAX_JSON_DEPTH; with `strings`, every key and string valid
    Unicode too (only an escape can make a lone surrogate, so a body without one skips that)."""
    for field, value in body.items():
        stack = [(field, 1), (value, 2)]  # (item, its level if it is a container); the body is level 1
        while stack:
            item, depth = stack.pop()
            if isinstance(item, str):
                if not item.isascii() and not _is_unicode(item):
                    name = field if _is_unicode(field) else None
                    raise APIError(400, f"{name or 'a field name'}: holds a lone surrogate (an unpaired "
                                        "\\ud800-\\udfff escape); send valid Unicode text", name)
            elif isinstance(item, (list, dict)):
                if depth > MAX_JSON_DEPTH:
                    raise _too_deep(field)
                children = item if isinstance(item, list) else [*item.keys(), *item.values()]
                stack.extend((child, depth + 1) for child in children if strings or isinstance(child, (list, dict)))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_union_tag(part) -> bool:
    """pydantic puts the union member it tried into `loc` ("list[int]", or a request model's class name such as
    tool_choice's "NamedToolChoice"); the field path leaves it out."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool")
                                      or part in _model_names(RequestModel))


def _model_names(cls: type) -> set[str]:
    """The class names of cls's subclasses, at every depth (field names are snake_case: they never collide)."""
    return {name for sub in cls.__subclasses__() for name in (sub.__name__, *_model_names(sub))}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- responses --------------------------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    """OpenAI legacy completions logprobs (what lm-eval's local-completions parses)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


FinishReason = Literal["stop", "length", "tool_calls"] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """The reply; tool_calls only when the model called tools (then content is what it said besides, or null)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer
    def _present_fields(self) -> dict:
        body = {"role": self.role, "content": self.content}
        if self.tool_calls:
            body["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return body


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A streamed chat delta: only the fields it carries are sent ({"role", "content"} first, then "content"; tool
    calls as entries with their index, which the client accumulates)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None

    @model_serializer
    def _present_fields(self) -> dict:
        return {k: v for k, v in (("role", self.role), ("content", self.content), ("tool_calls", self.tool_calls))
                if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    """A streamed completions event: same object name and choice shape as the final response."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of the little-endian float32 values


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage

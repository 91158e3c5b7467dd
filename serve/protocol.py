"""The OpenAI wire format (as vLLM's server speaks it): request models, response models, the error body.

Requests: unknown fields are accepted and ignored (the handler logs them); numeric fields are strict (a string or
a bool where a number belongs is a 400 naming the field). Responses are plain pydantic models dumped to JSON.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, model_serializer

from quantkit.serve.sampling_params import MAX_LOGPROBS

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
                405: "MethodNotAllowedError", 503: "ServiceUnavailableError"}.get(self.status, "InternalServerError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
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
    user: str | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None

    def text(self) -> str:
        """The message content as one string (text parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[StrictInt]


def parse_request(model_cls: type[BaseModel], body: Any) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p)) or None
        if param == "prompt":
            raise APIError(400, "prompt: must be a string, a list of strings, a list of token ids or a list of "
                                f"lists of token ids (got {_short(body.get('prompt'))})", param) from None
        raise APIError(400, f"{param or 'body'}: {err['msg']} (got {_short(err.get('input'))})", param) from None


def _is_union_tag(part) -> bool:
    """pydantic puts the union member it tried into `loc` ("list[int]"); the field path leaves it out."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


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


FinishReason = Literal["stop", "length"] | None


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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
    """A streamed chat delta: only the fields it carries are sent ({"role", "content"} first, then "content")."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _present_fields(self) -> dict:
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


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

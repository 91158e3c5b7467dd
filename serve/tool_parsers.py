"""Tool-call parsers, one per chat-template family (vLLM's --tool-call-parser): model output -> `tool_calls`.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks anywhere in the reply; the text
                 around them is content (Hermes 2 Pro, Qwen 2 / 2.5 / 3, and every template that takes no tools:
                 tools.py lists the tools in the system message in these words)
    llama3_json  the whole reply is {"name": ..., "parameters": {...}} ("arguments" is read too), optionally after
                 <|python_tag|>, several calls joined by ";" (Llama 3.1 / 3.2 / 3.3 JSON tool calling)
    mistral      [TOOL_CALLS] then a JSON list of {"name": ..., "arguments": {...}}; text before it is content
                 (Mistral 7B v0.3, Nemo, Small: the pre-v11 tokenizer format); call ids are 9 letters or digits,
                 which Mistral's templates require when the call comes back in a later turn

Each parser also says how its family writes one forced call (`call_format`: structured.py builds the grammar of a
"required" or named tool_choice from it, so the parser reads the call back), and while streaming how much of a
partial reply is content whatever follows (`streamable`: a call, or what may become one, is held back and sent as
one tool_calls delta at the end). The content besides the calls is the reply's text outside them, as written (None
when blank), so the streamed deltas add up to the same content. A reply that does not parse as calls is content.
`choose` picks the parser: the --tool-call-parser option, or with "auto" the first family whose marker the chat
template writes (AUTO_MARKERS).
"""

from __future__ import annotations

import json
import uuid

from quantkit.errors import QuantkitError
from quantkit.serve.protocol import FunctionCall, ToolCall

PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# template text -> the family that writes it, tried in order; a template with none of them: hermes
AUTO_MARKERS = ((MISTRAL_TOOL_CALLS, "mistral"), (HERMES_OPEN, "hermes"), (PYTHON_TAG, "llama3_json"))
AUTO_DEFAULT = "hermes"


def function_call(body) -> FunctionCall | None:
    """{"name": str, "arguments" | "parameters": object or JSON text} -> FunctionCall; None for anything else."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    arguments = body.get("arguments", body.get("parameters", {}))
    if not isinstance(arguments, (dict, str)):
        return None
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return FunctionCall(name=body["name"], arguments=text)


def content_before(text: str, marker: str) -> int:
    """The length of the text that is content whatever follows: short of the marker, of a tail that may grow into
    it, and of the whitespace before either (content written before a call keeps it: see parse)."""
    at = text.find(marker)
    if at < 0:
        at = len(text)
        for keep in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-keep:]):
                at = len(text) - keep
                break
    return len(text[:at].rstrip())


def _blank_is_none(content: str) -> str | None:
    return content if content.strip() else None


class ToolParser:
    """The interface (and Hermes' call ids); one instance per server, stateless."""

    name: str
    call_format: tuple[str, str, str]  # (open, key, close): a forced call is open + {"name": N, key: ARGS} + close

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content besides the calls or None, the calls); no calls: (text, [])."""
        raise NotImplementedError

    def streamable(self, text: str) -> int:
        raise NotImplementedError

    def call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def _calls(self, functions: list[FunctionCall]) -> list[ToolCall]:
        return [ToolCall(id=self.call_id(), function=f) for f in functions]


class HermesParser(ToolParser):
    name = "hermes"
    call_format = (HERMES_OPEN + "\n", "arguments", "\n" + HERMES_CLOSE)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        functions, kept, at = [], [], 0
        while (start := text.find(HERMES_OPEN, at)) >= 0:
            body_at = start + len(HERMES_OPEN)
            end = text.find(HERMES_CLOSE, body_at)
            stop = len(text) if end < 0 else end + len(HERMES_CLOSE)  # an unclosed last block runs to the end
            try:
                call = function_call(json.loads(text[body_at:len(text) if end < 0 else end]))
            except ValueError:
                call = None
            if call is not None:  # a block that is not a call stays in the content
                functions.append(call)
                kept.append(text[at:start])
                at = stop
            elif end < 0:
                break
            else:
                kept.append(text[at:stop])
                at = stop
        if not functions:
            return text, []
        kept.append(text[at:])
        return _blank_is_none("".join(kept)), self._calls(functions)

    def streamable(self, text: str) -> int:
        return content_before(text, HERMES_OPEN)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    call_format = ("", "parameters", "")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(PYTHON_TAG).lstrip()
        decoder, functions, at = json.JSONDecoder(), [], 0
        while body.startswith("{", at):
            try:
                value, at = decoder.raw_decode(body, at)
            except ValueError:
                return text, []
            call = function_call(value)
            if call is None:
                return text, []
            functions.append(call)
            rest = body[at:].lstrip()
            if not rest:
                return None, self._calls(functions)
            if not rest.startswith(";"):
                return text, []
            at = len(body) - len(rest[1:].lstrip())
        return text, []

    def streamable(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head):
            return 0  # may be a call: the whole reply is held back
        return len(text)


class MistralParser(ToolParser):
    name = "mistral"
    call_format = (MISTRAL_TOOL_CALLS + "[", "arguments", "]")

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(MISTRAL_TOOL_CALLS)
        if start < 0:
            return text, []
        body = text[start + len(MISTRAL_TOOL_CALLS):].strip()
        try:
            value = json.loads(body)
        except ValueError:
            return text, []
        functions = [function_call(v) for v in value] if isinstance(value, list) else []
        if not functions or None in functions:
            return text, []
        return _blank_is_none(text[:start]), self._calls(functions)

    def streamable(self, text: str) -> int:
        return content_before(text, MISTRAL_TOOL_CALLS)

    def call_id(self) -> str:
        return uuid.uuid4().hex[:9]


PARSERS = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser())}
CHOICES = ("auto", *PARSERS)


def auto_name(template: str | None) -> str:
    text = template if isinstance(template, str) else ""
    return next((name for marker, name in AUTO_MARKERS if marker in text), AUTO_DEFAULT)


def choose(option: str, template: str | None) -> ToolParser:
    """The parser of --tool-call-parser `option`; "auto": the one the chat template's family writes."""
    if option not in CHOICES:
        raise QuantkitError(f"--tool-call-parser {option}: use one of {', '.join(CHOICES)}")
    return PARSERS[auto_name(template) if option == "auto" else option]

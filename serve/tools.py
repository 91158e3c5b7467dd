"""Tool calling on /v1/chat/completions: `tools` rendered through the chat template, calls parsed back by the
template family's parser (tool_parsers.py: hermes, llama3_json or mistral, chosen once per server).

    plan(request, parser) -> ToolPlan  # tool_choice: "none" renders and parses nothing; "auto" (the default with
                                  #   tools) renders them and parses calls when the output has them; "required" and
                                  #   a named function also constrain the output to one call in the parser's format
                                  #   (a grammar, structured.py) whose arguments follow the function's `parameters`
    render_messages(...)          # a template that takes `tools` (Qwen, Hermes, Llama 3.1, Mistral...) gets them as
                                  #   apply_chat_template(..., tools=...); one that does not (the bundled SmolLM2's)
                                  #   gets them in the system message, in Hermes/Qwen 2.5 words, with the call
                                  #   written the parser's way
While tools are parsed the output is detokenized with its special tokens: a family's marker is one in its
vocabulary (Mistral's [TOOL_CALLS], Llama's <|python_tag|>), as vLLM's parsers require too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from quantkit.serve.protocol import APIError, ChatCompletionRequest
from quantkit.serve.structured import GuidedDecoding
from quantkit.serve.tool_parsers import ToolParser

TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments in this form:\n"
    "{open}{{\"name\": <function-name>, \"{key}\": <args-json-object>}}{close}"
)


@dataclass
class ToolPlan:
    tools: list[dict] | None  # rendered into the prompt (OpenAI tool objects); None: no tools
    parser: ToolParser | None  # parses tool calls out of the output; None: the output is content
    guided: GuidedDecoding | None  # the output must be a call ("required" / a named function)


def plan(request: ChatCompletionRequest, parser: ToolParser) -> ToolPlan:
    choice = request.tool_choice
    tools = request.tools or []
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice: a required or named tool choice needs `tools`", "tool_choice")
        return ToolPlan(None, None, None)
    if choice == "none":
        return ToolPlan(None, None, None)
    dicts = [t.model_dump(exclude_none=True) for t in tools]
    functions = [{"name": t.function.name, "parameters": t.function.parameters} for t in tools]
    if choice in (None, "auto"):
        return ToolPlan(dicts, parser, None)
    if choice != "required":
        name = choice.function.name
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise APIError(400, f"tool_choice: no tool named {name[:100]!r} is in `tools`", "tool_choice")
    forced = {"format": list(parser.call_format), "functions": functions}
    return ToolPlan(dicts, parser, GuidedDecoding("tool", forced, "tools"))


def template_takes_tools(template: str) -> bool:
    return "tools" in template


def render_messages(messages: list[dict], tools: list[dict] | None, template: str,
                    parser: ToolParser) -> tuple[list[dict], dict]:
    """(messages, extra apply_chat_template kwargs) with the tools rendered as the template can."""
    if not tools:
        return messages, {}
    if template_takes_tools(template):
        return messages, {"tools": tools}
    open_, key, close = parser.call_format
    listing = TOOLS_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools), open=open_,
                                  key=key, close=close)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{listing}")
        return [first, *messages[1:]], {}
    return [{"role": "system", "content": listing}, *messages], {}


def call_deltas(calls: list[ToolCall]) -> list[dict]:
    """The streamed form of the calls: one entry each with its index (the openai client accumulates them)."""
    return [{"index": i, "id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}} for i, c in enumerate(calls)]

"""Tool calling on /v1/chat/completions: `tools` rendered through the chat template, Hermes-style calls parsed back.

    plan(request) -> ToolPlan     # tool_choice: "none" renders and parses nothing; "auto" (the default with tools)
                                  #   renders them and parses calls when the output has them; "required" and a
                                  #   named function also constrain the output to one call (a grammar, structured.py)
                                  #   whose arguments follow the function's `parameters` schema
    render_messages(...)          # a template that takes `tools` (Qwen, Hermes, Llama 3.1...) gets them as
                                  #   apply_chat_template(..., tools=...); one that does not (the bundled SmolLM2's)
                                  #   gets them in the system message, in Hermes/Qwen 2.5 words
    parse_tool_calls(text)        # <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks ->
                                  #   (content outside them or None, [ToolCall]); finish_reason "tool_calls"
    streamable(text)              # while streaming: how much of the text is content for sure (a call, or what may
                                  #   start one, is held back and sent as one tool_calls delta at the end)
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from quantkit.serve.protocol import APIError, ChatCompletionRequest, FunctionCall, ToolCall
from quantkit.serve.structured import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, GuidedDecoding

OPEN_TAG, CLOSE_TAG = TOOL_CALL_OPEN.strip(), TOOL_CALL_CLOSE.strip()
CALL_BLOCK = re.compile(re.escape(OPEN_TAG) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE_TAG) + r"|$)", re.DOTALL)
HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


@dataclass
class ToolPlan:
    tools: list[dict] | None  # rendered into the prompt (OpenAI tool objects); None: no tools
    parse: bool  # parse tool calls out of the output
    guided: GuidedDecoding | None  # the output must be a call ("required" / a named function)


def plan(request: ChatCompletionRequest) -> ToolPlan:
    choice = request.tool_choice
    tools = request.tools or []
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice: a required or named tool choice needs `tools`", "tool_choice")
        return ToolPlan(None, False, None)
    if choice == "none":
        return ToolPlan(None, False, None)
    dicts = [t.model_dump(exclude_none=True) for t in tools]
    functions = [{"name": t.function.name, "parameters": t.function.parameters} for t in tools]
    if choice in (None, "auto"):
        return ToolPlan(dicts, True, None)
    if choice != "required":
        name = choice.function.get("name")
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise APIError(400, f"tool_choice: no tool named {str(name)[:100]!r} is in `tools`", "tool_choice")
    return ToolPlan(dicts, True, GuidedDecoding("tool", functions, "tools"))


def template_takes_tools(template: str) -> bool:
    return "tools" in template


def render_messages(messages: list[dict], tools: list[dict] | None, template: str) -> tuple[list[dict], dict]:
    """(messages, extra apply_chat_template kwargs) with the tools rendered as the template can."""
    if not tools:
        return messages, {}
    if template_takes_tools(template):
        return messages, {"tools": tools}
    listing = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{listing}")
        return [first, *messages[1:]], {}
    return [{"role": "system", "content": listing}, *messages], {}


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content besides the calls or None, the calls). A block that is not a JSON {"name", "arguments"} object
    stays in the content."""
    calls, kept, last = [], [], 0
    for match in CALL_BLOCK.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments", body.get("parameters", {}))
        calls.append(ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(
            name=body["name"], arguments=arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                              ensure_ascii=False))))
        kept.append(text[last:match.start()])
        last = match.end()
    if not calls:
        return text, []
    kept.append(text[last:])
    content = "".join(kept).strip()
    return content or None, calls


def streamable(text: str) -> int:
    """The length of the text that is content whatever follows: up to a call's opening tag, or short of a tail
    that may grow into one."""
    at = text.find(OPEN_TAG)
    if at >= 0:
        return at
    for keep in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


def call_deltas(calls: list[ToolCall]) -> list[dict]:
    """The streamed form of the calls: one entry each with its index (the openai client accumulates them)."""
    return [{"index": i, "id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}} for i, c in enumerate(calls)]

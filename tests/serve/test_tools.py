"""Tool calling on the chat route (serve/tools.py) through the official openai client on a real server.

A tiny random model never calls a tool on its own: a named or "required" tool_choice makes the call with a grammar,
so its arguments validate against the function's parameters whatever the weights."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from quantkit.serve.tools import parse_tool_calls, render_messages, streamable
from tests.evals.evals_tiny import save_tiny, tiny_model
from tests.serve.api_live import live_server, serving_app

MODEL = "tiny"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_arguments(arguments: str, schema: dict) -> None:
    value = json.loads(arguments)
    try:
        import jsonschema
    except ImportError:
        assert set(value) == set(schema["required"])
        return
    jsonschema.validate(value, schema)


@pytest.fixture(scope="module")
def oai(tmp_path_factory):
    from quantkit.models.loader import load_model

    loaded = load_model(str(save_tiny(tiny_model(), tmp_path_factory.mktemp("tiny"))), dtype=torch.float32)
    with serving_app(loaded, MODEL, max_model_len=512, kv_cache_memory=32 << 20) as app:
        with live_server(app) as base:
            yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_named_tool_choice_returns_a_call_whose_arguments_validate(oai):
    out = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=150, temperature=0,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    check_arguments(call.function.arguments, PARAMETERS)


def test_the_streamed_call_accumulates_to_the_same_object(oai):
    body = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=150, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = oai.chat.completions.create(**body).choices[0]
    with oai.chat.completions.stream(**body) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    (call,) = final.message.tool_calls
    assert call.function.name == whole.message.tool_calls[0].function.name
    assert json.loads(call.function.arguments) == json.loads(whole.message.tool_calls[0].function.arguments)
    assert (final.message.content or None) == whole.message.content


def test_required_calls_one_of_the_tools_and_none_calls_nothing(oai):
    out = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=150, temperature=1.0,
                                      seed=5, tool_choice="required")
    (call,) = out.choices[0].message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    check_arguments(call.function.arguments, schema)
    out = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0,
                                      tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"


def test_an_unknown_named_tool_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.response.json()["error"]["param"] == "tool_choice"


def test_parse_and_render():
    content, calls = parse_tool_calls('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert content == "Sure." and calls[0].function.name == "f" and json.loads(calls[0].function.arguments) == {"x": 1}
    assert parse_tool_calls("no call here") == ("no call here", [])
    assert parse_tool_calls("<tool_call>not json</tool_call>")[1] == []
    assert streamable("Hello <tool_") == len("Hello ") and streamable("Hi <tool_call>{") == 3
    messages, kwargs = render_messages(MESSAGES, TOOLS, "{{ messages }}")  # a template without tools
    assert kwargs == {} and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert render_messages(MESSAGES, TOOLS, "{% for tool in tools %}{% endfor %}") == (MESSAGES, {"tools": TOOLS})

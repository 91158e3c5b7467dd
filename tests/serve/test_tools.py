"""Tool calling on the chat route (serve/tools.py, serve/tool_parsers.py) through the official openai client on a
real server, for each template family's parser: hermes, llama3_json, mistral.

A tiny random model never calls a tool on its own: a named or "required" tool_choice makes the call with a grammar
in the chosen parser's format, so the parser must read it back, and its arguments validate against the function's
parameters whatever the weights. The family comes from the chat template (--tool-call-parser auto). The hermes
server runs the bundled SmolLM2 template, which takes no tools (they go in the system message). Llama 3.1's and
Mistral v0.3's own templates are not available offline: tests/fixtures/chat_templates/llama3_tools.jinja and
mistral_tools.jinja are minimal templates written for this test that render tools as those families do (described
where they are read below). Model outputs of each family's real format are checked against exact tool_calls in the
parser tests at the end."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.serve.tool_parsers import PARSERS, choose
from quantkit.serve.tools import render_messages
from tests.conftest import REPO
from tests.evals.evals_tiny import save_tiny, tiny_model
from tests.serve.api_live import live_server

MODEL = "tiny"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
]
SCHEMAS = {"get_weather": PARAMETERS, "get_time": TIME_PARAMETERS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

# After Llama 3.1's template: "Environment: ipython" in the system turn, the tools as JSON in the first user turn
# with its "Respond in the format {"name": ..., "parameters": ...}" instruction, an assistant call written as that
# JSON (a built-in tool's after <|python_tag|>), a tool result in an ipython turn.
TEMPLATES = REPO / "tests" / "fixtures" / "chat_templates"
LLAMA3_TEMPLATE = (TEMPLATES / "llama3_tools.jinja").read_text()

# After Mistral 7B Instruct v0.3's template: [AVAILABLE_TOOLS] before the last user turn, an assistant call as
# [TOOL_CALLS] and a JSON list of {"name", "arguments", "id"} (ids of 9 characters, else the template raises),
# a tool result as [TOOL_RESULTS] {"content", "call_id"}.
MISTRAL_TEMPLATE = (TEMPLATES / "mistral_tools.jinja").read_text()

FAMILIES = {"hermes": None, "llama3_json": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}  # None: the bundled one


def check_arguments(arguments: str, schema: dict) -> None:
    jsonschema.validate(json.loads(arguments), schema)


def check_id(parser: str, call_id: str) -> None:
    pattern = r"[0-9a-f]{9}" if parser == "mistral" else r"call_[0-9a-f]{24}"  # Mistral's templates need 9
    assert re.fullmatch(pattern, call_id), call_id


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine on the tiny model; each family's server (its own app) runs on it in turn."""
    from quantkit.models.loader import load_model
    from quantkit.serve.async_engine import AsyncLLMEngine
    from quantkit.serve.llm import build_engine

    loaded = load_model(str(save_tiny(tiny_model(), tmp_path_factory.mktemp("tiny"))), dtype=torch.float32)
    engine = AsyncLLMEngine(build_engine(loaded, max_model_len=768, kv_cache_memory=32 << 20))
    try:
        yield engine, loaded.tokenizer
    finally:
        engine.shutdown(abort_inflight=True)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, engine):
    """(parser name, openai client, its Serving) of a server whose chat template is that family's
    (--tool-call-parser auto)."""
    from quantkit.serve.api import build_app

    engine, tokenizer = engine
    app = build_app(engine, tokenizer, MODEL, engine.max_model_len, chat_template=FAMILIES[request.param])
    assert app.state.serving.tool_parser.name == request.param  # auto found the family in the template
    with live_server(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        yield request.param, client, app.state.serving


def test_named_tool_choice_returns_a_call_whose_arguments_validate(family):
    parser, oai, _ = family
    out = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=150, temperature=0,
                                      tool_choice=NAMED)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    check_id(parser, call.id)
    check_arguments(call.function.arguments, PARAMETERS)


def test_the_streamed_call_accumulates_to_the_same_object(family):
    _, oai, _ = family
    body = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=150, temperature=0, tool_choice=NAMED)
    whole = oai.chat.completions.create(**body).choices[0]
    with oai.chat.completions.stream(**body) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    (call,), (expected,) = final.message.tool_calls, whole.message.tool_calls

    def fields(c):  # the streamed one is the client's accumulated type (with index and parsed_arguments)
        return c.type, c.function.name, c.function.arguments

    assert fields(call) == fields(expected)  # greedy: the same call, byte for byte
    assert (final.message.content or None) == whole.message.content


def test_required_calls_one_of_the_tools_and_none_calls_nothing(family):
    _, oai, _ = family
    out = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=150, temperature=1.0,
                                      seed=5, tool_choice="required")
    (call,) = out.choices[0].message.tool_calls
    check_arguments(call.function.arguments, SCHEMAS[call.function.name])
    out = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0,
                                      tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"


def test_the_call_goes_back_through_the_template_with_its_result(family):
    """The assistant message the client got (its tool_calls, the ids the family needs) and a tool result are taken
    back: the next turn renders (Mistral's template raises on an id that is not 9 characters)."""
    _, oai, _ = family
    first = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=150, temperature=0,
                                        tool_choice=NAMED).choices[0].message
    result = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"celsius": 21}'}
    out = oai.chat.completions.create(model=MODEL, messages=[*MESSAGES, first, result], tools=TOOLS, max_tokens=2,
                                      temperature=0, tool_choice="none")
    assert out.choices[0].finish_reason == "length"


FAMILY_PROMPT = {  # what each family's prompt holds besides the tools' JSON
    "hermes": '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    "llama3_json": 'Respond in the format {"name": function name, "parameters": dictionary of argument name',
    "mistral": '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather"',
}


def test_the_prompt_lists_the_tools_as_the_family_does(family):
    from quantkit.serve.api_generate import chat_prompt
    from quantkit.serve.protocol import ChatCompletionRequest

    parser, _, serving = family
    request = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice=NAMED)
    _, text = chat_prompt(serving, request, [t for t in TOOLS])
    assert FAMILY_PROMPT[parser] in text and '"get_time"' in text and text.count("What is the weather") == 1


def test_an_unknown_named_tool_is_a_400(family):
    _, oai, _ = family
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.response.json()["error"]["param"] == "tool_choice"


# ---- each family's model output -> tool_calls (no server) -----------------------------------------------------

# (parser, what a model of the family writes, content, [(name, arguments)]): exact outputs in each family's
# format, one per line of the fixture (several calls, text around them, non-calls, another family's format)
OUTPUTS = [(r["parser"], r["text"], r["content"], [(c["name"], c["arguments"]) for c in r["calls"]])
           for r in map(json.loads, (REPO / "tests" / "fixtures" / "tool_outputs.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("parser,text,content,calls", OUTPUTS)
def test_each_parser_reads_its_family_output(parser, text, content, calls):
    got_content, got = PARSERS[parser].parse(text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls
    for c in got:
        check_id(parser, c.id)
        assert c.type == "function"


@pytest.mark.parametrize("parser,text,content,calls", OUTPUTS)
def test_streamed_in_pieces_the_content_and_calls_add_up_to_the_parse(parser, text, content, calls):
    """What chat_stream sends, one character at a time: the content for sure while it runs, then the final delta
    (api_generate._final_tool_delta): the content deltas concatenate to the non-streamed content."""
    from quantkit.serve.api_generate import _final_tool_delta
    from quantkit.serve.protocol import DeltaMessage

    tool_parser, sent, streamed = PARSERS[parser], 0, ""
    for end in range(1, len(text)):
        shown = tool_parser.streamable(text[:end])
        streamed += text[sent:shown]
        sent = max(shown, sent)
    last, finish = _final_tool_delta(tool_parser, text, sent, DeltaMessage(content=text[sent:]), "stop")
    streamed += last.content or ""
    assert (streamed or None) == content and finish == ("tool_calls" if calls else "stop")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in last.tool_calls or []] == calls


@pytest.mark.parametrize("parser,text,content_for_sure", [
    ("hermes", "Hello <tool_", "Hello"), ("hermes", "Hi <tool_call>{", "Hi"), ("hermes", "Hi there", "Hi there"),
    ("llama3_json", '  {"na', ""), ("llama3_json", "<|pyth", ""), ("llama3_json", " Hi {", " Hi {"),
    ("mistral", "Ok [TOOL", "Ok"), ("mistral", "Ok [TOOL_CALLS][", "Ok"), ("mistral", "[1, 2]", "[1, 2]"),
])
def test_streaming_holds_back_what_may_be_a_call(parser, text, content_for_sure):
    assert text[:PARSERS[parser].streamable(text)] == content_for_sure


def test_the_parser_comes_from_the_template_or_the_option():
    from quantkit.models.loader import bundled_model_dir

    bundled = (bundled_model_dir() / "chat_template.jinja").read_text()
    assert choose("auto", bundled).name == "hermes" and choose("auto", None).name == "hermes"
    assert choose("auto", LLAMA3_TEMPLATE).name == "llama3_json"
    assert choose("auto", MISTRAL_TEMPLATE).name == "mistral"
    assert choose("auto", "{% if tools %}<tool_call>{% endif %}").name == "hermes"  # Qwen 2.5's marker
    assert choose("mistral", bundled).name == "mistral"
    with pytest.raises(QuantkitError, match="--tool-call-parser"):
        choose("pythonic", bundled)


def test_a_template_without_tools_gets_them_in_the_system_message_in_the_parser_format():
    messages, kwargs = render_messages(MESSAGES, TOOLS, "{{ messages }}", PARSERS["mistral"])
    assert kwargs == {} and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]' in messages[0]["content"]
    messages, _ = render_messages(MESSAGES, TOOLS, "{{ messages }}", PARSERS["hermes"])
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in \
        messages[0]["content"]
    assert render_messages(MESSAGES, TOOLS, "{% for tool in tools %}{% endfor %}", PARSERS["hermes"]) == \
        (MESSAGES, {"tools": TOOLS})

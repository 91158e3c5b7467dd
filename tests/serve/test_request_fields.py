"""Which request fields the OpenAI routes take (serve/protocol.py), through the official openai client on a real
server: a field OpenAI's and vLLM's APIs do not define for an object is a 400 naming its path, at the top level or
nested; a defined one this server does not implement is a 400 when it asks for something; what the openai client
sends by itself, and vLLM's extra_body fields, are served."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest
import torch

from tests.evals.evals_tiny import save_tiny, tiny_model
from tests.serve.api_live import live_server, serving_app

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def oai(tmp_path_factory):
    from quantkit.models.loader import load_model

    loaded = load_model(str(save_tiny(tiny_model(), tmp_path_factory.mktemp("tiny"))), dtype=torch.float32)
    with serving_app(loaded, MODEL, max_model_len=256, kv_cache_memory=16 << 20) as app:
        with live_server(app) as base:
            yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def refused(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    error = e.value.response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400, error
    return error


def chat(oai, **body):
    return oai.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **body})


@pytest.mark.parametrize("body,path", [
    ({"extra_body": {"foo": 1}}, "foo"),
    ({"messages": [{"role": "user", "content": "Hi", "foo": 1}]}, "messages.0.foo"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "foo": 1}]}]},
     "messages.0.content.0.foo"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", "foo": 1}}]}]},
     "messages.1.tool_calls.0.function.foo"),
    ({"tools": [{"type": "function", "function": {**TOOL["function"], "foo": 1}}]}, "tools.0.function.foo"),
    ({"tools": [{**TOOL, "foo": 1}]}, "tools.0.foo"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f", "foo": 1}}},
     "tool_choice.function.foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "foo": 1}}},
     "response_format.json_schema.foo"),
    ({"response_format": {"type": "json_object", "foo": 1}}, "response_format.foo"),
    ({"extra_body": {"structured_outputs": {"choice": ["a"], "foo": 1}}}, "structured_outputs.foo"),
    ({"stream": True, "stream_options": {"include_usage": True, "foo": 1}}, "stream_options.foo"),
])
def test_an_unknown_chat_field_is_a_400_naming_its_path(oai, body, path):
    error = refused(lambda: chat(oai, **body))
    assert error["param"] == path and error["message"].startswith(f"{path}: unrecognized request field"), error


def test_an_unknown_field_on_the_other_routes_is_a_400_naming_it(oai):
    error = refused(lambda: oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"foo": 1}))
    assert error["param"] == "foo"
    error = refused(lambda: oai.embeddings.create(model=MODEL, input="Hi", extra_body={"pooling": "mean"}))
    assert error["param"] == "pooling"


@pytest.mark.parametrize("body,path", [
    ({"extra_body": {"logit_bias": {"50": -100}}}, "logit_bias"),
    ({"extra_body": {"best_of": 3}}, "best_of"),
    ({"messages": [*MESSAGES, {"role": "assistant", "audio": {"id": "audio_1"}}]}, "messages.1.audio"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
     "messages.0.content.0.image_url"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
])
def test_a_defined_field_this_server_does_not_implement_is_a_400_when_set(oai, body, path):
    error = refused(lambda: chat(oai, **body))
    assert error["param"] == path and "is not supported by this server" in error["message"], error


def test_what_the_openai_client_sends_and_vllm_extra_body_fields_are_served(oai):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)

    parsed = oai.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                        response_format=City)  # json_schema with name and strict: true
    assert isinstance(parsed.choices[0].message.parsed, City)
    chunks = list(chat(oai, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 2
    vllm = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 1,
            "skip_special_tokens": False, "return_tokens_as_token_ids": True, "stop_token_ids": [2],
            "guided_choice": ["yes", "no"], "guided_decoding_backend": "xgrammar"}
    out = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=vllm)
    assert out.choices[0].text in ("yes", "no")
    # the defined-but-unimplemented fields pass when they ask for nothing
    asking_nothing = {"logit_bias": None, "best_of": 1, "use_beam_search": False, "store": False,
                      "spaces_between_special_tokens": True}
    assert chat(oai, extra_body=asking_nothing).choices[0].finish_reason == "length"
    vectors = oai.embeddings.create(model=MODEL, input=["Hi", "there"], extra_body={"truncate_prompt_tokens": 1})
    assert len(vectors.data) == 2  # the client asked for base64 (encoding_format) by itself and decoded it
    assert vectors.usage.prompt_tokens == 2


def test_every_message_key_openai_defines_is_taken(oai):
    """system/user name, an assistant's tool_calls and refusal (null audio and function_call), a tool result's
    tool_call_id, text and refusal content parts."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": 1})}}
    messages = [
        {"role": "system", "content": "Be brief.", "name": "policy"},
        {"role": "user", "content": [{"type": "text", "text": "Call f."}], "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None, "audio": None,
         "function_call": None},
        {"role": "tool", "content": "done", "tool_call_id": "call_1"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "user", "content": "Thanks"},
    ]
    assert chat(oai, messages=messages, tools=[TOOL]).choices[0].finish_reason == "length"

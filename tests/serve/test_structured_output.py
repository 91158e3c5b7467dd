"""Structured output (serve/structured.py) through the official openai client on a real server.

The model is a tiny random one: its text is garbage, so whatever parses comes from the grammar mask alone. Schemas
are bounded (enums, maxLength, booleans) so the output closes well within max_tokens.
"""

from __future__ import annotations

import json
import re
import threading

import openai
import pytest
import torch

from quantkit.serve.sampler import Sampler
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.structured import GuidedDecoding
from quantkit.serve.validation import validate_request
from tests.evals.evals_tiny import save_tiny, tiny_model
from tests.serve.api_live import live_server, serving_app

MODEL = "tiny"
MAX_MODEL_LEN = 512
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "color", "ok"],
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
PROMPTS = [f"Describe thing number {i} as JSON:" for i in range(20)]
REGEX = r"[a-z]{3}-\d{2}"


def check_schema(value) -> None:
    try:
        import jsonschema
    except ImportError:  # by hand
        assert set(value) == {"name", "color", "ok"} and isinstance(value["name"], str) and len(value["name"]) <= 8
        assert value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
        return
    jsonschema.validate(value, SCHEMA)
    assert set(value) == {"name", "color", "ok"}  # strict: no other property


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from quantkit.models.loader import load_model

    return load_model(str(save_tiny(tiny_model(), tmp_path_factory.mktemp("tiny"))), dtype=torch.float32)


@pytest.fixture(scope="module")
def url(loaded):
    with serving_app(loaded, MODEL, max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 << 20) as app:
        with live_server(app) as base:
            yield base


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_json_schema_output_parses_and_validates_on_20_prompts(oai):
    out = oai.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=200, temperature=1.0, seed=7,
                                 extra_body={"response_format": JSON_SCHEMA_FORMAT})
    assert len(out.choices) == 20
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.text
        check_schema(json.loads(choice.text))
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A thing, as JSON."}],
                                       max_tokens=200, temperature=0, response_format=JSON_SCHEMA_FORMAT)
    assert chat.choices[0].finish_reason == "stop"
    check_schema(json.loads(chat.choices[0].message.content))


def test_guided_json_and_json_object_parse(oai):
    out = oai.completions.create(model=MODEL, prompt="JSON:", max_tokens=200, temperature=0,
                                 extra_body={"guided_json": SCHEMA})
    check_schema(json.loads(out.choices[0].text))
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Any JSON object."}],
                                       max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)


def test_guided_choice_returns_a_choice_streamed_or_not(oai):
    choices = ["positive", "negative", "neutral"]
    for seed in range(3):
        out = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Sentiment?"}],
                                          max_tokens=20, temperature=1.0, seed=seed,
                                          extra_body={"guided_choice": choices})
        assert out.choices[0].message.content in choices and out.choices[0].finish_reason == "stop"
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Sentiment?"}],
                                         max_tokens=20, temperature=0, stream=True,
                                         extra_body={"guided_choice": choices})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in choices


def test_guided_regex_fullmatches_with_n_completions(oai):
    out = oai.completions.create(model=MODEL, prompt="Code:", max_tokens=30, temperature=1.0, n=3, seed=3,
                                 extra_body={"guided_regex": REGEX})
    assert len(out.choices) == 3
    for choice in out.choices:
        assert re.fullmatch(REGEX, choice.text), choice.text
        assert choice.finish_reason == "stop"


def test_guided_grammar_and_structured_outputs(oai):
    out = oai.completions.create(model=MODEL, prompt="Answer:", max_tokens=30, temperature=0,
                                 extra_body={"guided_grammar": 'root ::= "A" bc bc "!"\nbc ::= "b" | "c"'})
    assert re.fullmatch(r"A[bc]{2}!", out.choices[0].text)
    out = oai.completions.create(model=MODEL, prompt="Answer:", max_tokens=30, temperature=0,
                                 extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert out.choices[0].text in ("up", "down")


@pytest.mark.parametrize("field,value", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
    ("response_format", {"type": "yaml"}),
    ("guided_json", {"properties": 5}),
    ("guided_regex", "(unclosed"),
    ("guided_grammar", "root ::= undefined_rule"),
    ("guided_choice", ["", "x"]),
])
def test_a_bad_spec_is_a_400_naming_the_field(oai, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={field: value})
    error = e.value.response.json()["error"]
    assert error["param"] == field and error["type"] == "BadRequestError", error
    assert error["message"].startswith(field)


def test_two_structured_fields_are_a_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=4,
                               extra_body={"guided_regex": "a+", "guided_choice": ["a"]})
    assert e.value.response.json()["error"]["param"] == "guided_choice"


def test_unconstrained_requests_beside_constrained_ones_are_bit_identical(oai):
    """Over HTTP: the same greedy text alone and while constrained requests run in the same batches."""
    plain = dict(model=MODEL, prompt="The weather today", max_tokens=40, temperature=0)
    alone = oai.completions.create(**plain).choices[0].text
    results = {}

    def constrained(i):
        results[i] = oai.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=200, temperature=0,
                                            extra_body={"response_format": JSON_SCHEMA_FORMAT}).choices[0].text

    threads = [threading.Thread(target=constrained, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    together = oai.completions.create(**plain).choices[0].text
    for t in threads:
        t.join()
    assert together == alone
    for text in results.values():
        check_schema(json.loads(text))


def test_engine_batch_with_a_constrained_row_leaves_the_others_bit_identical(loaded):
    """In one engine: the unconstrained requests' tokens, batched with constrained ones, equal their tokens run
    alone (greedy and seeded sampling); test_sampler_masks_only_the_constrained_rows checks the rows bit for bit."""
    from quantkit.serve.llm import build_engine

    engine = build_engine(loaded, max_model_len=MAX_MODEL_LEN, kv_cache_memory=32 << 20)
    tok = loaded.tokenizer

    def run(with_guided: bool) -> dict:
        specs = {"greedy": SamplingParams(temperature=0, max_tokens=24, logprobs=2),
                 "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=24)}
        if with_guided:
            specs["json"] = SamplingParams(temperature=0, max_tokens=120, guided=GuidedDecoding("json", SCHEMA, "x"))
            specs["regex"] = SamplingParams(temperature=1.0, seed=2, max_tokens=30,
                                            guided=GuidedDecoding("regex", REGEX, "x"))
        for rid, params in specs.items():
            ids = tok(f"prompt {rid}").input_ids if rid in ("json", "regex") else tok("Once upon a time").input_ids
            engine.add_request(rid, validate_request(ids, params, engine.vocab_size, MAX_MODEL_LEN, 64))
        outs = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0]
        return outs

    alone, together = run(False), run(True)
    for rid in ("greedy", "seeded"):
        assert together[rid].token_ids == alone[rid].token_ids
    # the logprobs come from the forward, whose float sums depend on the batch's shape: equal to rounding
    for a, b in zip(together["greedy"].logprobs, alone["greedy"].logprobs):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
    check_schema(json.loads(together["json"].text))
    assert re.fullmatch(REGEX, together["regex"].text)


def test_sampler_masks_only_the_constrained_rows(loaded):
    from quantkit.serve.structured import StructuredOutputs

    structured = StructuredOutputs(loaded.tokenizer, 49152, {loaded.tokenizer.eos_token_id})

    class Seq:
        def __init__(self, params, matcher=None):
            self.request = type("R", (), {"params": params})()
            self.matcher, self.num_output_tokens = matcher, 0

    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    greedy = SamplingParams(temperature=0)
    seqs = [Seq(greedy), Seq(greedy, structured.start(GuidedDecoding("choice", ["yes", "no"], "x"))), Seq(greedy)]
    sampler = Sampler(set())
    masked = sampler._constrain(logits, seqs, [s.request.params for s in seqs])
    assert torch.equal(masked[0], before[0]) and torch.equal(masked[2], before[2])  # bit for bit
    assert torch.isinf(masked[1]).sum() > 49000  # all but the few tokens that start "yes" / "no"
    out = sampler(logits, seqs, [None] * 3)
    assert torch.equal(logits, before)  # the runner's logits are not written
    assert out.tokens[0] == int(before[0].argmax()) and out.tokens[2] == int(before[2].argmax())
    assert loaded.tokenizer.decode([out.tokens[1]]) in ("y", "ye", "yes", "n", "no")

"""The wire contract of SERVING.md against a real uvicorn server on 127.0.0.1 serving the bundled model.

Raw httpx checks the bytes (error bodies, SSE framing); the official `openai` client checks that real clients
parse what we send. Engine state (running requests, KV blocks in use) is read from the engine itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serve.api_live import free_port, live_server, serving_app

pytestmark = pytest.mark.slow

MODEL_NAME = "smollm2"
MAX_MODEL_LEN = 512
API_KEY = "test-key-3f9"
KV_BYTES = 128 << 20  # fp32: 45 KiB per token, about 2900 tokens
METRIC_NAMES = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
    "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
    "request_success_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
    "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket", "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total", "kv_capacity_tokens",
    "model_info",
]
CHAT = [{"role": "user", "content": "Name three colors of the rainbow."}]


@pytest.fixture(scope="module", params=["thread", "process"])
def app(bundled, request):
    """Every contract holds for both engine back ends: a thread of the server, and the child process that
    `quantkit serve` runs."""
    with serving_app(bundled, MODEL_NAME, process=request.param == "process", max_model_len=MAX_MODEL_LEN,
                     kv_cache_memory=KV_BYTES) as application:
        yield application


@pytest.fixture(scope="module")
def url(app):
    with live_server(app) as base:
        yield base


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(url):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def engine_of(app):
    return app.state.serving.engine


def sse_events(response: httpx.Response) -> list[str]:
    """The raw `data: ...` payloads, checking every event is exactly `data: <payload>\\n\\n`."""
    body = response.read().decode()
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = body.split("\n\n")
    assert events[-1] == ""
    payloads = []
    for event in events[:-1]:
        assert event.startswith("data: ") and "\n" not in event, repr(event)
        payloads.append(event[len("data: "):])
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return payloads


def assert_error(response: httpx.Response, status: int, type_: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_ and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- errors --------------------------------------------------------------------------------------------------


def test_too_long_is_vllms_message_byte_for_byte(http, bundled):
    prompt = "The quick brown fox jumps over the lazy dog. " * 20
    n_prompt = len(bundled.tokenizer(prompt).input_ids)
    max_tokens = MAX_MODEL_LEN - n_prompt + 7
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens})
    error = assert_error(response, 400, "BadRequestError")
    assert error["message"] == (
        f"This model's maximum context length is 512 tokens. However, you requested {max_tokens} output tokens and "
        f"your prompt contains at least {n_prompt} input tokens, for a total of at least {n_prompt + max_tokens} "
        "tokens. Please reduce the length of the input prompt or the number of requested output tokens."
    )


def test_unknown_model_is_404(http, oai):
    import openai

    error = assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404, "NotFoundError")
    assert error["message"] == "The model `gpt-9` does not exist."
    with pytest.raises(openai.NotFoundError, match="The model `gpt-9` does not exist."):
        oai.chat.completions.create(model="gpt-9", messages=CHAT)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("max_tokens", "ten"), ("max_tokens", 2.5), ("temperature", -0.1), ("temperature", "hot"),
    ("top_p", 0), ("top_p", 1.5), ("top_p", [0.5]), ("n", 0), ("n", True), ("stop", 5), ("logprobs", 21),
    ("presence_penalty", 3.0), ("seed", "x"), ("stream", "yes"),
])
def test_bad_field_is_400_naming_it(http, field, value):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, field: value}
    error = assert_error(http.post("/v1/completions", json=body), 400, "BadRequestError", param=field)
    assert field in error["message"]


def test_bad_chat_bodies_are_400(http):
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": "hi"}), 400,
                 "BadRequestError", param="messages")
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": CHAT, "top_p": -1}), 400,
                 "BadRequestError", param="top_p")
    assert_error(http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}),
                 400, "BadRequestError")
    assert_error(http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [49152]}), 400,
                 "BadRequestError", param="prompt")


def test_unknown_route_is_404_json(http):
    assert_error(http.get("/v1/engines"), 404, "NotFoundError")
    assert_error(http.post("/nothing/here", json={}), 404, "NotFoundError")


def test_api_key_guards_v1_only(app):
    from quantkit.serve.api import build_app

    serving = app.state.serving
    guarded = build_app(serving.engine, serving.tokenizer, MODEL_NAME, MAX_MODEL_LEN, api_key=API_KEY)
    with live_server(guarded) as base, httpx.Client(base_url=base, timeout=60) as c:
        body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
        assert_error(c.post("/v1/completions", json=body), 401, "AuthenticationError")
        assert_error(c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401,
                     "AuthenticationError")
        assert_error(c.get("/v1/models"), 401, "AuthenticationError")
        ok = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        assert c.get("/health").status_code == 200  # outside /v1: open, as in vLLM


# ---- responses -----------------------------------------------------------------------------------------------


def test_models_health_version_tokenize(http, bundled):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert http.get("/health").status_code == 200
    from quantkit import __version__

    assert http.get("/version").json() == {"version": __version__}
    text = "Paged attention, in blocks of 16."
    tokens = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": text}).json()
    assert tokens["tokens"] == bundled.tokenizer(text).input_ids and tokens["count"] == len(tokens["tokens"])
    assert http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens["tokens"]}).json() == {"prompt": text}


def test_models_retrieve_gives_the_served_card_and_404s_otherwise(http, oai):
    import openai

    card = oai.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    assert http.get(f"/v1/models/{MODEL_NAME}").json() == http.get("/v1/models").json()["data"][0]
    error = assert_error(http.get("/v1/models/gpt-9"), 404, "NotFoundError", "model")
    assert error["message"] == "The model `gpt-9` does not exist."
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("org/other-model")


def test_structured_output_on_both_back_ends(oai):
    """The grammar travels with the request to the engine process too (test_structured_output.py: the rest)."""
    out = oai.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=0,
                                      extra_body={"guided_choice": ["red", "orange", "violet"]})
    assert out.choices[0].message.content in ("red", "orange", "violet") and out.choices[0].finish_reason == "stop"


def test_completion_shape_and_prompt_forms(http, bundled):
    text = "The capital of France is"
    ids = bundled.tokenizer(text).input_ids
    body = {"model": MODEL_NAME, "max_tokens": 5, "temperature": 0}
    single = http.post("/v1/completions", json={**body, "prompt": text}).json()
    assert single["object"] == "text_completion" and single["id"].startswith("cmpl-")
    assert single["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 5, "total_tokens": len(ids) + 5}
    choice = single["choices"][0]
    assert set(choice) >= {"index", "text", "logprobs", "finish_reason"} and choice["finish_reason"] == "length"
    expected = choice["text"]
    for prompt in ([text], ids, [ids]):
        other = http.post("/v1/completions", json={**body, "prompt": prompt}).json()
        assert [c["text"] for c in other["choices"]] == [expected]
    both = http.post("/v1/completions", json={**body, "prompt": [ids, ids], "n": 2}).json()
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in both["choices"]] == [expected] * 4  # greedy: all n completions agree
    assert both["usage"]["prompt_tokens"] == 2 * len(ids) and both["usage"]["completion_tokens"] == 4 * 5


def test_default_max_tokens(http, bundled):
    """Completions default to 16 tokens; chat defaults to what fits in max_model_len."""
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Once", "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 16
    user = "word " * 600
    text = bundled.tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                 add_generation_prompt=True)
    room = 3
    n_words = 600 - (len(bundled.tokenizer(text, add_special_tokens=False).input_ids) - (MAX_MODEL_LEN - room))
    fitted = [{"role": "user", "content": "word " * n_words}]
    chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": fitted, "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
    assert chat.json()["choices"][0]["finish_reason"] == "length"
    too_long = http.post("/v1/chat/completions", json={"model": MODEL_NAME,
                                                        "messages": [{"role": "user", "content": user}]})
    assert_error(too_long, 400, "BadRequestError")


def test_echo_logprobs_score_the_prompt(http, bundled):
    """What lm-eval's local-completions sends: token ids, echo, logprobs=1, max_tokens=1."""
    import torch

    ids = bundled.tokenizer("Water boils at one hundred degrees Celsius.").input_ids
    body = {"model": MODEL_NAME, "prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    lp = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    with torch.no_grad():
        ref = torch.log_softmax(bundled.model(torch.tensor([ids]))[0].float(), dim=-1)
    expected = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(expected, abs=1e-3)
    for token_lp, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert token_lp in top.values() and max(top.values()) >= token_lp  # chosen token plus the top-1


def test_chat_logprobs_shape(oai):
    response = oai.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy picks the top token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                  reverse=True)


# ---- streaming -----------------------------------------------------------------------------------------------


def test_chat_sse_framing_raw(http):
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 12, "temperature": 0, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    whole = http.post("/v1/chat/completions", json={**body, "stream": False, "stream_options": None}).json()
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_events(response)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    *choice_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in choice_chunks)
    for index in (0, 1):
        deltas = [c["choices"][0] for c in choice_chunks if c["choices"][0]["index"] == index]
        assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in d["delta"] for d in deltas[1:])
        assert [d["finish_reason"] for d in deltas[:-1]] == [None] * (len(deltas) - 1)
        assert deltas[-1]["finish_reason"] == whole["choices"][index]["finish_reason"]
        text = "".join(d["delta"].get("content", "") for d in deltas)
        assert text == whole["choices"][index]["message"]["content"]


def test_completion_sse_with_openai_client(oai):
    common = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, temperature=0)
    whole = oai.completions.create(**common)
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **common))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    no_usage = list(oai.completions.create(stream=True, **common))
    assert all(c.choices for c in no_usage)


def test_stop_string_never_leaks_into_the_stream(http):
    body = {"model": MODEL_NAME, "prompt": "List the days of the week: Monday, Tuesday,", "max_tokens": 24,
            "temperature": 0}
    free_text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = "day, Thu"  # spans tokens; the engine must hold "day, " back until it is sure
    assert stop in free_text, free_text
    with http.stream("POST", "/v1/completions", json={**body, "stop": [stop], "stream": True}) as response:
        chunks = [json.loads(p) for p in sse_events(response)[:-1]]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == free_text[:free_text.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == stop


def test_disconnect_mid_stream_frees_blocks(app, url):
    engine = engine_of(app)
    body = {"model": MODEL_NAME, "prompt": "Count to one thousand: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        assert engine.stats()["num_requests_running"] == 1 and engine.stats()["kv_used_blocks"] > 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (engine.stats()["num_requests_running"] or
                                           engine.stats()["kv_used_blocks"]):
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["kv_used_blocks"] == 0
    assert stats["request_success"].get("abort", 0) >= 1


def test_disconnect_during_json_request_aborts_it(app, url):
    engine = engine_of(app)
    aborted = engine.stats()["request_success"].get("abort", 0)
    body = {"model": MODEL_NAME, "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and engine.stats()["request_success"].get("abort", 0) == aborted:
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["request_success"].get("abort", 0) == aborted + 1
    assert stats["num_requests_running"] == 0 and stats["kv_used_blocks"] == 0


def test_metrics_exposition(http):
    before = _metric(http.get("/metrics").text, 'quantkit:request_success_total{model_name="smollm2",'
                                                'finished_reason="length"}')
    usage = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "One, two,", "max_tokens": 3,
                                                "ignore_eos": True}).json()["usage"]
    response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    for name in METRIC_NAMES:
        assert f"\nquantkit:{name}{{" in text, name
    assert _metric(text, 'quantkit:request_success_total{model_name="smollm2",finished_reason="length"}') == before + 1
    assert _metric(text, 'quantkit:generation_tokens_total{model_name="smollm2"}') >= usage["completion_tokens"]
    assert _metric(text, 'quantkit:kv_capacity_tokens{model_name="smollm2"}') > 0
    count = _metric(text, 'quantkit:time_to_first_token_seconds_count{model_name="smollm2"}')
    assert _metric(text, 'quantkit:time_to_first_token_seconds_bucket{model_name="smollm2",le="+Inf"}') == count > 0


def _metric(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not in /metrics")


# ---- process lifecycle ---------------------------------------------------------------------------------------


def test_engine_shutdown_mid_stream_sends_an_error_event(bundled):
    with serving_app(bundled, MODEL_NAME, max_model_len=256, kv_cache_memory=16 << 20) as application, \
            live_server(application) as base, httpx.Client(base_url=base, timeout=60) as c:
        body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            first = json.loads(next(lines)[6:])
            application.state.serving.engine.shutdown(abort_inflight=True)
            rest = list(lines)
    assert first["choices"][0]["finish_reason"] is None
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    assert all("error" not in json.loads(line[6:]) for line in rest[:-2])


def test_engine_process_death_fails_streams_and_health(bundled):
    with serving_app(bundled, MODEL_NAME, process=True, max_model_len=256, kv_cache_memory=16 << 20) as application, \
            live_server(application) as base, httpx.Client(base_url=base, timeout=60) as c:
        assert c.get("/health").status_code == 200
        body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            next(lines)
            application.state.serving.engine._proc.kill()
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == 503 and "engine process exited" in error["message"]
        assert_error(c.get("/health"), 503, "ServiceUnavailableError")


def test_stopped_engine_makes_health_503(bundled):
    with serving_app(bundled, MODEL_NAME, max_model_len=64, kv_cache_memory=4 << 20) as stopped:
        stopped.state.serving.engine.shutdown(abort_inflight=True)
        with live_server(stopped) as base, httpx.Client(base_url=base, timeout=30) as c:
            assert_error(c.get("/health"), 503, "ServiceUnavailableError")
            assert_error(c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}), 503,
                         "ServiceUnavailableError")
            assert c.get("/v1/models").status_code == 200



TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")


def test_sigterm_finishes_in_flight_and_exits_zero(tmp_path, bundled):
    """A real `quantkit serve` process: flags wired through (name, chat template, key), then SIGTERM mid-stream."""
    port = free_port()
    script = Path(sys.executable).parent / "quantkit"
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([str(script), "serve", "--port", str(port), "--max-model-len", "256",
                             "--kv-cache-memory", str(16 << 20), "--served-model-name", "tiny-chat",
                             "--chat-template", str(tmp_path / "template.jinja")],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "QUANTKIT_API_KEY": API_KEY})
    auth = {"Authorization": f"Bearer {API_KEY}"}
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not become healthy"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        assert httpx.get(base + "/v1/models").status_code == 401
        assert [m["id"] for m in httpx.get(base + "/v1/models", headers=auth).json()["data"]] == ["tiny-chat"]
        assert httpx.post(base + "/tokenize", json={"messages": CHAT}).status_code == 401
        rendered = httpx.post(base + "/tokenize", json={"messages": CHAT}, headers=auth).json()["tokens"]
        expected = f"<<user>>{CHAT[0]['content']}\n<<assistant>>"
        assert rendered == bundled.tokenizer(expected, add_special_tokens=False).input_ids
        bare = httpx.post(base + "/tokenize", json={"messages": CHAT, "add_generation_prompt": False},
                          headers=auth).json()
        without_prompt = expected[:-len("<<assistant>>")]
        assert bare["tokens"] == bundled.tokenizer(without_prompt, add_special_tokens=False).input_ids
        events: list[str] = []

        def stream() -> None:
            body = {"model": "tiny-chat", "prompt": "Tell me a story.", "max_tokens": 24, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, headers=auth, timeout=60) as response:
                events.extend(line for line in response.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        reader.join(timeout=30)
        assert events and events[-1] == "data: [DONE]"  # the in-flight request was finished, not cut
        finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] == "length"
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()

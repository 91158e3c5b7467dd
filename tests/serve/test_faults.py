"""Faults against real servers on 127.0.0.1 serving a tiny random model: no request knocks the server over.

Each refused request gets a 4xx in the OpenAI error shape (or its documented behaviour), and the server then answers
a greedy request with the same text as before. Most tests share one `quantkit serve` subprocess (what users run);
the engine-death and SIGTERM tests start their own, and the failing-step tests drive the engines in this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from quantkit.serve.protocol import (
    MAX_JSON_DEPTH, MAX_REQUEST_BYTES, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
)
from quantkit.serve.sampling_params import MAX_STOP, MAX_STOP_CHARS, SamplingParams
from quantkit.serve.validation import ValidRequest
from tests.evals.evals_tiny import save_tiny, tiny_model
from tests.serve.api_live import free_port, live_server, serving_app

pytestmark = pytest.mark.slow

API_KEY = "fault-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
VOCAB = 49152  # the bundled tokenizer's, which the tiny model uses
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 128
LONG_MODEL_LEN = 4096  # the SIGTERM server's: streams that cannot finish within its grace period
KV_BYTES = 32 << 20
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
POISON_TOP_K = 4321  # a valid top_k the in-process tests' sampler is made to fail on


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    out = save_tiny(tiny_model(), tmp_path_factory.mktemp("tiny"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": LONG_MODEL_LEN}))
    return out


class Served:
    """A `python -m quantkit.cli serve` subprocess and an httpx client on it (with the API key)."""

    def __init__(self, proc: subprocess.Popen, base: str, log_path: Path):
        self.proc, self.base, self.log_path = proc, base, log_path
        self.http = httpx.Client(base_url=base, headers=AUTH, timeout=60)

    def log(self) -> str:
        return self.log_path.read_text()

    def greedy_text(self) -> str:
        response = self.http.post("/v1/completions", json=GREEDY)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]


@contextmanager
def quantkit_serve(model_dir: Path, log_dir: Path, *flags: str, max_model_len: int = MAX_MODEL_LEN):
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    env = {**os.environ, "QUANTKIT_API_KEY": API_KEY, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "quantkit.cli", "serve", str(model_dir), "--port", str(port),
                                 "--max-model-len", str(max_model_len), "--max-num-seqs", str(MAX_NUM_SEQS),
                                 "--kv-cache-memory", str(KV_BYTES), "--log-level", "info", *flags],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    served = Served(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + 180
        while not _healthy(served):
            assert proc.poll() is None, served.log()[-3000:]
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.2)
        yield served
    finally:
        served.http.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _healthy(served: Served) -> bool:
    try:
        return httpx.get(served.base + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    with quantkit_serve(tiny_dir, tmp_path_factory.mktemp("logs")) as served:
        served.reference = served.greedy_text()
        yield served
    assert "Traceback" not in served.log(), served.log()[-3000:]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_still_serving(server: Served) -> None:
    assert server.greedy_text() == server.reference


def sse_payloads(response: httpx.Response) -> list[str]:
    lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    return lines[:-1]


def post(server: Served, path: str, body: dict | bytes) -> httpx.Response:
    """The response, read whole (a stream too)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # lone surrogates escaped as \ud800
    return server.http.post(path, content=content, headers={"Content-Type": "application/json"})


# ---- every field bounded at the edge ----------------------------------------------------------------------------


BAD_FIELDS = [
    ("top_k", 10**30), ("top_k", 2**63), ("top_k", VOCAB + 1), ("top_k", -2), ("n", MAX_NUM_SEQS + 1), ("n", 1000),
    ("seed", 2**63), ("seed", -(2**63) - 1), ("stop", ["x"] * (MAX_STOP + 1)), ("stop", ["y" * (MAX_STOP_CHARS + 1)]),
    ("stop_token_ids", list(range(MAX_STOP + 1))), ("logprobs", 21), ("max_tokens", 10**30), ("max_tokens", 0),
    ("min_tokens", -1), ("temperature", -1), ("temperature", 1e300), ("top_p", 1.5), ("min_p", 2),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", 1e39),
    ("model", "m" * 2000), ("user", "u" * 2000),
]


@pytest.mark.parametrize("stream", [False, True])
def test_every_bad_field_is_a_400_naming_it_before_any_stream(server, stream):
    for field, value in BAD_FIELDS:
        body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0.7, "stream": stream, field: value}
        assert_error(post(server, "/v1/completions", body), 400, field)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": stream}
    assert_error(post(server, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}), 400,
                 "top_logprobs")
    assert_error(post(server, "/v1/chat/completions", {**chat, "messages": [{"role": "r" * 2000, "content": "x"}]}),
                 400, "messages.0.role")
    assert_still_serving(server)


def test_values_at_the_bounds_are_served(server):
    for extra in [{"top_k": VOCAB}, {"top_k": -1}, {"top_k": 0}, {"seed": 2**63 - 1}, {"seed": -(2**63)},
                  {"n": MAX_NUM_SEQS}, {"stop": ["z" * MAX_STOP_CHARS] * MAX_STOP},
                  {"stop_token_ids": list(range(MAX_STOP))}]:
        response = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0.7, **extra})
        assert response.status_code == 200, (extra, response.text)
    assert_still_serving(server)


def test_an_unknown_field_is_a_400_naming_it(server):
    """Issue 21: a field no API defines is refused by its path, at the top level or nested, never ignored."""
    error = assert_error(post(server, "/v1/completions", {**GREEDY, "best_of_everything": {"nested": [1, 2]}}), 400,
                         "best_of_everything")
    assert error["message"].startswith("best_of_everything: unrecognized request field")
    chat = {"messages": [{"role": "user", "content": "Hi", "mood": "sunny"}], "max_tokens": 2}
    assert_error(post(server, "/v1/chat/completions", chat), 400, "messages.0.mood")
    assert_still_serving(server)


@pytest.mark.parametrize("route,field,value", [
    ("/v1/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("/v1/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "tool_choice", "required"),  # served, but with no `tools` it asks for nothing known
    ("/v1/completions", "logit_bias", {"50256": -100}),
    ("/v1/completions", "best_of", 3),
])
def test_a_set_field_the_server_does_not_implement_is_a_400_naming_it(server, route, field, value):
    """A client that sets logit_bias (or tools where there are none: completions) expects its effect: refused by
    name, never silently dropped. Structured output and chat tools are served (test_structured_output.py,
    test_tools.py)."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2} if "chat" in route else dict(GREEDY)
    assert_error(post(server, route, {**body, field: value}), 400, field)
    asking_nothing = {"tools": [], "tool_choice": "none", "logit_bias": {}, "best_of": 1}[field]
    assert post(server, route, {**body, field: asking_nothing}).status_code == 200


# ---- bodies: size, nesting, bad JSON, bad Unicode ---------------------------------------------------------------


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(server):
    big = {"prompt": "a" * (MAX_REQUEST_BYTES + 1), "max_tokens": 2}
    error = assert_error(post(server, "/v1/completions", big), 413)
    assert error["type"] == "RequestTooLargeError" and str(MAX_REQUEST_BYTES) in error["message"]
    chunks = (b"x" * (1 << 16) for _ in range(MAX_REQUEST_BYTES // (1 << 16) + 2))  # no Content-Length: chunked
    assert_error(server.http.post("/v1/completions", content=chunks), 413)
    assert_error(server.http.post("/tokenize", content=json.dumps(big).encode()), 413)
    assert_still_serving(server)


def test_nesting_and_bad_json_are_400s(server):
    deep = b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    assert "nested too deeply" in assert_error(post(server, "/v1/completions", deep), 400)["message"]
    nested = {"prompt": "Hi", "max_tokens": 2, "extra": json.loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)}
    assert "nested too deeply" in assert_error(post(server, "/v1/completions", nested), 400, "extra")["message"]
    shallow = {**nested, "extra": json.loads("[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1))}
    # within the depth limit: refused for what it is, a field the API does not define
    assert "unrecognized request field" in assert_error(post(server, "/v1/completions", shallow), 400, "extra")["message"]
    for raw in [b"", b"{not json", b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": 1e999}',
                b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", b'{"prompt": "\xff\xfe"}', b"[1, 2]", b"null"]:
        assert_error(post(server, "/v1/completions", raw), 400)
    assert_still_serving(server)


def test_lone_surrogates_anywhere_are_400s(server):
    chat = {"messages": [{"role": "user", "content": "\ud800"}]}
    for path, body, param in [
        ("/v1/completions", {"prompt": "\ud800 hi"}, "prompt"),
        ("/v1/completions", {"prompt": ["fine", "\udfff"]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "model": "\ud800"}, "model"),
        ("/v1/completions", {"prompt": "x", "stop": ["\ud800"]}, "stop"),
        ("/v1/completions", {"prompt": "x", "\ud800": 1}, None),
        ("/v1/chat/completions", chat, "messages"),
        ("/v1/chat/completions", {**chat, "model": "\ud800", "stream": True}, "messages"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"messages": chat["messages"]}, "messages"),
        ("/detokenize", {"tokens": [1], "model": "\udc00"}, "model"),
    ]:
        error = assert_error(post(server, path, body), 400, param)
        assert "lone surrogate" in error["message"]
    paired = post(server, "/v1/completions", {"prompt": "\ud83d\ude00", "max_tokens": 2})  # an escaped emoji: fine
    assert paired.status_code == 200
    assert_still_serving(server)


def test_tokenize_and_detokenize_need_the_api_key(server):
    for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})]:
        assert_error(httpx.post(server.base + path, json=body), 401)
        assert server.http.post(path, json=body).status_code == 200
    assert httpx.get(server.base + "/health").status_code == 200  # still open, as /metrics and /version
    assert httpx.get(server.base + "/metrics").status_code == 200


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server):
    """A prompt of megabytes takes seconds to tokenize: meanwhile other clients are served."""
    words = " ".join(f"w{i}" for i in range(450_000))  # 3.5 MB, under the body limit
    done: dict[str, float] = {}
    result: dict[str, httpx.Response] = {}

    def huge() -> None:
        result["huge"] = post(server, "/v1/completions", {"prompt": words, "max_tokens": 2})
        done["huge"] = time.monotonic()

    thread = threading.Thread(target=huge)
    thread.start()
    time.sleep(0.3)
    assert server.greedy_text() == server.reference
    done["small"] = time.monotonic()
    thread.join(timeout=120)
    assert done["small"] < done["huge"]
    assert "maximum context length" in assert_error(result["huge"], 400, "max_tokens")["message"]


# ---- a fuzz of malformed requests -------------------------------------------------------------------------------


FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "n", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "echo", "stream", "stream_options",
          "skip_special_tokens", "user", "suffix", "add_generation_prompt", "continue_final_message",
          "chat_template_kwargs", "return_tokens_as_token_ids", "tokens", "add_special_tokens"]
VALUES = [None, True, False, 0, -1, 1, 3, 2**63, -(2**63) - 1, 10**30, -(10**30), 0.5, -0.5, 1e308, 1e-308, "", "x",
          "\ud800", "\udfff\ud800", "a" * 3000, [], [1], [VOCAB], [-1], ["a"], [[1, 2]], [[]], [None], {}, {"a": 1},
          {"include_usage": "yes"}, {"include_usage": True}, ["s"] * (MAX_STOP + 1),
          [{"role": "user", "content": "hi"}], [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
          [{"role": 5}], [{"content": "no role"}], json.loads("[" * 70 + "]" * 70)]
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
ROUTE_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
BASES = {"/v1/completions": {"prompt": "Hello", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
         "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1, 2]}}


def fuzz_bodies(count: int, seed: int = 20) -> list[tuple[str, bytes]]:
    """Seeded: a valid body per route with 0-3 of its fields set to values of every wrong kind (or an unknown
    field added, a 400 whatever its value), and some bodies corrupted as bytes (truncated, not an object, not
    UTF-8, NaN, nested 2000 deep)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        route = rng.choice(ROUTES)
        body = dict(BASES[route])
        fields = [f for f in FIELDS if f in ROUTE_MODELS[route].model_fields]
        for _ in range(rng.randint(0, 3)):  # 0: the valid body (a field not declared is a 400: no luck in them)
            field = rng.choice(fields) if rng.random() < 0.85 else f"unknown_{rng.randint(0, 99)}"
            body[field] = rng.choice(VALUES)
        raw = json.dumps(body).encode()
        corruption = rng.random()
        if corruption < 0.05:
            raw = raw[: rng.randint(0, len(raw) - 1)]
        elif corruption < 0.08:
            raw = rng.choice([b"[]", b"42", b'"text"', b"null", b"\xc3\x28", b"[" * 2000, b'{"prompt": NaN}'])
        out.append((route, raw))
    return out


def test_fuzz_of_malformed_requests_gets_no_5xx(server):
    statuses = []
    for i, (route, raw) in enumerate(fuzz_bodies(160)):
        response = post(server, route, raw)
        context = f"#{i} {route} {raw[:200]!r}: {response.status_code} {response.text[:300]}"
        assert response.status_code < 500, context
        if response.status_code >= 400:
            assert_error(response, response.status_code)
        elif response.headers["content-type"].startswith("text/event-stream"):
            assert all('"error"' not in p for p in sse_payloads(response)), context  # refusals come before a 200
        statuses.append(response.status_code)
    assert statuses.count(200) >= 10 and statuses.count(400) >= 50, statuses  # it reached both outcomes
    assert_still_serving(server)


# ---- clients that leave ----------------------------------------------------------------------------------------


def metric(text: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"quantkit:{name}{{"))


def test_clients_leaving_mid_stream_free_everything(server):
    clients, leavers = 32, range(0, 32, 5)  # 7 of 32 leave after a few chunks
    outcomes: dict[int, str] = {}

    def client(i: int) -> None:
        body = {"prompt": f"Story {i}:", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.base, headers=AUTH, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json=body) as response:
            events = (line for line in response.iter_lines() if line.startswith("data: "))
            if i in leavers:
                for _ in range(3):
                    next(events)
                outcomes[i] = "left"
                return
            payloads = [e[len("data: "):] for e in events]
            finish = json.loads(payloads[-2])["choices"][0]["finish_reason"]
            outcomes[i] = "done" if payloads[-1] == "[DONE]" and finish == "length" else f"bad: {payloads[-3:]}"

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(outcomes.values()) == ["done"] * (clients - len(leavers)) + ["left"] * len(leavers), outcomes
    deadline = time.monotonic() + 15
    while True:
        text = server.http.get("/metrics").text
        values = [metric(text, name) for name in ("num_requests_running", "num_requests_waiting",
                                                  "kv_cache_usage_perc")]
        if values == [0.0, 0.0, 0.0] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert values == [0.0, 0.0, 0.0]
    assert_still_serving(server)


# ---- a failing step fails its requests, not the engine ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_loaded(tiny_dir):
    import torch

    from quantkit.models.loader import load_model

    return load_model(str(tiny_dir), dtype=torch.float32)


def poisoned() -> ValidRequest:
    """A request past every bound the HTTP API checks (top_k beyond int64): the sampler raises on it."""
    return ValidRequest([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.7, top_k=10**30), 2)


async def collect(front, request_id: str, request: ValidRequest) -> list:
    return [out async for out in front.generate_validated(request_id, request)]


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_a_request_that_breaks_the_sampler_fails_alone(tiny_loaded, process):
    from quantkit.serve.async_engine import RequestFailedError

    with serving_app(tiny_loaded, "tiny", process=process, max_model_len=MAX_MODEL_LEN,
                     kv_cache_memory=KV_BYTES) as app:
        front = app.state.serving.engine
        normal = ValidRequest([5, 6, 7], SamplingParams(max_tokens=6, temperature=0), 6)
        before = asyncio.run(collect(front, "before", normal))[-1].outputs[0].token_ids
        with pytest.raises(RequestFailedError, match="Overflow"):
            asyncio.run(collect(front, "poison", poisoned()))
        assert front.is_running
        assert asyncio.run(collect(front, "after", normal))[-1].outputs[0].token_ids == before
        deadline = time.monotonic() + 10
        while front.stats()["kv_used_blocks"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert front.stats()["kv_used_blocks"] == 0 and front.stats()["num_requests_running"] == 0


class PoisonSampler:
    """The engine's sampler, raising for any batch that holds a request with top_k == POISON_TOP_K."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __call__(self, logits, seqs, generators):
        if any(seq.request.params.top_k == POISON_TOP_K for seq in seqs):
            raise RuntimeError("injected sampler fault")
        return self.sampler(logits, seqs, generators)


def test_a_failing_step_is_a_500_json_error_or_an_error_event(tiny_loaded, monkeypatch):
    with serving_app(tiny_loaded, "tiny", max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_BYTES) as app, \
            live_server(app) as base, httpx.Client(base_url=base, timeout=60) as http:
        reference = http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
        engine = app.state.serving.engine.engine
        engine.sampler = PoisonSampler(engine.sampler)
        poison = {"prompt": "Hello", "max_tokens": 4, "top_k": POISON_TOP_K, "temperature": 0.7}
        error = assert_error(http.post("/v1/completions", json=poison), 500)
        assert error["type"] == "InternalServerError" and "injected sampler fault" in error["message"]
        with http.stream("POST", "/v1/completions", json={**poison, "stream": True}) as response:
            assert response.status_code == 200
            payloads = sse_payloads(response)
        assert json.loads(payloads[-1])["error"]["code"] == 500
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == reference
        with monkeypatch.context() as patch:  # any unexpected exception: a 500 in the OpenAI shape, not plain text
            patch.setattr(tiny_loaded.tokenizer, "decode", lambda *args, **kwargs: 1 / 0)
            error = assert_error(http.post("/detokenize", json={"tokens": [1, 2]}), 500)
        assert error["type"] == "InternalServerError" and "ZeroDivisionError" in error["message"]


def test_guarded_step_spares_the_queue_and_gives_up_on_a_broken_engine(tiny_loaded):
    from quantkit.serve.engine import MAX_FAILED_STEPS
    from quantkit.serve.llm import build_engine

    engine = build_engine(tiny_loaded, max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_BYTES, max_num_seqs=1)
    engine.add_request("poison", poisoned())
    engine.add_request("waiting", ValidRequest([5, 6, 7], SamplingParams(max_tokens=3, temperature=0), 3))
    outputs, failed = engine.guarded_step()
    assert outputs == [] and list(failed) == ["poison"] and "Overflow" in failed["poison"]
    finished = []
    while engine.has_unfinished():
        outputs, failed = engine.guarded_step()
        assert not failed
        finished += [out.request_id for out in outputs if out.finished]
    assert finished == ["waiting"] and engine.block_manager.num_used_blocks == 0
    for i in range(MAX_FAILED_STEPS):
        engine.add_request(f"poison-{i}", poisoned())
    for _ in range(MAX_FAILED_STEPS - 1):
        assert engine.guarded_step()[1]
    with pytest.raises(ValueError, match="Overflow"):
        engine.guarded_step()


# ---- the engine process dies; SIGTERM under load ----------------------------------------------------------------


def engine_pid(server_pid: int) -> int:
    """The engine process `quantkit serve` started (a child of its main thread)."""
    for child in Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split():
        if b"quantkit.serve.engine_process" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise AssertionError("no engine process")


def test_a_killed_engine_makes_the_server_exit_non_zero(tiny_dir, tmp_path):
    with quantkit_serve(tiny_dir, tmp_path, max_model_len=LONG_MODEL_LEN) as served:
        body = {"prompt": "Count:", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with served.http.stream("POST", "/v1/completions", json=body) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            next(lines)
            os.kill(engine_pid(served.proc.pid), signal.SIGKILL)
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["error"]["code"] == 503
        assert served.proc.wait(timeout=15) == 1
        assert "exiting with code 1" in served.log()


def test_sigterm_under_load_ends_every_stream_and_exits_zero(tiny_dir, tmp_path):
    grace = 2.0
    with quantkit_serve(tiny_dir, tmp_path, "--shutdown-timeout", str(grace), max_model_len=LONG_MODEL_LEN) as served:
        streams: dict[int, list[str]] = {}
        started = threading.Barrier(MAX_NUM_SEQS + 1, timeout=60)

        def client(i: int) -> None:  # 6 cannot finish within the grace period, 2 can
            body = {"prompt": f"Tale {i}:", "max_tokens": 4000 if i < 6 else 10, "ignore_eos": True,
                    "stream": True}
            with httpx.Client(base_url=served.base, headers=AUTH, timeout=60) as c, \
                    c.stream("POST", "/v1/completions", json=body) as response:
                events = (line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))
                streams[i] = [next(events)]
                started.wait()
                streams[i] += list(events)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(MAX_NUM_SEQS)]
        for t in threads:
            t.start()
        started.wait()
        served.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert_error(served.http.post("/v1/completions", json=GREEDY), 503)
        assert_error(served.http.get("/health"), 503)
        assert served.proc.wait(timeout=grace + 20) == 0, served.log()[-3000:]
        for t in threads:
            t.join(timeout=10)
        log = served.log()
    for i, payloads in streams.items():
        assert payloads[-1] == "[DONE]", (i, payloads[-3:])
        last = json.loads(payloads[-2])
        if i < 6:
            assert last["error"]["code"] == 503, (i, last)
        else:
            assert last["choices"][0]["finish_reason"] == "length", (i, last)
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert "shut down cleanly" in log

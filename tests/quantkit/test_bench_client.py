"""quantkit bench serve's client against a real OpenAI-style streaming server on 127.0.0.1.

The server below streams one token (" hello", a single token of the bundled tokenizer) per SSE chunk: the first
after FIRST_S, then one every GAP_S, and stamps every write with time.perf_counter() (the same monotonic clock as
the client, same process), so client timings are checked against when the bytes were really written.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from quantkit.benchmark.client import BenchRun, RequestRecord, arrival_times, run_benchmark
from quantkit.benchmark.datasets import BenchPrompt, load_prompts
from quantkit.benchmark.metrics import compute_metrics, format_result, parse_goodput, result_json
from quantkit.errors import QuantkitError

FIRST_S = 0.12
GAP_S = 0.04
BATCH_COST_S = 0.02
TOKEN = " hello"


class StreamServer:
    """A deterministic OpenAI-compatible server: /v1/models, /v1/completions, /v1/chat/completions (stream only)."""

    def __init__(self, send_usage: bool = True, batch_cost_s: float = 0.0):
        self.send_usage = send_usage
        self.batch_cost_s = batch_cost_s  # when set, a "batching" server: token gap = batch_cost_s x in-flight^2
        self.writes: dict[str, list[float]] = {}  # prompt -> perf_counter of each token chunk written
        self.inflight = 0
        self.max_inflight = 0
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.complete)
        self.app.post("/v1/chat/completions")(self.complete)

    async def models(self):
        from quantkit.models.loader import bundled_model_dir

        return {"object": "list", "data": [{"id": "stream-test", "object": "model", "root": str(bundled_model_dir())}]}

    async def complete(self, request: Request):
        body = await request.json()
        if body["model"] != "stream-test":
            return JSONResponse({"error": {"message": f"The model `{body['model']}` does not exist.",
                                           "type": "NotFoundError", "param": None, "code": 404}}, status_code=404)
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        n = body["max_tokens"]
        include_usage = self.send_usage and (body.get("stream_options") or {}).get("include_usage")

        def event(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        def choice(text, finish=None):
            if chat:
                return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text} if text else {},
                                                                       "finish_reason": finish}]}
            return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}

        async def stream():
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            times = self.writes.setdefault(prompt, [])
            try:
                if chat:  # role-only chunk before any token: must not count as the first token
                    yield event({"object": "chat.completion.chunk",
                                 "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
                if prompt == "fail-midway":
                    await asyncio.sleep(FIRST_S)
                    yield event({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
                    yield "data: [DONE]\n\n"
                    return
                for i in range(n):
                    gap = self.batch_cost_s * self.inflight ** 2 if self.batch_cost_s else GAP_S
                    await asyncio.sleep(FIRST_S if i == 0 else gap)
                    times.append(time.perf_counter())
                    yield event(choice(TOKEN))
                yield event(choice("", "length"))
                if include_usage:
                    yield event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                                          "total_tokens": 7 + n}})
                yield "data: [DONE]\n\n"
            finally:
                self.inflight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def tokenizer():
    from quantkit.models.loader import load_tokenizer

    return load_tokenizer(None)


@contextmanager
def running(server: StreamServer):
    """Serve `server` with uvicorn on a free 127.0.0.1 port in a thread; yields (server, base URL)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not uv.started:
        assert time.time() < deadline, "test server did not start"
        time.sleep(0.02)
    try:
        yield server, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def live():
    with running(StreamServer(send_usage=True)) as pair:
        yield pair


@pytest.fixture(scope="module")
def live_batching():
    with running(StreamServer(batch_cost_s=BATCH_COST_S)) as pair:
        yield pair


@pytest.fixture(scope="module")
def live_no_usage():
    with running(StreamServer(send_usage=False)) as pair:
        yield pair


def prompts(n: int, tokens: int, prefix: str = "req", chat: bool = True) -> list[BenchPrompt]:
    if not chat:
        return [BenchPrompt(f"{prefix}-{i}", tokens, text=f"{prefix}-{i}") for i in range(n)]
    return [BenchPrompt(f"{prefix}-{i}", tokens, messages=[{"role": "user", "content": f"{prefix}-{i}"}]) for i in range(n)]


def check_against_server(rec: RequestRecord, run: BenchRun, server: StreamServer, content: str, n: int):
    writes = server.writes[content]
    assert len(writes) == len(rec.chunk_s) == n
    # every chunk is seen after the server wrote it (same monotonic clock), and the stream is read as it comes:
    # the first token is seen before the last is written ((n - 1) x GAP_S later)
    assert all(run.start_perf + seen >= wrote for seen, wrote in zip(rec.chunk_s, writes))
    assert run.start_perf + rec.chunk_s[0] < writes[-1]
    # the first token cannot arrive before the server's FIRST_S of "prefill" after the request was sent
    assert rec.ttft_s >= FIRST_S
    assert rec.latency_s >= FIRST_S + (n - 1) * GAP_S
    # timing arithmetic on the recorded stamps
    assert rec.ttft_s == rec.chunk_s[0] - rec.send_s
    assert rec.itl_s == [b - a for a, b in zip(rec.chunk_s, rec.chunk_s[1:])]
    assert rec.tpot_s == (rec.end_s - rec.send_s - rec.ttft_s) / (n - 1)
    assert rec.end_s >= rec.chunk_s[-1]


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_stream_timings_and_usage(live, tokenizer, endpoint):
    server, url = live
    n = 5
    ps = prompts(3, n, prefix=endpoint.replace("/", "_"), chat=endpoint.endswith("chat/completions"))
    run = run_benchmark(url, ps, tokenizer, "stream-test", endpoint=endpoint)
    assert [r.success for r in run.records] == [True] * 3
    for rec, p in zip(run.records, ps):
        assert rec.tokens_from == "usage" and rec.output_tokens == n and rec.prompt_tokens == 7
        assert rec.text == TOKEN * n
        check_against_server(rec, run, server, p.text or p.messages[0]["content"], n)
    m = compute_metrics(run)
    ok = run.records
    assert m["mean_ttft_ms"] == pytest.approx(np.mean([(r.chunk_s[0] - r.send_s) * 1000 for r in ok]), rel=1e-12)
    assert m["median_itl_ms"] == pytest.approx(
        np.median([(b - a) * 1000 for r in ok for a, b in zip(r.chunk_s, r.chunk_s[1:])]), rel=1e-12)
    assert m["mean_tpot_ms"] == pytest.approx(
        np.mean([(r.end_s - r.chunk_s[0]) / (n - 1) * 1000 for r in ok]), rel=1e-12)
    assert m["total_output_tokens"] == 3 * n and m["total_input_tokens"] == 21
    assert m["output_throughput"] == pytest.approx(3 * n / run.duration_s)


def test_tokenizer_counts_when_server_sends_no_usage(live_no_usage, tokenizer):
    server, url = live_no_usage
    n = 6
    ps = prompts(2, n, prefix="nousage")
    run = run_benchmark(url, ps, tokenizer, "stream-test")
    for rec, p in zip(run.records, ps):
        assert rec.success and rec.tokens_from == "tokenizer"
        assert rec.output_tokens == n  # " hello" is one token of the bundled tokenizer, one per chunk
        templated = tokenizer.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True)
        assert rec.prompt_tokens == len(tokenizer(templated, add_special_tokens=False)["input_ids"])
        check_against_server(rec, run, server, p.messages[0]["content"], n)


def test_concurrency_cap_and_all_at_once(live, tokenizer):
    server, url = live
    server.max_inflight = 0
    run = run_benchmark(url, prompts(6, 3, prefix="cap"), tokenizer, "stream-test", max_concurrency=2)
    assert all(r.success for r in run.records)
    assert server.max_inflight == 2
    # with 2 slots, request i (i >= 2) is sent only after an earlier one finished
    ends = sorted(r.end_s for r in run.records)
    sends = sorted(r.send_s for r in run.records)
    assert all(sends[i] >= ends[i - 2] for i in range(2, 6))
    server.max_inflight = 0
    run = run_benchmark(url, prompts(6, 3, prefix="burst"), tokenizer, "stream-test")
    assert server.max_inflight == 6
    assert max(r.send_s for r in run.records) < FIRST_S  # all sent before any first token could come back


def test_poisson_arrivals(live, tokenizer):
    times = arrival_times(20000, 50.0, seed=3)
    gaps = np.diff(times)
    assert times[0] == 0.0 and gaps.mean() == pytest.approx(1 / 50.0, rel=0.03)
    assert np.std(gaps) == pytest.approx(1 / 50.0, rel=0.05)  # exponential: std = mean
    assert arrival_times(4, float("inf")) == [0.0] * 4
    _, url = live
    run = run_benchmark(url, prompts(5, 2, prefix="poisson"), tokenizer, "stream-test", request_rate=20.0, seed=1)
    expected = arrival_times(5, 20.0, seed=1)
    for rec, arrival in zip(run.records, expected):
        assert rec.arrival_s == arrival and rec.send_s >= arrival  # never sent before its arrival time
    sends = [r.send_s for r in run.records]
    assert sends == sorted(sends)  # sent in arrival order (expected arrivals are increasing)
    with pytest.raises(QuantkitError, match="request-rate"):
        arrival_times(3, 0.0)


def test_failures_are_recorded_not_raised(live, tokenizer):
    _, url = live
    bad_model = run_benchmark(url, prompts(1, 2, prefix="bad"), tokenizer, "no-such-model")
    rec = bad_model.records[0]
    assert not rec.success and rec.error.startswith("HTTP 404") and "does not exist" in rec.error
    midway = run_benchmark(url, [BenchPrompt("x", 4, messages=[{"role": "user", "content": "fail-midway"}])],
                           tokenizer, "stream-test")
    assert not midway.records[0].success and "engine died" in midway.records[0].error
    m = compute_metrics(midway)
    assert m["completed"] == 0 and m["failed"] == 1 and m["mean_ttft_ms"] == 0.0


def handmade_run() -> BenchRun:
    """Two successes and a failure with round timestamps (s)."""
    r1 = RequestRecord(0, "a", 0.0, send_s=0.0, chunk_s=[0.1, 0.3, 0.6], end_s=0.6, prompt_tokens=10,
                       output_tokens=3, tokens_from="usage", success=True)
    r2 = RequestRecord(1, "b", 0.5, send_s=0.5, chunk_s=[0.7, 0.8], end_s=0.9, prompt_tokens=20,
                       output_tokens=2, tokens_from="usage", success=True)
    r3 = RequestRecord(2, "c", 0.5, send_s=0.5, error="HTTP 500: boom")
    return BenchRun("http://x", "/v1/chat/completions", "m", float("inf"), 4, 2.0, [r1, r2, r3])


def test_result_block_exact():
    """Hand arithmetic: TTFT 100, 200 ms; TPOT (600-100)/2 = 250, (400-200)/1 = 200 ms; ITL 200, 300, 100 ms.
    p99 of two values a<b is a + 0.99 (b - a); of [100, 200, 300] it is 200 + 0.98 * 100 = 298."""
    m = compute_metrics(handmade_run(), parse_goodput(["ttft:150"]))

    def row(label, value):
        return label.ljust(40) + " " + value.ljust(10)

    expected = "\n".join([
        "============ Serving Benchmark Result ============",
        row("Successful requests:", "2"),
        row("Failed requests:", "1"),
        row("Maximum request concurrency:", "4"),
        row("Benchmark duration (s):", "2.00"),
        row("Total input tokens:", "30"),
        row("Total generated tokens:", "5"),
        row("Request throughput (req/s):", "1.00"),
        row("Request goodput (req/s):", "0.50"),
        row("Output token throughput (tok/s):", "2.50"),
        row("Total token throughput (tok/s):", "17.50"),
        "---------------Time to First Token----------------",
        row("Mean TTFT (ms):", "150.00"),
        row("Median TTFT (ms):", "150.00"),
        row("P99 TTFT (ms):", "199.00"),
        "-----Time per Output Token (excl. 1st token)------",
        row("Mean TPOT (ms):", "225.00"),
        row("Median TPOT (ms):", "225.00"),
        row("P99 TPOT (ms):", "249.50"),
        "---------------Inter-token Latency----------------",
        row("Mean ITL (ms):", "200.00"),
        row("Median ITL (ms):", "200.00"),
        row("P99 ITL (ms):", "298.00"),
        "==================================================",
    ])
    assert format_result(m) == expected
    data = json.loads(json.dumps(result_json(handmade_run(), m)))  # strict JSON: inf rate written as "inf"
    assert data["metrics"]["request_rate"] == "inf"
    assert data["requests"][0]["itl_s"] == pytest.approx([0.2, 0.3])
    assert data["requests"][2]["error"] == "HTTP 500: boom" and data["requests"][2]["ttft_s"] is None


def test_model_and_tokenizer_from_the_server(live):
    from quantkit.benchmark.client import resolve_model_and_tokenizer
    from quantkit.models.loader import bundled_model_dir

    _, url = live
    model, tok, source = resolve_model_and_tokenizer(url, None, None)
    assert model == "stream-test" and source == str(bundled_model_dir())  # the name does not load; its root does
    assert tok.encode(TOKEN * 3, add_special_tokens=False) == [33662] * 3
    with pytest.raises(QuantkitError, match="cannot reach"):
        resolve_model_and_tokenizer("http://127.0.0.1:9", None, None)


def test_goodput_parsing():
    assert parse_goodput(["ttft:500 tpot:50", "e2el:9000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 9000.0}
    with pytest.raises(QuantkitError, match="KEY:MS"):
        parse_goodput(["latency:5"])


def test_datasets(shared_data, tokenizer, tmp_path):
    share = load_prompts("sharegpt", 5, tokenizer, seed=0)
    assert len(share) == 5 and all(p.output_len == 128 and p.messages[0]["role"] == "user" for p in share)
    assert [p.id for p in share] == [p.id for p in load_prompts("sharegpt", 5, tokenizer, seed=0)]
    alpaca = load_prompts("alpacaeval", 805, tokenizer)
    by_id = {p.id: p for p in alpaca}
    assert by_id["alpaca_eval-000"].output_len == round(312 * 1.35)  # 312 reference words
    assert load_prompts("alpacaeval", 3, tokenizer, max_tokens=64)[0].output_len == 64
    sonnet = load_prompts("sonnet", 3, tokenizer)
    lens = [len(tokenizer.encode(p.text, add_special_tokens=False)) for p in sonnet]
    assert all(450 <= n <= 650 for n in lens), lens  # about 550 tokens
    prefix = sonnet[0].text[:400]
    assert all(p.text.startswith(prefix) for p in sonnet)  # the shared prefix
    rand = load_prompts("random", 2, tokenizer, random_input_len=64)
    assert rand[0].text != rand[1].text
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi", "output_len": 9}\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    rows = load_prompts(str(f), 4, tokenizer, seed=0)
    assert sorted((p.text or p.messages[0]["content"], p.output_len) for p in rows[:2]) == [("hi", 9), ("yo", 128)]
    assert [p.id for p in rows[2:]] == [p.id for p in rows[:2]]  # 4 asked of 2 rows: the shuffled set cycles
    f.write_text('{"prompt": "hi"}\n{"messages": "nope"}\n')
    with pytest.raises(QuantkitError, match=r'p\.jsonl:2: field "messages"'):
        load_prompts(str(f), 1, tokenizer)
    with pytest.raises(QuantkitError, match="--data-dir"):
        load_prompts("sharegpt", 1, tokenizer, data_dir=tmp_path)


def test_tune_finds_the_largest_batch_keeping_the_floor(live_batching, tokenizer, tmp_path):
    """Token gaps of BATCH_COST_S x batch^2: 50 tok/s per user at batch 1, 12.5 at 2, 3.1 at 4: a floor of 6 keeps
    batch 2 (with 2x slack either side for a loaded machine)."""
    import matplotlib.pyplot as plt

    from quantkit.benchmark.charts import draw_tune_charts
    from quantkit.benchmark.tune import format_tune, sweep

    _, url = live_batching
    prompts_file = tmp_path / "p.txt"
    prompts_file.write_text("\n".join(f"tune-{i}" for i in range(16)))
    result = sweep(url, "stream-test", tokenizer, 6.0, str(prompts_file), max_tokens=6, max_batch=16, rounds=1,
                   price_per_hour=3.6)
    steps = result["steps"]
    assert [s["concurrency"] for s in steps] == [1, 2, 4]  # stops at the first step under the floor
    assert [s["meets_floor"] for s in steps] == [True, True, False]
    assert result["recommended_max_num_seqs"] == 2
    for s in steps:
        ideal = 1 / (BATCH_COST_S * s["concurrency"] ** 2)
        assert 0.4 * ideal <= s["per_user_tps"] <= 1.5 * ideal  # the server's pace (a loaded CPU adds jitter)
        assert s["usd_per_million_tokens"] == pytest.approx(3.6 / 3600 / s["aggregate_tps"] * 1e6)
        assert s["aggregate_tps"] == pytest.approx(s["concurrency"] * 6 / s["duration_s"])
    assert "recommended: --max-num-seqs 2" in format_tune(result)
    paths = draw_tune_charts(result, tmp_path / "charts")
    assert [p.name for p in paths] == ["tune_throughput.png", "tune_cost.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert plt.imread(path).shape[:2] == (495, 770)  # 7 x 4.5 inches at 110 dpi

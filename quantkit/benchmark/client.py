"""Async streaming load generator for any OpenAI-compatible server (quantkit, vLLM, llama.cpp).

Arrivals: Poisson at `request_rate` req/s (exponential gaps drawn with `seed`; inf = all at time 0), each request
then waits for one of `max_concurrency` slots; its send time is when it gets the slot.
Timestamps (perf_counter, seconds from benchmark start) per request:
  send_s        the request is written
  chunk_s[i]    the i-th streamed chunk that carries generated text (role-only and finish-only chunks are skipped,
                so a server that sends its role chunk before prefill does not fake a fast TTFT)
  end_s         the last data chunk (text or usage)
TTFT = chunk_s[0] - send_s;  ITL = chunk_s[i+1] - chunk_s[i];  latency = end_s - send_s.
Output tokens come from the stream's usage (stream_options.include_usage) when the server sends it, else from
tokenizing the text; prompt tokens likewise.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from quantkit.benchmark.datasets import BenchPrompt
from quantkit.errors import QuantkitError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


@dataclass
class RequestRecord:
    index: int
    prompt_id: str
    arrival_s: float
    send_s: float = 0.0
    chunk_s: list[float] = field(default_factory=list)
    end_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    tokens_from: str = ""  # "usage" | "tokenizer"
    max_tokens: int = 0
    text: str = ""
    success: bool = False
    error: Optional[str] = None

    @property
    def ttft_s(self) -> Optional[float]:
        return self.chunk_s[0] - self.send_s if self.chunk_s else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def latency_s(self) -> Optional[float]:
        return self.end_s - self.send_s if self.success else None

    @property
    def tpot_s(self) -> Optional[float]:
        """(latency - TTFT) / (output tokens - 1); None for failures and one-token outputs."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ttft_s=self.ttft_s, itl_s=self.itl_s, latency_s=self.latency_s, tpot_s=self.tpot_s)
        return out


@dataclass
class BenchRun:
    url: str
    endpoint: str
    model: str
    request_rate: float
    max_concurrency: Optional[int]
    duration_s: float
    records: list[RequestRecord]
    start_perf: float = 0.0  # time.perf_counter() at benchmark start: the origin of every *_s offset


def arrival_times(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """Offsets (s) of n Poisson arrivals at `request_rate` req/s; the first at 0; all 0 when the rate is inf."""
    if request_rate <= 0:
        raise QuantkitError(f"--request-rate {request_rate}: must be positive (or inf for all at once)")
    if request_rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(request_rate)
    return times


def run_benchmark(
    url: str,
    prompts: list[BenchPrompt],
    tokenizer: Any,
    model: str,
    endpoint: str = "/v1/chat/completions",
    request_rate: float = float("inf"),
    max_concurrency: Optional[int] = None,
    seed: int = 0,
    ignore_eos: bool = False,
    timeout_s: float = 6 * 3600,
    api_key: Optional[str] = None,
) -> BenchRun:
    """Send every prompt (streaming, temperature 0) and time it; never raises for a failed request."""
    if endpoint not in ENDPOINTS:
        raise QuantkitError(f"--endpoint {endpoint}: use one of {', '.join(ENDPOINTS)}")
    if max_concurrency is not None and max_concurrency < 1:
        raise QuantkitError(f"--max-concurrency {max_concurrency}: must be at least 1")
    return asyncio.run(
        _run(url.rstrip("/"), prompts, tokenizer, model, endpoint, request_rate, max_concurrency, seed, ignore_eos,
             timeout_s, api_key)
    )


async def _run(url, prompts, tokenizer, model, endpoint, request_rate, max_concurrency, seed, ignore_eos, timeout_s,
               api_key) -> BenchRun:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(prompts)
    connector = aiohttp.TCPConnector(limit=limit)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    bodies = [_request_body(endpoint, model, p, tokenizer, ignore_eos) for p in prompts]  # built before the clock
    arrivals = arrival_times(len(prompts), request_rate, seed)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        slots = asyncio.Semaphore(limit)
        start = time.perf_counter()

        async def one(i: int, prompt: BenchPrompt) -> RequestRecord:
            rec = RequestRecord(index=i, prompt_id=prompt.id, arrival_s=arrivals[i], max_tokens=prompt.output_len)
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            async with slots:
                await _stream(session, url + endpoint, bodies[i], rec, start)
            return rec

        records = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        duration = time.perf_counter() - start
    for rec, prompt in zip(records, prompts):  # tokenizing after the run keeps it off the timed event loop
        _count_tokens(rec, prompt, tokenizer)
    return BenchRun(url, endpoint, model, request_rate, max_concurrency, duration, list(records), start)


def resolve_model_and_tokenizer(url: str, model: Optional[str], tokenizer: Optional[str],
                                api_key: Optional[str] = None) -> tuple[str, Any, str]:
    """(model name to send, tokenizer, where the tokenizer came from). The model defaults to the server's first
    /v1/models entry; the tokenizer to --tokenizer, else the first of the model name and the entry's `root` (vLLM
    and quantkit put the served folder there) that loads, else the bundled model's."""
    import httpx

    from quantkit.models.loader import load_tokenizer

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30, trust_env=False)
    except httpx.HTTPError as e:
        raise QuantkitError(f"cannot reach {url} ({e}): is the server running?") from None
    entries = (resp.json().get("data") or []) if resp.status_code == 200 else []
    if model is None:
        if not entries:
            raise QuantkitError(f"{url}/v1/models answered HTTP {resp.status_code} without a model: pass --model NAME")
        model = entries[0]["id"]
    if tokenizer is not None:
        return model, load_tokenizer(tokenizer), tokenizer
    roots = [e.get("root") for e in entries if e.get("id") == model and e.get("root")]
    for source in [model, *roots]:
        try:
            return model, load_tokenizer(source), source
        except (QuantkitError, OSError):
            continue
    return model, load_tokenizer(None), "bundled (neither the model name nor its root loads: pass --tokenizer)"


def _request_body(endpoint: str, model: str, prompt: BenchPrompt, tokenizer: Any, ignore_eos: bool) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": prompt.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "/v1/chat/completions":
        body["messages"] = prompt.as_messages()
    else:
        body["prompt"] = prompt.as_text(tokenizer)
    return body


async def _stream(session: Any, url: str, body: dict, rec: RequestRecord, start: float) -> None:
    """POST `body`, read the SSE stream into `rec` (timestamps relative to `start`, text, usage, errors)."""
    import aiohttp

    text: list[str] = []
    rec.send_s = time.perf_counter() - start
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators and ": comment" keep-alives
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                now = time.perf_counter() - start
                chunk = json.loads(payload)
                if "error" in chunk:
                    rec.error = json.dumps(chunk["error"])[:500]
                    return
                piece = _chunk_text(chunk)
                if piece:
                    rec.chunk_s.append(now)
                    text.append(piece)
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens") or 0
                    rec.output_tokens = usage.get("completion_tokens") or 0
                    rec.tokens_from = "usage"
                rec.end_s = now
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return
    rec.text = "".join(text)
    if not rec.chunk_s:
        rec.error = "the stream carried no generated text"
        return
    rec.success = True


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def _count_tokens(rec: RequestRecord, prompt: BenchPrompt, tokenizer: Any) -> None:
    """Fill prompt/output token counts the server's usage did not give, with the model's tokenizer."""
    if rec.tokens_from == "usage" and rec.output_tokens:
        return
    if tokenizer is None:
        raise QuantkitError("the server sent no usage: give --tokenizer so generated tokens can be counted")
    rec.prompt_tokens = len(tokenizer.encode(prompt.as_text(tokenizer), add_special_tokens=False))
    rec.output_tokens = len(tokenizer.encode(rec.text, add_special_tokens=False)) if rec.success else 0
    rec.tokens_from = "tokenizer"

"""Prefix caching: 32 chat requests sharing a 400-token system prompt, with caching on and off (goal: mean TTFT
at least 2x lower with caching on; the hit rate is read from the server's /metrics).

    python bench/prefix_cache.py [--model DIR] [--concurrency 1] [-- extra serve flags]

For each setting a fresh `quantkit serve` process is started; one warm-up request with an unrelated prompt runs
first; then the 32 requests (the system prompt: the first 400 tokens of ../shared/data/sonnet; the user turns:
32 AlpacaEval instructions) are streamed with max_tokens 8 and TTFT is the time to the first content delta.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cold_start import quantkit_command, free_port  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
NUM_REQUESTS = 32
SYSTEM_TOKENS = 400
GOAL = 2.0


def workload(tokenizer) -> tuple[str, list[str]]:
    sonnet = (DATA / "sonnet" / "sonnet.txt").read_text().replace("\r\n", "\n")
    system = tokenizer.decode(tokenizer(sonnet, add_special_tokens=False).input_ids[:SYSTEM_TOKENS])
    with open(DATA / "chat-alpacaeval" / "alpaca_eval_gpt4ref.jsonl") as f:
        rows = [json.loads(line)["messages"][0]["content"] for line in f]
    questions = [q for q in rows if len(q.split()) <= 30][:NUM_REQUESTS]
    return system, questions


def ttft(base: str, system: str | None, question: str) -> float:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        first = None
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def run(model: str | None, caching: bool, concurrency: int, extra: list[str], system: str,
        questions: list[str]) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    cmd = [*quantkit_command(), "serve", *([model] if model else []), "--port", str(port), flag, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`{' '.join(cmd)}` did not come up")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        ttft(base, None, "Say hello.")  # warm-up, no shared prefix
        before = httpx.get(base + "/metrics").text
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            times = list(pool.map(lambda q: ttft(base, system, q), questions))
        after = httpx.get(base + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    def grown(name: str) -> float:
        return metric(after, name) - metric(before, name)

    queries, hits = grown("quantkit:prefix_cache_queries_total"), grown("quantkit:prefix_cache_hits_total")
    return {"mean_ttft_s": statistics.mean(times), "median_ttft_s": statistics.median(times),
            "hit_rate": hits / queries if queries else 0.0, "hits": hits, "queries": queries}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, default=1)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    from quantkit.models.loader import load_tokenizer

    system, questions = workload(load_tokenizer(args.model))
    results = {}
    for caching in (True, False):
        results[caching] = run(args.model, caching, args.concurrency, extra, system, questions)
        r = results[caching]
        print(f"prefix caching {'on ' if caching else 'off'}: mean TTFT {1000 * r['mean_ttft_s']:.1f} ms, "
              f"median {1000 * r['median_ttft_s']:.1f} ms, hit rate {100 * r['hit_rate']:.1f}% "
              f"({r['hits']:.0f} of {r['queries']:.0f} prompt tokens)", flush=True)
    speedup = results[False]["mean_ttft_s"] / results[True]["mean_ttft_s"]
    print(f"{NUM_REQUESTS} requests, {SYSTEM_TOKENS}-token shared system prompt, concurrency {args.concurrency}: "
          f"mean TTFT {speedup:.2f}x lower with caching; goal >= {GOAL:.0f}x: "
          f"{'met' if speedup >= GOAL else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""/metrics under vLLM's names: exact counts after known requests, vLLM's label set and bucket edges.

The exposition is read with prometheus_client's own parser (what scrapers parse it with). The edges below are
vLLM's, as vllm/v1/metrics/loggers.py sets them; the served test runs a real `quantkit serve --metrics-prefix vllm
--pooling mean` process on the bundled model in fp32.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
from prometheus_client.parser import text_string_to_metric_families

from quantkit.serve.metrics import RequestTracker, ServerMetrics
from quantkit.serve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tests.serve.api_live import free_port

VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0]
VLLM_TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0, 7680.0]
VLLM_EDGES = {  # histogram -> its edges in vLLM (token counts: build_1_2_5_buckets(max_model_len))
    "time_to_first_token_seconds": VLLM_TTFT, "inter_token_latency_seconds": VLLM_TPOT,
    "time_per_output_token_seconds": VLLM_TPOT, "request_time_per_output_token_seconds": VLLM_TPOT,
    "e2e_request_latency_seconds": VLLM_REQUEST, "request_queue_time_seconds": VLLM_REQUEST,
    "request_prefill_time_seconds": VLLM_REQUEST, "request_decode_time_seconds": VLLM_REQUEST,
    "request_inference_time_seconds": VLLM_REQUEST,
    "request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100], "request_generation_tokens": [1, 2, 5, 10, 20, 50, 100],
}
MAX_MODEL_LEN = 128
MODEL_NAME = "smollm2-metrics"


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, its labels): value} of an exposition, parsed by prometheus_client."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def histogram(parsed: dict, name: str, labels: dict[str, str]) -> tuple[list[tuple[float, float]], float, float]:
    """([(le, cumulative count)] without +Inf, sum, count) of one histogram."""
    base = frozenset(labels.items())
    buckets = sorted((float(dict(key)["le"]), value) for (sample, key), value in parsed.items()
                     if sample == name + "_bucket" and base <= key)
    assert buckets[-1][0] == float("inf") and buckets[-1][1] == parsed[(name + "_count", base)]
    return buckets[:-1], parsed[(name + "_sum", base)], parsed[(name + "_count", base)]


def finished_output(prompt_len: int, generated: int, scheduled: float, first: float, last: float) -> RequestOutput:
    completion = CompletionOutput(0, "x" * generated, list(range(generated)), None, None, finish_reason="length")
    times = RequestMetrics(arrival_time=scheduled - 0.25, first_scheduled_time=scheduled, first_token_time=first,
                           last_token_time=last, finished_time=last)
    return RequestOutput("r", None, list(range(prompt_len)), None, [completion], True, times)


# ---- the exposition itself -----------------------------------------------------------------------------------


def test_vllm_prefix_has_vllms_labels_edges_and_per_request_times():
    metrics = ServerMetrics("m", {"source": "s"}, MAX_MODEL_LEN, "vllm")
    tracker = RequestTracker(metrics)
    tracker.observe(finished_output(prompt_len=7, generated=5, scheduled=100.0, first=100.5, last=102.5))
    parsed = samples(metrics.render({"kv_cache_usage_perc": 0.25, "num_requests_running": 2}))
    labels = {"model_name": "m", "engine": "0"}
    for (name, key), _ in parsed.items():
        assert name.startswith("vllm:"), name
        assert set(dict(key)) - {"le", "finished_reason", "position", "source"} == set(labels), name
    for name, edges in VLLM_EDGES.items():
        assert [le for le, _ in histogram(parsed, f"vllm:{name}", labels)[0]] == edges, name
    key = frozenset(labels.items())
    assert parsed[("vllm:gpu_cache_usage_perc", key)] == parsed[("vllm:kv_cache_usage_perc", key)] == 0.25
    assert parsed[("vllm:num_requests_running", key)] == 2
    # engine timestamps: prefill 0.5 s, decode 2.0 s, inference 2.5 s, 0.5 s per output token after the first
    for name, value in [("request_prefill_time_seconds", 0.5), ("request_decode_time_seconds", 2.0),
                        ("request_inference_time_seconds", 2.5), ("request_queue_time_seconds", 0.25),
                        ("request_time_per_output_token_seconds", 0.5), ("request_prompt_tokens", 7),
                        ("request_generation_tokens", 5)]:
        buckets, total, count = histogram(parsed, f"vllm:{name}", labels)
        assert (total, count) == (value, 1), name
        assert [c for le, c in buckets] == [float(le >= value) for le, _ in buckets], name


def test_quantkit_prefix_keeps_its_names_and_adds_finer_edges():
    parsed = samples(ServerMetrics("m", {}, MAX_MODEL_LEN).render({}))
    assert all(name.startswith("quantkit:") for name, _ in parsed)
    assert all(dict(key).keys() - {"le", "finished_reason"} == {"model_name"} for _, key in parsed)
    edges = [le for le, _ in histogram(parsed, "quantkit:e2e_request_latency_seconds", {"model_name": "m"})[0]]
    assert edges == sorted({0.01, 0.05, 0.1, *VLLM_REQUEST})
    edges = [le for le, _ in histogram(parsed, "quantkit:inter_token_latency_seconds", {"model_name": "m"})[0]]
    assert edges == sorted({0.001, 0.005, *VLLM_TPOT})


# ---- a real `quantkit serve --metrics-prefix vllm` -----------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "quantkit"), "serve", "--port", str(port),
                             "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory",
                             str(16 << 20), "--served-model-name", MODEL_NAME, "--metrics-prefix", "vllm",
                             "--pooling", "mean"],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not become healthy"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        with httpx.Client(base_url=base, timeout=120) as client:
            yield client
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.slow
def test_counts_after_known_requests_are_exact(server):
    labels = {"model_name": MODEL_NAME, "engine": "0"}
    key = frozenset(labels.items())
    before = samples(server.get("/metrics").text)
    assert before[("vllm:request_prompt_tokens_count", key)] == 0
    prompts = [[1, 2, 3, 4, 5], [10] * 12, [7, 8]]
    for prompt in prompts:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        assert server.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 4
    parsed = samples(server.get("/metrics").text)
    length = frozenset({**labels, "finished_reason": "length"}.items())
    assert parsed[("vllm:request_success_total", length)] == 3
    assert parsed[("vllm:prompt_tokens_total", key)] == sum(map(len, prompts)) == 19
    assert parsed[("vllm:generation_tokens_total", key)] == 12
    assert parsed[("vllm:num_requests_running", key)] == parsed[("vllm:num_requests_waiting", key)] == 0
    assert parsed[("vllm:gpu_cache_usage_perc", key)] == parsed[("vllm:kv_cache_usage_perc", key)] == 0
    buckets, total, count = histogram(parsed, "vllm:request_prompt_tokens", labels)
    assert (total, count) == (19, 3) and buckets == [(1, 0), (2, 1), (5, 2), (10, 2), (20, 3), (50, 3), (100, 3)]
    buckets, total, count = histogram(parsed, "vllm:request_generation_tokens", labels)
    assert (total, count) == (12, 3) and [c for _, c in buckets] == [0, 0, 3, 3, 3, 3, 3]
    per_gap = {"time_per_output_token_seconds": 9, "inter_token_latency_seconds": 9}  # 3 gaps after 4 tokens
    for name in VLLM_EDGES:
        _, total, count = histogram(parsed, f"vllm:{name}", labels)
        assert count == per_gap.get(name, 3), name
    _, prefill, _ = histogram(parsed, "vllm:request_prefill_time_seconds", labels)
    _, decode, _ = histogram(parsed, "vllm:request_decode_time_seconds", labels)
    _, inference, _ = histogram(parsed, "vllm:request_inference_time_seconds", labels)
    assert prefill > 0 and decode > 0 and inference == pytest.approx(prefill + decode, rel=1e-9)


@pytest.mark.slow
def test_pooling_flag_reaches_the_engine(server, bundled_dir):
    from transformers import AutoModel, AutoTokenizer

    reference = AutoModel.from_pretrained(bundled_dir, dtype=torch.float32).eval()
    text = "Mean pooling averages every token's final hidden state."
    ids = AutoTokenizer.from_pretrained(bundled_dir)(text).input_ids
    with torch.no_grad():
        mean = F.normalize(reference(torch.tensor([ids])).last_hidden_state[0].mean(dim=0), dim=-1)
    response = server.post("/v1/embeddings", json={"model": MODEL_NAME, "input": text}).json()
    vector = torch.tensor(response["data"][0]["embedding"])
    assert F.cosine_similarity(vector, mean, dim=0).item() > 0.99999
    assert response["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)}


def test_bad_prefix_is_a_one_line_error():
    result = subprocess.run([str(Path(sys.executable).parent / "quantkit"), "serve", "--metrics-prefix", "prom"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "--metrics-prefix prom: use one of quantkit, vllm" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr

"""Prometheus metrics for /metrics, named as vLLM names them, under the prefix `quantkit:` or `vllm:`.

The text exposition format (version 0.0.4) is written here: counters get a `_total` sample, histograms cumulative
`_bucket{le=...}` samples plus `_sum` and `_count`. Every sample carries `model_name`. With `--metrics-prefix vllm`
the server is a drop-in for vLLM's dashboards: names under `vllm:`, vLLM 0.8+'s label set (`model_name`,
`engine="0"`: one engine core), vLLM's histogram edges exactly (vllm/v1/metrics/loggers.py: a `sum by (le)` over
vLLM servers and this one adds up), and vLLM's deprecated `vllm:gpu_cache_usage_perc` beside
`vllm:kv_cache_usage_perc`. Under `quantkit:` (the default) the edges are vLLM's plus finer ones below vLLM's
smallest (requests here are short).
Gauges and counters are read from `engine.stats()` at scrape time. The per-request histograms are fed by the API
as outputs arrive (RequestTracker): time to first token, inter-token latency and time_per_output_token (vLLM's
older name for the same per-step gaps) and e2e latency are measured at the server, from the request's arrival;
queue, prefill (first scheduled .. first token), decode (first .. last token), inference (first scheduled .. last
token) and request_time_per_output_token (decode / (generated - 1)) come from the engine's timestamps of the
request (RequestMetrics), with its prompt and generation token counts, once it finishes. A request with n > 1
completions is observed once, with the tokens of all n.
"""

from __future__ import annotations

import math
import threading
import time

PREFIXES = ("quantkit", "vllm")

# vLLM's bucket edges (vllm/v1/metrics/loggers.py); token counts use its 1-2-5 series up to max_model_len.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)  # inter-token latency, time per output token
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)  # e2e, queue, prefill, decode, inference time
# quantkit: extra edges below vLLM's smallest
FINER_TPOT = (0.001, 0.005)
FINER_REQUEST = (0.01, 0.05, 0.1)


def token_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    edges, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(edges)
            edges.append(mantissa * scale)
        scale *= 10


def _labels(pairs: dict[str, str]) -> str:
    if not pairs:
        return ""
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Family:
    kind = ""

    def __init__(self, name: str, help_text: str, base_labels: dict[str, str]):
        """name: with its prefix (`vllm:num_requests_running`)."""
        self.name = name
        self.help = help_text
        self.base_labels = base_labels
        self.lock = threading.Lock()

    def header(self, sample_name: str) -> list[str]:
        return [f"# HELP {sample_name} {self.help}", f"# TYPE {sample_name} {self.kind}"]


class Counter(_Family):
    """A cumulative count mirrored from where it is kept (the engine): `set_total`; sampled as `<name>_total`."""

    kind = "counter"
    suffix = "_total"

    def __init__(self, name, help_text, base_labels):
        super().__init__(name, help_text, base_labels)
        self.values: dict[tuple, float] = {}

    def set_total(self, total: float, **labels) -> None:
        with self.lock:
            self.values[tuple(sorted(labels.items()))] = float(total)

    def render(self) -> list[str]:
        sample = self.name + self.suffix
        lines = self.header(sample)
        with self.lock:
            items = list(self.values.items()) or [((), 0.0)]
        for key, value in items:
            lines.append(f"{sample}{_labels({**self.base_labels, **dict(key)})} {_num(value)}")
        return lines


class Gauge(Counter):
    kind = "gauge"
    suffix = ""

    def set(self, value: float, **labels) -> None:
        self.set_total(value, **labels)


class Histogram(_Family):
    kind = "histogram"

    def __init__(self, name, help_text, base_labels, buckets):
        super().__init__(name, help_text, base_labels)
        self.edges = tuple(buckets) + (math.inf,)
        self.counts = [0] * len(self.edges)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        with self.lock:
            for i, edge in enumerate(self.edges):
                if value <= edge:
                    self.counts[i] += 1
                    break
            self.sum += value
            self.count += 1

    def render(self) -> list[str]:
        lines = self.header(self.name)
        with self.lock:
            cumulative = 0
            for edge, n in zip(self.edges, self.counts):
                cumulative += n
                lines.append(f"{self.name}_bucket{_labels({**self.base_labels, 'le': _num(edge)})} {cumulative}")
            lines.append(f"{self.name}_sum{_labels(self.base_labels)} {_num(self.sum)}")
            lines.append(f"{self.name}_count{_labels(self.base_labels)} {self.count}")
        return lines


# engine.stats() key -> (metric name, kind, help). Counters mirror the engine's cumulative totals.
ENGINE_STATS = {
    "num_requests_running": ("num_requests_running", Gauge, "Number of requests in the running batch."),
    "num_requests_waiting": ("num_requests_waiting", Gauge, "Number of requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", Gauge, "KV-cache usage: 1 means 100 percent of blocks in use."),
    "kv_capacity_tokens": ("kv_capacity_tokens", Gauge, "Tokens the preallocated KV-cache pool can hold."),
    "prefix_cache_queries": ("prefix_cache_queries", Counter, "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", Counter, "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("num_preemptions", Counter, "Cumulative number of preempted (recomputed) sequences."),
    "spec_decode_num_drafts": ("spec_decode_num_drafts", Counter, "Speculative decoding: drafting steps."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", Counter, "Speculative decoding: draft tokens."),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", Counter,
                                        "Speculative decoding: accepted draft tokens."),
}
# vllm: names vLLM still exports for an engine stat under an older name
VLLM_ALIASES = {"kv_cache_usage_perc": ("gpu_cache_usage_perc", Gauge,
                                        "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use "
                                        "vllm:kv_cache_usage_perc instead.")}


FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """Every metric of one server under `prefix` (PREFIXES); `render(engine_stats)` is the /metrics body.

    max_model_len: the largest request, the top of the token-count histograms' edges."""

    def __init__(self, model_name: str, info: dict[str, str], max_model_len: int = 2048,
                 prefix: str = "quantkit"):
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix {prefix!r}: use one of {', '.join(PREFIXES)}")
        vllm = prefix == "vllm"
        base = {"model_name": model_name, **({"engine": "0"} if vllm else {})}

        def family(cls, name: str, help_text: str, *args, labels=base):
            return cls(f"{prefix}:{name}", help_text, labels, *args)

        def edges(vllm_edges: tuple, finer: tuple = ()) -> tuple:
            return vllm_edges if vllm else tuple(sorted({*vllm_edges, *finer}))

        stats = [*ENGINE_STATS.items(), *(VLLM_ALIASES.items() if vllm else ())]
        self.engine = [(key, family(cls, name, help_text)) for key, (name, cls, help_text) in stats]
        self.model_info = family(Gauge, "model_info", "Served model and its quantization (value 1).",
                                 labels={**base, **info})
        self.model_info.set(1.0)
        self.prompt_tokens = family(Counter, "prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = family(Counter, "generation_tokens", "Generation tokens processed.")
        self.request_success = family(Counter, "request_success", "Finished requests by finish reason.")
        self.spec_accepted_per_pos = family(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                            "Speculative decoding: accepted draft tokens by draft position.")
        tokens = token_buckets(max_model_len)
        tpot, request = edges(TPOT_BUCKETS, FINER_TPOT), edges(REQUEST_BUCKETS, FINER_REQUEST)
        self.request_prompt_tokens = family(Histogram, "request_prompt_tokens",
                                            "Number of prefill tokens processed, per request.", tokens)
        self.request_generation_tokens = family(Histogram, "request_generation_tokens",
                                                "Number of generation tokens processed, per request.", tokens)
        self.ttft = family(Histogram, "time_to_first_token_seconds", "Time to first token in seconds.",
                           edges(TTFT_BUCKETS))
        self.itl = family(Histogram, "inter_token_latency_seconds", "Inter-token latency in seconds.", tpot)
        self.tpot = family(Histogram, "time_per_output_token_seconds",
                           "Time per output token in seconds (the inter-token latencies: vLLM's older name).", tpot)
        self.request_tpot = family(Histogram, "request_time_per_output_token_seconds",
                                   "Decode time over generated tokens - 1, per request.", tpot)
        self.e2e = family(Histogram, "e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                          request)
        self.queue = family(Histogram, "request_queue_time_seconds", "Time spent waiting before the first schedule.",
                            request)
        self.prefill = family(Histogram, "request_prefill_time_seconds",
                              "Time from the first schedule to the first token, per request.", request)
        self.decode = family(Histogram, "request_decode_time_seconds",
                             "Time from the first token to the last, per request.", request)
        self.inference = family(Histogram, "request_inference_time_seconds",
                                "Time from the first schedule to the last token, per request.", request)

    def families(self) -> list[_Family]:
        return [*(f for _, f in self.engine), self.model_info, self.prompt_tokens, self.generation_tokens,
                self.request_success, self.spec_accepted_per_pos, self.request_prompt_tokens,
                self.request_generation_tokens, self.ttft, self.itl, self.tpot, self.request_tpot, self.e2e,
                self.queue, self.prefill, self.decode, self.inference]

    def update_engine(self, stats: dict) -> None:
        for key, family in self.engine:
            if stats.get(key) is not None:
                family.set_total(float(stats[key]))
        self.prompt_tokens.set_total(stats.get("prompt_tokens", 0))
        self.generation_tokens.set_total(stats.get("generation_tokens", 0))
        finished = stats.get("request_success", {})
        for reason in FINISH_REASONS:
            self.request_success.set_total(finished.get(reason, 0), finished_reason=reason)
        for position, count in stats.get("spec_decode_accepted_per_position", {}).items():
            self.spec_accepted_per_pos.set_total(count, position=str(position))

    def render(self, engine_stats: dict) -> str:
        self.update_engine(engine_stats)
        lines: list[str] = []
        for family in self.families():
            lines.extend(family.render())
        return "\n".join(lines) + "\n"


class RequestTracker:
    """Feeds one engine request's outputs into the per-request histograms."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = time.time()
        self.last_token_time: float | None = None
        self.tokens = 0
        self.done = False

    def observe(self, out) -> None:
        """`out`: the engine's RequestOutput after a step (cumulative)."""
        now = time.time()
        m = self.metrics
        generated = out.num_generated_tokens
        if generated > self.tokens:
            if self.last_token_time is None:
                m.ttft.observe(now - self.arrival)
            else:
                m.itl.observe(now - self.last_token_time)
                m.tpot.observe(now - self.last_token_time)
            self.tokens = generated
            self.last_token_time = now
        if out.finished and not self.done:
            self.done = True
            m.e2e.observe(now - self.arrival)
            m.request_prompt_tokens.observe(len(out.prompt_token_ids))
            m.request_generation_tokens.observe(generated)
            times = out.metrics
            if times.queue_time is not None:
                m.queue.observe(times.queue_time)
            if times.first_token_time is not None and times.first_scheduled_time is not None:
                decode = times.last_token_time - times.first_token_time
                m.prefill.observe(times.first_token_time - times.first_scheduled_time)
                m.decode.observe(decode)
                m.inference.observe(times.last_token_time - times.first_scheduled_time)
                m.request_tpot.observe(decode / (generated - 1) if generated > 1 else 0.0)

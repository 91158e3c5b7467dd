"""Prometheus metrics for /metrics, named as vLLM names them with the prefix `quantkit:`.

The text exposition format (version 0.0.4) is written here: counters get a `_total` sample, histograms cumulative
`_bucket{le=...}` samples plus `_sum` and `_count`, every sample carries `model_name`. Latency histograms
are fed by the API as outputs arrive; gauges and counters are read from `engine.stats()` at scrape time.
"""

from __future__ import annotations

import math
import threading
import time

PREFIX = "quantkit:"

# Bucket edges in seconds (log-spaced from 1 ms to minutes, as vLLM's dashboards expect).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
               20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0)


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
        self.name = PREFIX + name
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


FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """Every `quantkit:` metric of one server; `render(engine_stats)` is the /metrics body."""

    def __init__(self, model_name: str, info: dict[str, str]):
        base = {"model_name": model_name}
        self.engine = {key: cls(name, help_text, base) for key, (name, cls, help_text) in ENGINE_STATS.items()}
        self.model_info = Gauge("model_info", "Served model and its quantization (value 1).", {**base, **info})
        self.model_info.set(1.0)
        self.prompt_tokens = Counter("prompt_tokens", "Prefill tokens processed.", base)
        self.generation_tokens = Counter("generation_tokens", "Generation tokens processed.", base)
        self.request_success = Counter("request_success", "Finished requests by finish reason.", base)
        self.spec_accepted_per_pos = Counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Speculative decoding: accepted draft tokens by draft position.", base)
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token in seconds.", base, TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Inter-token latency in seconds.", base, ITL_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds.", base,
                             REQUEST_BUCKETS)
        self.queue = Histogram("request_queue_time_seconds", "Time spent waiting before the first schedule.", base,
                               REQUEST_BUCKETS)

    def families(self) -> list[_Family]:
        return [*self.engine.values(), self.model_info, self.prompt_tokens, self.generation_tokens,
                self.request_success, self.spec_accepted_per_pos, self.ttft, self.itl, self.e2e, self.queue]

    def update_engine(self, stats: dict) -> None:
        for key, family in self.engine.items():
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
    """Feeds one engine request's outputs into the latency histograms (TTFT, ITL, e2e, queue time)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = time.time()
        self.last_token_time: float | None = None
        self.tokens = 0
        self.done = False

    def observe(self, out) -> None:
        """`out`: the engine's RequestOutput after a step (cumulative)."""
        now = time.time()
        generated = out.num_generated_tokens
        if generated > self.tokens:
            if self.last_token_time is None:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                self.metrics.itl.observe(now - self.last_token_time)
            self.tokens = generated
            self.last_token_time = now
        if out.finished and not self.done:
            self.done = True
            self.metrics.e2e.observe(now - self.arrival)
            queue_time = out.metrics.queue_time
            if queue_time is not None:
                self.metrics.queue.observe(queue_time)

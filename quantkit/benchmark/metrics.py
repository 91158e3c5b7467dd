"""Serving metrics from per-request records, printed as the Serving Benchmark Result block (SERVING.md) and saved
as JSON. Percentiles are numpy's linear interpolation, as vLLM's benchmark computes them.

TTFT and TPOT are per request; ITL pools every gap of every successful request; throughputs divide by the
benchmark duration (first arrival to last response). Goodput counts requests meeting every SLO given (ms).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from quantkit.benchmark.client import BenchRun
from quantkit.errors import QuantkitError

HEADER = "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")
SLO_KEYS = ("ttft", "tpot", "e2el")
_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
)


def parse_goodput(items: Optional[list[str]]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        for part in item.split():
            key, _, value = part.partition(":")
            try:
                ms = float(value)
            except ValueError:
                ms = -1.0
            if key not in SLO_KEYS or ms <= 0:
                raise QuantkitError(f"--goodput {part!r}: expected KEY:MS with KEY one of {', '.join(SLO_KEYS)}, MS > 0")
            slos[key] = ms
    return slos


def compute_metrics(run: BenchRun, goodput: Optional[dict[str, float]] = None) -> dict[str, Any]:
    ok = [r for r in run.records if r.success]
    duration = run.duration_s
    ttft = [r.ttft_s * 1000 for r in ok]
    tpot = [r.tpot_s * 1000 for r in ok if r.tpot_s is not None]
    itl = [gap * 1000 for r in ok for gap in r.itl_s]
    e2el = [r.latency_s * 1000 for r in ok]
    total_input = sum(r.prompt_tokens for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(run.records) - len(ok),
        "max_concurrency": run.max_concurrency,
        "request_rate": run.request_rate if math.isfinite(run.request_rate) else "inf",
        "duration_s": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    if goodput:
        good = sum(1 for r in ok if _meets(r, goodput))
        m["goodput_slos_ms"] = dict(goodput)
        m["request_goodput"] = good / duration
    for key, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        m[f"mean_{key}_ms"] = float(np.mean(values)) if values else 0.0
        m[f"median_{key}_ms"] = float(np.median(values)) if values else 0.0
        m[f"p99_{key}_ms"] = float(np.percentile(values, 99)) if values else 0.0
    return m


def _meets(rec, slos: dict[str, float]) -> bool:
    measured = {"ttft": rec.ttft_s * 1000, "tpot": (rec.tpot_s or 0.0) * 1000, "e2el": rec.latency_s * 1000}
    return all(measured[k] <= ms for k, ms in slos.items())


def format_result(m: dict[str, Any]) -> str:
    """The Serving Benchmark Result block: 40-wide labels, values left-aligned in 10, 2 decimals for floats."""
    def row(label: str, value: Any) -> str:
        return "{:<40} {:<10}".format(label, value) if isinstance(value, (int, str)) else "{:<40} {:<10.2f}".format(label, value)

    cap = m["max_concurrency"]
    lines = [
        HEADER,
        row("Successful requests:", m["completed"]),
        row("Failed requests:", m["failed"]),
        row("Maximum request concurrency:", cap if cap is not None else "unlimited"),
        row("Benchmark duration (s):", m["duration_s"]),
        row("Total input tokens:", m["total_input_tokens"]),
        row("Total generated tokens:", m["total_output_tokens"]),
        row("Request throughput (req/s):", m["request_throughput"]),
    ]
    if "request_goodput" in m:
        lines.append(row("Request goodput (req/s):", m["request_goodput"]))
    lines += [
        row("Output token throughput (tok/s):", m["output_throughput"]),
        row("Total token throughput (tok/s):", m["total_token_throughput"]),
    ]
    for key, short, title in _SECTIONS:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append(row(f"Mean {short} (ms):", m[f"mean_{key}_ms"]))
        lines.append(row(f"Median {short} (ms):", m[f"median_{key}_ms"]))
        lines.append(row(f"P99 {short} (ms):", m[f"p99_{key}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)


def result_json(run: BenchRun, metrics: dict[str, Any], extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    return {
        "url": run.url,
        "endpoint": run.endpoint,
        "model": run.model,
        **(extra or {}),
        "metrics": metrics,
        "requests": [r.to_json() for r in run.records],
    }

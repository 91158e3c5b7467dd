"""`quantkit tune`: sweep concurrency 1, 2, 4, ... against a live server and find the largest batch whose users
still get `min_user_tps` decode tokens/s.

Each step sends rounds x concurrency requests of the data set (all at once, capped at the concurrency, each
generating exactly max_tokens with ignore_eos so the batch stays full). Per-user decode tok/s = 1000 / median TPOT
(the median user; the 10th percentile user, 1000 / P90 TPOT, is reported beside it). Aggregate tok/s = output
tokens / step duration. The sweep stops at the first step below the floor (larger batches only slow users more).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from quantkit.benchmark.client import run_benchmark
from quantkit.benchmark.datasets import load_prompts
from quantkit.benchmark.metrics import compute_metrics
from quantkit.benchmark.plan import batch_sizes, cost_per_million
from quantkit.errors import QuantkitError


def sweep(
    url: str,
    model: str,
    tokenizer: Any,
    min_user_tps: float,
    dataset: str = "sharegpt",
    max_tokens: int = 128,
    max_batch: int = 64,
    rounds: int = 2,
    price_per_hour: Optional[float] = None,
    data_dir: Optional[Path] = None,
    seed: int = 0,
    api_key: Optional[str] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> dict[str, Any]:
    if min_user_tps <= 0 or max_batch < 1 or rounds < 1 or max_tokens < 2:
        raise QuantkitError("tune needs --min-user-tps > 0, --max-batch >= 1, --rounds >= 1 and --max-tokens >= 2")
    levels = batch_sizes(max_batch)
    pool = load_prompts(dataset, max_batch * rounds, tokenizer, max_tokens, data_dir, seed)
    steps = []
    for c in levels:
        run = run_benchmark(url, pool[: c * rounds], tokenizer, model, max_concurrency=c, seed=seed, ignore_eos=True,
                            api_key=api_key)
        m = compute_metrics(run)
        tpots = [r.tpot_s for r in run.records if r.tpot_s]
        step = {
            "concurrency": c,
            "requests": len(run.records),
            "failed": m["failed"],
            "duration_s": m["duration_s"],
            "per_user_tps": 1000 / m["median_tpot_ms"] if m["median_tpot_ms"] > 0 else 0.0,
            "per_user_tps_p10": 1 / float(np.percentile(tpots, 90)) if tpots else 0.0,
            "aggregate_tps": m["output_throughput"],
            "mean_ttft_ms": m["mean_ttft_ms"],
            "median_tpot_ms": m["median_tpot_ms"],
            "p99_tpot_ms": m["p99_tpot_ms"],
        }
        if price_per_hour is not None:
            step["usd_per_million_tokens"] = cost_per_million(price_per_hour, step["aggregate_tps"])
        step["meets_floor"] = step["failed"] == 0 and step["per_user_tps"] >= min_user_tps
        steps.append(step)
        if progress is not None:
            progress(format_step(step))
        if not step["meets_floor"]:
            break
    good = [s for s in steps if s["meets_floor"]]
    return {
        "url": url,
        "model": model,
        "dataset": dataset,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "min_user_tps": min_user_tps,
        "price_per_hour": price_per_hour,
        "steps": steps,
        "recommended_max_num_seqs": good[-1]["concurrency"] if good else None,
    }


def format_step(s: dict[str, Any]) -> str:
    cost = f"  ${s['usd_per_million_tokens']:.3f}/M" if "usd_per_million_tokens" in s else ""
    return (f"batch {s['concurrency']:>4}: {s['per_user_tps']:8.1f} tok/s/user (p10 {s['per_user_tps_p10']:.1f}), "
            f"{s['aggregate_tps']:8.1f} tok/s total, TTFT {s['mean_ttft_ms']:.0f} ms{cost}"
            + ("" if s["meets_floor"] else "  <- below the floor" if not s["failed"] else f"  <- {s['failed']} failed"))


def format_tune(result: dict[str, Any]) -> str:
    """The verdict (the per-step lines are printed as the sweep runs)."""
    rec = result["recommended_max_num_seqs"]
    if rec is None:
        return (f"no batch size keeps {result['min_user_tps']:g} tok/s per user, not even 1: lower the floor, "
                "quantize, or use a faster machine")
    best = next(s for s in result["steps"] if s["concurrency"] == rec)
    cost = (f", ${best['usd_per_million_tokens']:.3f} per million output tokens at ${result['price_per_hour']:g}/hour"
            if "usd_per_million_tokens" in best else "")
    return (f"recommended: --max-num-seqs {rec} ({best['per_user_tps']:.1f} tok/s per user >= "
            f"{result['min_user_tps']:g}, {best['aggregate_tps']:.1f} tok/s total{cost})")

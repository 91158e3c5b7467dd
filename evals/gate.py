"""--max-delta gate: `acc=-1.0` (points), `ppl=+3%` (relative), `kl=0.05` (absolute). A name matches that metric in
every task (`acc`) or one task's (`arc_easy/acc`). Direction comes from the metric: higher-is-better metrics breach
when the delta falls below the limit, lower-is-better ones when it rises above it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from quantkit.errors import QuantkitError

ALIASES = {"kl": "kl_mean", "agree": "top1_agree", "agreement": "top1_agree"}


@dataclass(frozen=True)
class Threshold:
    metric: str  # "acc" or "task/acc"
    limit: float
    relative: bool  # limit in percent of the baseline value

    def text(self) -> str:
        return f"{self.limit:+g}{'%' if self.relative else ''}"


@dataclass(frozen=True)
class Breach:
    name: str  # task/metric
    delta: float
    threshold: Threshold
    unit: str

    def message(self) -> str:
        unit = "%" if self.threshold.relative else f" {self.unit}" if self.unit else ""
        by = abs(self.delta - self.threshold.limit)
        return (f"{self.name}: delta {self.delta:+.4g}{unit} breaches the limit {self.threshold.text()}"
                f"{'' if self.threshold.relative else unit} by {by:.4g}{unit}")


def parse_threshold(spec: str, where: str = "--max-delta") -> Threshold:
    name, sep, value = spec.partition("=")
    name, value = name.strip(), value.strip()
    relative = value.endswith("%")
    try:
        limit = float(value[:-1] if relative else value)
    except ValueError:
        limit = None
    if not sep or not name or limit is None:
        raise QuantkitError(f"{where} {spec!r}: expected METRIC=VALUE such as acc=-1.0, ppl=+3% or kl=0.05")
    task, _, metric = name.rpartition("/")
    metric = ALIASES.get(metric, metric)
    return Threshold(f"{task}/{metric}" if task else metric, limit, relative)


def thresholds_from_mapping(mapping: dict, where: str) -> list[Threshold]:
    """A recipe's `max_delta: {acc: -1.0, ppl: "+3%"}`."""
    if not isinstance(mapping, dict):
        raise QuantkitError(f'{where}: field "max_delta": expected a mapping such as {{acc: -1.0, ppl: "+3%"}}')
    return [parse_threshold(f"{k}={v}", f"{where}: max_delta") for k, v in mapping.items()]


def check(thresholds: Sequence[Threshold], metrics: Iterable) -> tuple[list[Breach], list[Threshold]]:
    """metrics: report MetricResults. Returns (breaches, thresholds that matched no measured metric)."""
    metrics = list(metrics)
    breaches, unmatched = [], []
    for t in thresholds:
        matched = [m for m in metrics if t.metric in (m.metric, f"{m.task}/{m.metric}")]
        if not matched:
            unmatched.append(t)
        for m in matched:
            if t.relative and m.delta_pct is None:
                raise QuantkitError(f"--max-delta {t.metric}={t.text()}: {m.task}/{m.metric} has no relative delta "
                                    f"(its baseline is 0): give an absolute limit")
            delta = m.delta_pct.value if t.relative else m.delta.value
            if (delta < t.limit) if m.higher_is_better else (delta > t.limit):
                breaches.append(Breach(f"{m.task}/{m.metric}", delta, t, m.unit))
    return breaches, unmatched

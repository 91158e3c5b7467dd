"""The eval report: one MetricResult per (task, metric), printed as a rich table and written as report.json,
report.md and deltas.png (each delta with its 95% paired-bootstrap interval). Writes are atomic."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from quantkit.evals.bootstrap import Interval, interval_text


@dataclass
class MetricResult:
    task: str
    metric: str
    baseline: float
    candidate: float
    delta: Interval  # candidate - baseline, in `unit`
    delta_pct: Optional[Interval]  # 100 * (candidate / baseline - 1); None when the baseline is 0
    higher_is_better: bool
    unit: str  # "points" (percent scale), "nats", "" (perplexity)
    n: int  # bootstrap units (rows, windows)
    note: str = ""  # e.g. "L=512, 40 windows"


@dataclass
class Report:
    candidate: str
    baseline: str
    metrics: list[MetricResult] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    seconds: float = 0.0
    gate: dict = field(default_factory=dict)  # {"thresholds": [...], "breaches": [...], "unchecked": [...]}
    warnings: list[str] = field(default_factory=list)  # e.g. data and general-text deltas of opposite signs

    def to_json(self) -> dict:
        return asdict(self)


def _fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.3e}"


def _delta_text(m: MetricResult) -> str:
    d = m.delta
    text = interval_text(d.value, d.low, d.high)
    if m.delta_pct is not None and m.unit == "":
        p = m.delta_pct
        text += f" ({interval_text(p.value, p.low, p.high, '.2f', '%')})"
    return text


def print_table(report: Report, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report.candidate} vs {report.baseline}")
    for col in ("task", "metric", "baseline", "candidate", "delta [95% CI]", "unit", "n"):
        table.add_column(col, justify="left" if col in ("task", "metric") else "right")
    breached = {b["name"] for b in report.gate.get("breaches", [])}
    for m in report.metrics:
        style = "red" if f"{m.task}/{m.metric}" in breached else None
        table.add_row(m.task, m.metric, _fmt(m.baseline), _fmt(m.candidate), _delta_text(m), m.unit, str(m.n),
                      style=style)
    (console or Console()).print(table)


def markdown(report: Report) -> str:
    lines = [f"# quantkit eval: `{report.candidate}` vs `{report.baseline}`", "",
             "| task | metric | baseline | candidate | delta [95% CI] | unit | n | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for m in report.metrics:
        lines.append(f"| {m.task} | {m.metric} | {_fmt(m.baseline)} | {_fmt(m.candidate)} | {_delta_text(m)} | "
                     f"{m.unit} | {m.n} | {m.note} |")
    gate = report.gate
    if gate.get("thresholds"):
        lines += ["", f"Gate ({', '.join(gate['thresholds'])}): "
                  + ("**FAIL**" if gate["breaches"] else "pass")]
        lines += [f"- {b['message']}" for b in gate["breaches"]]
        lines += [f"- not measured: {t}" for t in gate.get("unchecked", [])]
    if report.warnings:
        lines += [""] + [f"- **{w}**" for w in report.warnings]
    lines += ["", f"Settings: {json.dumps(report.settings)}; {report.seconds:.0f} s.", ""]
    return "\n".join(lines)


def chart(report: Report, path: Path) -> None:
    """Horizontal bars of each delta with its interval, one panel per unit (points, %, nats)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[str, list[tuple[str, Interval]]] = {}
    for m in report.metrics:
        if m.unit == "" and m.delta_pct is not None:  # perplexity: relative change reads across models
            panels.setdefault("% change", []).append((f"{m.task}/{m.metric}", m.delta_pct))
        else:
            panels.setdefault(m.unit or "delta", []).append((f"{m.task}/{m.metric}", m.delta))
    fig, axes = plt.subplots(len(panels) or 1, 1, figsize=(8, 1.2 + 0.45 * len(report.metrics) + len(panels)),
                             squeeze=False)
    for ax, (unit, items) in zip(axes[:, 0], panels.items()):
        names = [n for n, _ in items]
        values = [iv.value for _, iv in items]
        err = [[0.0 if iv.low is None else iv.value - iv.low for _, iv in items],
               [0.0 if iv.high is None else iv.high - iv.value for _, iv in items]]
        ax.barh(range(len(items)), values, xerr=err, color="#4c72b0", ecolor="black", capsize=3)
        ax.set_yticks(range(len(items)), names)
        ax.axvline(0, color="gray", linewidth=0.8)
        ax.set_xlabel(f"candidate - baseline ({unit})")
        ax.invert_yaxis()
    fig.suptitle("accuracy delta with 95% paired-bootstrap intervals", fontsize=10)
    fig.tight_layout()
    _atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


def write(report: Report, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json", "md": out_dir / "report.md", "png": out_dir / "deltas.png"}
    _atomic(paths["json"], lambda tmp: Path(tmp).write_text(json.dumps(report.to_json(), indent=2) + "\n"))
    _atomic(paths["md"], lambda tmp: Path(tmp).write_text(markdown(report)))
    chart(report, paths["png"])
    return paths


def _atomic(path: Path, write_to) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write_to(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

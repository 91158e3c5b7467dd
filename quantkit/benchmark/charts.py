"""PNG charts of a tune sweep (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def draw_tune_charts(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """tune_throughput.png (per-user and aggregate tok/s against batch) and, with a price, tune_cost.png
    ($ per million output tokens against batch). Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = result["steps"]
    batch = [s["concurrency"] for s in steps]
    rec = result["recommended_max_num_seqs"]
    title = f"{Path(str(result['model'])).name} at {result['url']}"
    written = []

    fig, left = plt.subplots(figsize=(7, 4.5))
    left.plot(batch, [s["per_user_tps"] for s in steps], "o-", color="tab:blue", label="per user (median)")
    left.axhline(result["min_user_tps"], color="tab:blue", linestyle=":", label=f"floor {result['min_user_tps']:g}")
    _batch_axis(left, batch)
    left.set_xlabel("concurrent requests (batch)")
    left.set_ylabel("decode tokens/s per user", color="tab:blue")
    right = left.twinx()
    right.plot(batch, [s["aggregate_tps"] for s in steps], "s-", color="tab:orange", label="aggregate")
    right.set_ylabel("output tokens/s, all users", color="tab:orange")
    if rec is not None:
        left.axvline(rec, color="gray", linestyle="--", label=f"recommended {rec}")
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    left.legend(handles, [h.get_label() for h in handles], loc="center left")
    left.set_title(title, fontsize=9)
    fig.tight_layout()
    written.append(_save(fig, out_dir / "tune_throughput.png"))
    plt.close(fig)

    if result.get("price_per_hour") is not None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.plot(batch, [s["usd_per_million_tokens"] for s in steps], "o-", color="tab:green")
        _batch_axis(ax, batch)
        ax.set_xlabel("concurrent requests (batch)")
        ax.set_ylabel(f"USD per million output tokens at {result['price_per_hour']:g} USD/hour")
        if rec is not None:
            ax.axvline(rec, color="gray", linestyle="--", label=f"recommended {rec}")
            ax.legend()
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        written.append(_save(fig, out_dir / "tune_cost.png"))
        plt.close(fig)
    return written


def _batch_axis(ax: Any, batch: list[int]) -> None:
    """Log2 x axis ticked at the swept batch sizes, labelled as plain numbers."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch, [str(b) for b in batch])
    ax.minorticks_off()


def _save(fig: Any, path: Path) -> Path:
    """Atomic: render to a temp name in the same folder, then rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=110, format="png")
    tmp.replace(path)
    return path

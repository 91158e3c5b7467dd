"""`quantkit info DIR`: what a quantized checkpoint holds (scheme, layout, per-layer table, sizes, provenance) and
which runtimes load it (the rules of quantkit/formats/compatibility.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer

_LAYER = re.compile(r"^(?P<prefix>.*\.layers)\.(?P<index>\d+)\.(?P<module>.+)$")
_META_SHOWN_ELSEWHERE = ("files", "scheme", "layout", "quantkit_version")


def register(app: typer.Typer) -> None:
    app.command(name="info")(info)


def info(folder: Path = typer.Argument(..., help="A quantized checkpoint folder (quantkit, GPTQ, AWQ or compressed-tensors)")) -> None:
    """Scheme, layout, per-layer bits and group size, size on disk and bytes saved vs FP16 (checksums verified), and
    whether vLLM, transformers, TGI and SGLang load it."""
    from rich.console import Console
    from rich.table import Table

    from quantkit.formats.checkpoint import read_quantized

    q = read_quantized(folder)
    console = Console(width=110)
    summary = checkpoint_summary(folder, q)
    console.print(f"[bold]{folder}[/bold]")
    method = (q.hf_config.get("quantization_config") or {}).get("quant_method", "?")
    console.print(f"layout         {q.layout} (quant_method {method})")
    console.print(f"scheme         {summary['scheme']}")
    console.print(f"quantized      {len(q.qlinears)} Linear layers, {summary['quantized_params']:,} weights")

    table = Table(title="quantized layers")
    for column in ("module", "layers", "out x in", "bits", "group size", "sym", "act-order"):
        table.add_column(column)
    for row in layer_rows(q.qlinears):
        table.add_row(*row)
    console.print(table)

    console.print(f"size on disk   {_human(summary['disk_bytes'])} ({summary['disk_bytes']:,} bytes, all files)")
    console.print(f"weights        {_human(summary['weight_bytes'])} in safetensors vs {_human(summary['fp16_bytes'])} "
                  f"as FP16: {_human(summary['saved_bytes'])} saved ({summary['fp16_bytes'] / summary['weight_bytes']:.2f}x smaller)")
    if q.meta:
        console.print(f"quantkit       {q.meta.get('quantkit_version', '?')}, {len(q.meta.get('files', {}))} files checksummed (verified)")
        for key, value in q.meta.items():
            if key not in _META_SHOWN_ELSEWHERE:
                console.print(f"{key:<14} {_short(value)}", markup=False)
    for line in runtime_lines(q):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def checkpoints(q) -> list:
    """The compatibility facts of a read folder, one per distinct scheme among its Linears (quantkit writes one)."""
    from quantkit.formats.compatibility import Checkpoint

    moe = any(".experts." in name for name in q.qlinears)
    facts = {Checkpoint(q.layout, qt.bits, qt.group_size, qt.sym, qt.g_idx is not None, moe)
             for qt, _ in q.qlinears.values()}
    return sorted(facts, key=lambda ck: (ck.bits, ck.group_size, ck.sym, ck.act_order))


def runtime_lines(q) -> list[str]:
    """Per scheme a header and one line per runtime: name, yes / no / unknown, the reason, [its source]."""
    from quantkit.formats.compatibility import compatibility, describe

    lines = []
    for ck in checkpoints(q):
        lines.append(f"runtimes       {ck.layout} {describe(ck)} (rules: quantkit/formats/compatibility.py)")
        for v in compatibility(ck):
            lines.append(f"  {v.runtime:<13} {v.verdict:<8} {v.reason}" + (f" [{v.source}]" if v.source else ""))
    return lines


def checkpoint_summary(folder: Path, q) -> dict:
    """Sizes (bytes) and scheme of a read checkpoint; FP16 size counts 2 bytes per weight of every tensor."""
    folder = Path(folder)
    quantized_params = sum(qt.codes.numel() for qt, _ in q.qlinears.values())
    other_params = sum(t.numel() for t in q.float_tensors.values()) + sum(
        b.numel() for _, b in q.qlinears.values() if b is not None)
    weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    fp16_bytes = 2 * (quantized_params + other_params)
    schemes = sorted({_scheme_name(qt) for qt, _ in q.qlinears.values()})
    return {
        "scheme": ", ".join(schemes),
        "quantized_params": quantized_params,
        "disk_bytes": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()),
        "weight_bytes": weight_bytes,
        "fp16_bytes": fp16_bytes,
        "saved_bytes": fp16_bytes - weight_bytes,
    }


def layer_rows(qlinears: dict) -> list[tuple[str, ...]]:
    """One row per (module within a block, shape, scheme), with the block indices it covers compressed to ranges."""
    rows: dict[tuple, list[int]] = {}
    for name, (qt, _) in qlinears.items():
        m = _LAYER.match(name)
        module, index = (m["module"], int(m["index"])) if m else (name, -1)
        n, k = qt.shape
        key = (module, f"{n} x {k}", str(qt.bits), "per-channel" if qt.group_size == -1 else str(qt.group_size),
               "yes" if qt.sym else "no", "yes" if qt.g_idx is not None else "no")
        rows.setdefault(key, []).append(index)
    return [(key[0], _ranges(indices), *key[1:]) for key, indices in sorted(rows.items(), key=lambda kv: (min(kv[1]), kv[0]))]


def _scheme_name(qt) -> str:
    from quantkit.config import QuantScheme

    return QuantScheme(qt.bits, qt.group_size, qt.sym, act_order=qt.g_idx is not None).name()


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'; modules outside numbered blocks -> '-'."""
    if indices == [-1]:
        return "-"
    parts, start = [], None
    ordered = sorted(indices)
    for i, v in enumerate(ordered):
        if start is None:
            start = v
        if i + 1 == len(ordered) or ordered[i + 1] != v + 1:
            parts.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(parts)


def _human(n: float) -> str:
    """Bytes in binary units: 1536 -> '1.5 KB'."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1024
        if abs(n) < 1024 or unit == "GB":
            break
    return f"{n:.1f} {unit}"


def _short(value, limit: int = 90) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."

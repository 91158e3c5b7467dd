"""Calibration on the bundled model: wall time, peak RSS and wikitext-2 test perplexity per method and scheme.

    python bench/calibrate.py [--runs gptq-w4g64,awq-w4g64,...] [--num-samples 128] [--seq-len 512]
                              [--windows 40] [--flags "--compute-dtype bfloat16"] [--json calibrate.json] [--keep DIR]

Each run is `quantkit calibrate` in a child process on 128 x 512 tokens of --data, which this bench sets to
../shared/data/wikitext-2/valid.txt unless told otherwise (the BENCHMARKS.md figures were measured so; `quantkit
calibrate`'s own default is the general set shipped in quantkit/calibration_data). Its wall time and peak RSS come
from os.wait4 on that child (this parent never imports torch, so a forked child starts small). Each perplexity is
another child. Perplexity follows PEERS.md: the test text read whole, tokenized once without BOS, non-overlapping
512-token windows, the first 40, fp32, mean NLL over the 511 predictions of each window, exp. Prints a markdown
table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext-2"
RUNS = {
    "rtn-w4g64": ["--method", "rtn", "--bits", "4", "--group-size", "64", "--sym"],
    "rtn-w4g64-asym": ["--method", "rtn", "--bits", "4", "--group-size", "64", "--asym"],
    "rtn-w8g64": ["--method", "rtn", "--bits", "8", "--group-size", "64", "--sym"],
    "gptq-w4g64": ["--method", "gptq", "--bits", "4", "--group-size", "64", "--sym"],
    "gptq-w4g64-nogar": ["--method", "gptq", "--bits", "4", "--group-size", "64", "--sym", "--no-group-aware"],
    "gptq-w4g64-fp32": ["--method", "gptq", "--bits", "4", "--group-size", "64", "--sym", "--compute-dtype", "float32"],
    "gptq-w4g64-act": ["--method", "gptq", "--bits", "4", "--group-size", "64", "--sym", "--act-order"],
    "gptq-w4g64-act-static": ["--method", "gptq", "--bits", "4", "--group-size", "64", "--sym", "--act-order",
                              "--static-groups"],
    "gptq-w8g64": ["--method", "gptq", "--bits", "8", "--group-size", "64", "--sym"],
    "awq-w4g64": ["--method", "awq", "--bits", "4", "--group-size", "64", "--asym"],
}


def run_calibrate(name: str, flags: list[str], args, folder: Path) -> dict:
    """One `quantkit calibrate` child: wall time, peak RSS (its own, via wait4) and the per-layer report."""
    out = folder / name
    cmd = [sys.executable, "-m", "quantkit.cli", "calibrate", *flags, *args.flags.split(), "--out", str(out),
           "--no-resume", "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), "--data", str(args.data)]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{name} failed:\n{stderr}")
    meta = json.loads((out / "quantkit.json").read_text())
    losses = [e["loss"] for e in meta["layers"] if e.get("loss") is not None]
    return {"run": name, "flags": " ".join([*flags, *args.flags.split()]), "wall_s": round(wall, 1), "peak_rss_gb": round(usage.ru_maxrss / 1e6, 2),
            "mean_layer_loss": sum(losses) / len(losses) if losses else None,
            "fallbacks": sum(bool(e.get("fallback")) for e in meta["layers"]), "folder": str(out)}


def wikitext_ppl(source: str, windows: int) -> float:
    """Perplexity of `source` ("bundled" = the FP16 model) in a child process."""
    done = subprocess.run([sys.executable, __file__, "--ppl-of", source, "--windows", str(windows)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"perplexity of {source} failed:\n{done.stderr}")
    return float(done.stdout.strip().splitlines()[-1])


def print_ppl(source: str, windows: int) -> None:
    from quantkit.evals.perplexity import perplexity, text_windows
    from quantkit.models.loader import load_model

    loaded = load_model(None if source == "bundled" else source)
    ids = text_windows(loaded.tokenizer, (SHARED / "test.txt").read_text(), 512, windows)
    print(perplexity(loaded.model, ids).ppl)


def table(rows: list[dict], fp16: float) -> str:
    lines = ["| run | wikitext-2 ppl | vs FP16 | wall time | peak RSS |", "|---|---|---|---|---|",
             f"| FP16 (fp32 compute) | {fp16:.2f} | - | - | - |"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['ppl']:.2f} | {100 * (r['ppl'] / fp16 - 1):+.2f}% | {r['wall_s']:.0f} s | "
                     f"{r['peak_rss_gb']:.2f} GB |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    ap.add_argument("--data", type=Path, default=SHARED / "valid.txt")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--fp16-ppl", type=float, help="the FP16 perplexity measured before (skips measuring it)")
    ap.add_argument("--flags", default="", help='more calibrate flags for every run, e.g. "--compute-dtype bfloat16"')
    ap.add_argument("--json", type=Path, default=Path("calibrate.json"))
    ap.add_argument("--keep", type=Path, help="write the checkpoints here (default: a temporary folder)")
    ap.add_argument("--ppl-of", help=argparse.SUPPRESS)  # internal: print one model's perplexity
    args = ap.parse_args()
    if args.ppl_of:
        return print_ppl(args.ppl_of, args.windows)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"unknown runs {unknown}: choose from {', '.join(RUNS)}")

    folder = args.keep or Path(tempfile.mkdtemp(prefix="quantkit-bench-calibrate-"))
    fp16 = args.fp16_ppl or wikitext_ppl("bundled", args.windows)
    rows = []
    for name in names:
        row = run_calibrate(name, RUNS[name], args, folder)
        row["ppl"] = wikitext_ppl(row["folder"], args.windows)
        rows.append(row)
        print(f"{name}: ppl {row['ppl']:.3f}, {row['wall_s']} s, {row['peak_rss_gb']} GB", file=sys.stderr)
    print(table(rows, fp16))
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "calibration": f"{args.num_samples} x {args.seq_len} tokens of {args.data}",
              "perplexity": f"wikitext-2 test, first {args.windows} windows of 512 tokens, fp32", "fp16_ppl": fp16,
              "runs": rows}
    args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

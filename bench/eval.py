"""Accuracy of quantized checkpoints against their FP16 base, and how long quantkit eval takes.

    python bench/eval.py CKPT [CKPT ...] [--tasks wikitext,arc_easy,piqa,hellaswag] [--limit 500] [--windows 40]
                         [--out table.md]        # one markdown table: every checkpoint x task x metric, 95% CIs
    python bench/eval.py --timing CKPT [--limit 500]   # wall time of ARC-Easy rows, baseline + candidate (goal 300 s)

Each checkpoint is compared with the base_model its quantkit.json records; per-checkpoint report.json / report.md /
deltas.png go beside --out (CKPT_NAME/). Run with OMP_NUM_THREADS=1 on a CPU that other work shares.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from quantkit.evals.report import write
from quantkit.evals.runner import EvalSpec, run

METRICS = {"ppl", "kl_mean", "top1_agree", "acc", "acc_norm"}


def table(reports: dict[str, object]) -> str:
    lines = ["| checkpoint | task | metric | FP16 | quantized | delta [95% CI] | n |", "|---|---|---|---|---|---|---|"]
    for name, report in reports.items():
        for m in report.metrics:
            if m.metric not in METRICS:
                continue
            d = m.delta
            delta = f"{d.value:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"
            if m.metric == "ppl":
                p = m.delta_pct
                delta += f" ({p.value:+.1f}% [{p.low:+.1f}, {p.high:+.1f}])"
            lines.append(f"| {name} | {m.task} | {m.metric} | {m.baseline:.3f} | {m.candidate:.3f} | {delta} | "
                         f"{m.n} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--tasks", default="wikitext,arc_easy,piqa,hellaswag")
    ap.add_argument("--limit", type=int, default=500)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--timing", action="store_true", help="time ARC-Easy baseline + candidate instead")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
               f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.timing:
        for ckpt in args.checkpoints:
            start = time.perf_counter()
            report = run(EvalSpec(candidate=ckpt, tasks=["arc_easy"], limit=args.limit))
            seconds = time.perf_counter() - start
            acc = {m.metric: m for m in report.metrics}["acc"]
            print(f"{ckpt}: {args.limit} ARC-Easy rows, baseline + candidate (model loads included): {seconds:.1f} s "
                  f"(goal 300 s); acc {acc.baseline:.1f} -> {acc.candidate:.1f}; {machine}")
        return
    reports, baseline_cache = {}, {}
    for ckpt in args.checkpoints:
        spec = EvalSpec(candidate=ckpt, tasks=args.tasks.split(","), limit=args.limit, windows=args.windows,
                        seq_len=args.seq_len)
        reports[Path(ckpt).name] = report = run(spec, baseline_cache=baseline_cache)
        print(f"{ckpt}: {report.seconds:.0f} s")
        if args.out is not None:
            write(report, args.out.parent / Path(ckpt).name)
    text = (f"{table(reports)}\n\nwikitext: L={args.seq_len}, first {args.windows} windows of wikitext-2 test; "
            f"multiple choice: first {args.limit} rows, lm-eval prompts, acc/acc_norm in points; "
            f"95% paired bootstrap ({machine}).\n")
    print(text)
    if args.out is not None:
        tmp = args.out.with_name(f".{args.out.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()

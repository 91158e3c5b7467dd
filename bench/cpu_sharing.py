"""Single-request CPU decode on a quiet machine and beside a busy loop, with and without graceful sharing.

    python bench/cpu_sharing.py [--tokens 64] [--w4] [--busy-cpu 1] [--settings before,after] [--deadline 6]

For each setting a fresh child process (the OpenMP wait policy is read when torch loads) builds the engine of
quantkit.LLM on the bundled model (bf16; --w4: RTN W4 g64 of its decoder linears, in memory), warms up, then
times the decode of one greedy request (ignore_eos, --tokens tokens after the prefill, or what --deadline seconds
allow) three times: quiet, with `taskset -c BUSY python -c 'while True: pass'` running (started 0.5 s before,
killed after), and quiet again. Settings:
  before   libgomp's default spin-wait, torch's thread count fixed (QUANTKIT_CPU_THREADS=fixed): as it was
  passive  OMP_WAIT_POLICY=passive, thread count fixed
  spin     GOMP_SPINCOUNT bounded (serve/cpu_threads.SPINCOUNT), thread count fixed
  governor libgomp's default spin-wait, the thread governor on
  after    serve/cpu_threads.py's wait policy and governor (what quantkit serve runs)
Prints decode tok/s, the thread count at the end of each run and os.getloadavg(), and busy / mean quiet
(goal: at least 0.40).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = {
    "before": {"QUANTKIT_CPU_THREADS": "fixed"},
    "passive": {"QUANTKIT_CPU_THREADS": "fixed", "OMP_WAIT_POLICY": "passive"},
    "spin": {"QUANTKIT_CPU_THREADS": "fixed", "WAIT_POLICY": "1"},
    "governor": {},
    "after": {"WAIT_POLICY": "1"},
}


def child(tokens: int, w4: bool, busy_cpu: int, deadline: float) -> None:
    from quantkit.serve.cpu_threads import wait_policy_env

    if os.environ.get("WAIT_POLICY"):
        wait_policy_env()  # before torch loads, as quantkit serve does
    import torch

    from quantkit import LLM
    from quantkit.benchmark.step import decode_rate, rtn_quantize_linears
    from quantkit.config import QuantScheme
    from quantkit.models.loader import load_model

    loaded = load_model(None, dtype=torch.bfloat16)
    if w4:
        rtn_quantize_linears(loaded.model, QuantScheme(4, 64, True))
    engine = LLM(loaded, kv_cache_memory=64 << 20, max_model_len=1024).engine
    prompt = loaded.tokenizer.encode("Write a short story about a lighthouse keeper.")

    def run(label: str) -> dict:
        tok_s, steps = decode_rate(engine, prompt, tokens, deadline)
        return {"run": label, "tok_s": tok_s, "steps": steps, "load": os.getloadavg(),
                "threads": torch.get_num_threads()}

    run("warm-up")
    results = [run("quiet")]
    busy = subprocess.Popen(["taskset", "-c", str(busy_cpu), sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        results.append(run("busy"))
    finally:
        busy.kill()
        busy.wait()
    time.sleep(0.5)
    results.append(run("quiet again"))
    print(json.dumps(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--deadline", type=float, default=6.0, help="seconds of decode per run at most")
    ap.add_argument("--w4", action="store_true")
    ap.add_argument("--busy-cpu", type=int, default=1)
    ap.add_argument("--settings", default="before,after", help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.tokens, args.w4, args.busy_cpu, args.deadline)
        return
    print(f"{'W4 g64 RTN' if args.w4 else 'bf16'}, decode of one greedy request ({args.tokens} tokens or "
          f"{args.deadline:g} s); busy loop on cpu {args.busy_cpu}")
    print("| setting | run | decode tok/s | steps | threads at the end | load average (1, 5, 15 min) |")
    print("|---|---|---|---|---|---|")
    summary = []
    for name in args.settings.split(","):
        env = {k: v for k, v in os.environ.items()
               if k not in ("QUANTKIT_CPU_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "WAIT_POLICY")}
        env.update(SETTINGS[name])
        cmd = [sys.executable, __file__, "--child", "--tokens", str(args.tokens), "--busy-cpu", str(args.busy_cpu),
               "--deadline", str(args.deadline)] + (["--w4"] if args.w4 else [])
        results = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True,
                                            check=True).stdout.strip().splitlines()[-1])
        for r in results:
            load = ", ".join(f"{v:.2f}" for v in r["load"])
            print(f"| {name} | {r['run']} | {r['tok_s']:.1f} | {r['steps']} | {r['threads']} | {load} |")
        quiet = (results[0]["tok_s"] + results[2]["tok_s"]) / 2
        summary.append(f"{name}: busy / quiet = {results[1]['tok_s'] / quiet:.2f}")
    print("\n" + "; ".join(summary) + " (goal >= 0.40)")


if __name__ == "__main__":
    main()

"""Decode step plans (serve/cpu_step_plans.py) against the eager forward, side by side in one run (issue 19).

    python bench/step_plans.py [--model FOLDER] [--batch 1,8,64] [--steps 32] [--tokens 128] [--repeats 2]

The bundled model (or --model: a checkpoint folder, e.g. one of bench/random_model.py's), bf16 and RTN W4 g64 (its
decoder linears quantized in memory, symmetric), each served by two engines of quantkit.LLM, cpu_step_plans on and
off, alternating run by run. Per weights, engine and batch size:
quantkit bench step's row (wall, kernels, host ms per decode step: quantkit/benchmark/step.py), and per weights
and engine the decode tok/s of one greedy request of --tokens tokens (ignore_eos) after a short chat prompt;
the ratio eager / plan of wall time and the load average with every row.
"""

from __future__ import annotations

import argparse
import os

import torch


def engines(model, max_num_seqs: int, max_model_len: int) -> dict:
    from quantkit import LLM
    from quantkit.benchmark.step import rtn_quantize_linears
    from quantkit.config import QuantScheme
    from quantkit.models.loader import load_model

    built = {}
    for weights in ("bf16", "W4"):
        for plans in (True, False):
            loaded = load_model(model, dtype=torch.bfloat16)  # serving prepares its model in place: one each
            if weights == "W4":
                rtn_quantize_linears(loaded.model, QuantScheme(4, 64, True))
            built[weights, plans] = LLM(loaded, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                        kv_cache_memory=512 << 20, cpu_step_plans=plans)
    return built


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from quantkit.benchmark.step import decode_rate, profile_batch

    batches = [int(b) for b in args.batch.split(",")]
    built = engines(args.model, max(batches), args.prompt_len + args.steps + args.tokens + 16)
    prompt = built["bf16", True].tokenizer.encode("Write a short story about a lighthouse keeper.")
    print(f"{args.model or 'bundled model'}: {torch.get_num_threads()} threads, load average {os.getloadavg()}")
    print("| weights | batch | plan: wall / kernels / host ms | eager: wall / kernels / host ms | eager / plan | "
          "plan host % | load (1 min) |\n|---|---|---|---|---|---|---|")
    for weights in ("bf16", "W4"):
        for batch in batches:
            for _ in range(args.repeats):
                rows = {plans: profile_batch(built[weights, plans].engine, batch, args.prompt_len, args.steps)
                        for plans in (True, False)}
                cells = [f"{r['wall_s'] * 1e3:.2f} / {r['kernel_s'] * 1e3:.2f} / "
                         f"{(r['wall_s'] - r['kernel_s']) * 1e3:.2f}" for r in (rows[True], rows[False])]
                plan = rows[True]
                print(f"| {weights} | {batch} | {cells[0]} | {cells[1]} | {rows[False]['wall_s'] / plan['wall_s']:.2f} "
                      f"| {100 * (plan['wall_s'] - plan['kernel_s']) / plan['wall_s']:.0f} | "
                      f"{os.getloadavg()[0]:.2f} |")
    print(f"\nOne request, {args.tokens} greedy tokens\n| weights | plan tok/s | eager tok/s | plan / eager | "
          "load (1 min) |\n|---|---|---|---|---|")
    for weights in ("bf16", "W4"):
        for _ in range(args.repeats):
            rates = {}
            for plans in (True, False):
                engine = built[weights, plans].engine
                decode_rate(engine, prompt, 4)  # warm-up: the plan of one sequence, kernel copies
                rates[plans] = decode_rate(engine, prompt, args.tokens)[0]
            print(f"| {weights} | {rates[True]:.1f} | {rates[False]:.1f} | {rates[True] / rates[False]:.2f} | "
                  f"{os.getloadavg()[0]:.2f} |")


if __name__ == "__main__":
    main()

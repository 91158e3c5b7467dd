"""Decode step plans (serve/cpu_step_plans.py) against the eager forward, side by side in one run (issue 19).

    python bench/step_plans.py [--model FOLDER] [--batch 1,8,64] [--steps 32] [--tokens 128] [--repeats 2]
                               [--python-moe]

The bundled model (or --model: a checkpoint folder, e.g. one of bench/random_model.py's), bf16 and RTN W4 g64 (the
linears calibration quantizes, quantized in memory, symmetric), each served by engines of quantkit.LLM, alternating
run by run: "plan" (cpu_step_plans on) and "eager" (off); with --python-moe (a MoE model) also "Python MoE": plans
off and every MoE block back on MoE.forward, the Python loop over its experts that serve/cpu_moe.py's one C call
replaced. Per weights, engine and batch size: quantkit bench step's row (wall, kernels, host ms per decode step:
quantkit/benchmark/step.py), and per weights and engine the decode tok/s of one greedy request of --tokens tokens
(ignore_eos) after a short chat prompt; each engine's ratio to the plan, and the load average with every row.
"""

from __future__ import annotations

import argparse
import os

import torch


def engines(model, variants: list[str], max_num_seqs: int, max_model_len: int) -> dict:
    from quantkit import LLM
    from quantkit.benchmark.step import rtn_quantize_linears
    from quantkit.config import QuantScheme
    from quantkit.models.loader import load_model
    from quantkit.serve.cpu_moe import CPU_MOE

    python_class = {cpu: base for base, cpu in CPU_MOE.items()}
    built = {}
    for weights in ("bf16", "W4"):
        for variant in variants:
            loaded = load_model(model, dtype=torch.bfloat16)  # serving prepares its model in place: one each
            if weights == "W4":
                rtn_quantize_linears(loaded.model, QuantScheme(4, 64, True))
            llm = LLM(loaded, max_num_seqs=max_num_seqs, max_model_len=max_model_len, kv_cache_memory=512 << 20,
                      cpu_step_plans=variant == "plan")
            if variant == "Python MoE":
                blocks = [m for m in llm.engine.runner.model.modules() if type(m) in python_class]
                if not blocks:
                    raise SystemExit(f"--python-moe: no MoE block of {model} ({weights}) runs as one C call here")
                for block in blocks:
                    block.__class__ = python_class[type(block)]
            built[weights, variant] = llm
    return built


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--python-moe", action="store_true", help="also the MoE blocks on MoE.forward (plans off)")
    args = ap.parse_args()
    from quantkit.benchmark.step import decode_rate, profile_batch

    variants = ["plan", "eager"] + (["Python MoE"] if args.python_moe else [])
    others = variants[1:]
    batches = [int(b) for b in args.batch.split(",")]
    built = engines(args.model, variants, max(batches), args.prompt_len + args.steps + args.tokens + 16)
    prompt = built["bf16", "plan"].tokenizer.encode("Write a short story about a lighthouse keeper.")
    print(f"{args.model or 'bundled model'}: {torch.get_num_threads()} threads, load average {os.getloadavg()}")
    columns = [f"{v}: wall / kernels / host ms" for v in variants] + [f"{v} / plan" for v in others]
    print(f"| weights | batch | {' | '.join(columns)} | plan host % | load (1 min) |\n"
          f"|{'---|' * (len(columns) + 4)}")
    for weights in ("bf16", "W4"):
        for batch in batches:
            for _ in range(args.repeats):
                rows = {v: profile_batch(built[weights, v].engine, batch, args.prompt_len, args.steps)
                        for v in variants}
                cells = [f"{r['wall_s'] * 1e3:.2f} / {r['kernel_s'] * 1e3:.2f} / "
                         f"{(r['wall_s'] - r['kernel_s']) * 1e3:.2f}" for r in rows.values()]
                plan = rows["plan"]
                cells += [f"{rows[v]['wall_s'] / plan['wall_s']:.2f}" for v in others]
                print(f"| {weights} | {batch} | {' | '.join(cells)} | "
                      f"{100 * (plan['wall_s'] - plan['kernel_s']) / plan['wall_s']:.0f} | {os.getloadavg()[0]:.2f} |")
    columns = [f"{v} tok/s" for v in variants] + [f"plan / {v}" for v in others]
    print(f"\nOne request, {args.tokens} greedy tokens\n| weights | {' | '.join(columns)} | load (1 min) |\n"
          f"|{'---|' * (len(columns) + 2)}")
    for weights in ("bf16", "W4"):
        for _ in range(args.repeats):
            rates = {}
            for variant in variants:
                engine = built[weights, variant].engine
                decode_rate(engine, prompt, 4)  # warm-up: the plan of one sequence, kernel copies
                rates[variant] = decode_rate(engine, prompt, args.tokens)[0]
            cells = [f"{r:.1f}" for r in rates.values()] + [f"{rates['plan'] / rates[v]:.2f}" for v in others]
            print(f"| {weights} | {' | '.join(cells)} | {os.getloadavg()[0]:.2f} |")


if __name__ == "__main__":
    main()

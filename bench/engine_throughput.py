"""Offline engine throughput: N real chat prompts x M output tokens, all submitted at once (quantkit.LLM).

    python bench/engine_throughput.py                      # 64 AlpacaEval prompts x 128 tokens, bf16 on CPU
    python bench/engine_throughput.py --small-pool 0.25    # + the same run with a KV pool of 25% of the need:
                                                           #   preemptions, slot utilisation, outputs identical?
Prints output tokens/s (wall clock), output tokens per CPU-second of this process (the work itself: on a shared,
busy machine the wall-clock figure mostly measures the neighbours), step timings and the engine's KV
statistics. Greedy with ignore_eos, so every request produces exactly --output-len tokens (as vLLM's benchmarks
do). OpenMP keeps its default wait policy and glibc keeps freed memory, as in `quantkit serve`'s engine process (set OMP_WAIT_POLICY=PASSIVE on
a machine shared with other busy processes: spinning threads then lose their time to each other).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DATASETS = {"alpacaeval": "chat-alpacaeval/alpaca_eval_gpt4ref.jsonl", "sharegpt": "chat-sharegpt/sharegpt_v3_filtered_1000.jsonl"}


def chat_prompts(tokenizer, dataset: str, count: int, max_prompt_len: int) -> list[list[int]]:
    """The first `count` prompts of the data set whose chat-templated length is at most max_prompt_len."""
    prompts = []
    for line in (DATA / DATASETS[dataset]).read_text().split("\n"):
        if not line.strip():
            continue
        row = json.loads(line)
        ids = tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if len(ids) <= max_prompt_len:
            prompts.append(ids)
        if len(prompts) == count:
            return prompts
    raise SystemExit(f"only {len(prompts)} prompts of at most {max_prompt_len} tokens in {dataset}")


def run(llm, prompts, output_len: int) -> tuple[list, dict]:
    from quantkit import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine = llm.engine
    steps0 = engine.stats()["num_steps"]
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = engine.stats()
    return outputs, {
        "elapsed_s": elapsed,
        "output_tok_s": generated / elapsed,
        "cpu_s": cpu,  # CPU seconds of this process, all threads: the work, whatever else shares the machine
        "output_tok_per_cpu_s": generated / cpu,
        "total_tok_s": (generated + sum(map(len, prompts))) / elapsed,
        "steps": engine.stats()["num_steps"] - steps0,
        "ms_per_step": 1000 * elapsed / max(1, engine.stats()["num_steps"] - steps0),
        "preemptions": stats["num_preemptions"],
        "kv_slot_utilization_mean": stats["kv_slot_utilization_mean"],
        "kv_slot_utilization_min": stats["kv_slot_utilization_min"],
        "kv_slot_samples": stats["kv_slot_utilization_samples"],
        "kv_capacity_tokens": stats["kv_capacity_tokens"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the bundled FP16 SmolLM2-135M-Instruct)")
    ap.add_argument("--dataset", default="alpacaeval", choices=sorted(DATASETS))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-prompt-len", type=int, default=96)
    ap.add_argument("--dtype", default="auto", help="auto = bfloat16 on CPU")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--small-pool", type=float, default=None,
                    help="also run with a KV pool of this fraction of the tokens all requests need at once")
    args = ap.parse_args()

    import torch

    from quantkit import LLM
    from quantkit.serve.capacity import kv_bytes_per_token
    from quantkit.serve.engine_process import keep_freed_memory

    keep_freed_memory()  # as `quantkit serve`'s engine process does
    if args.threads:
        torch.set_num_threads(args.threads)
    common = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    t0 = time.perf_counter()
    llm = LLM(args.model, **common)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s; dtype {llm.engine.dtype}, threads {torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    prompts = chat_prompts(llm.tokenizer, args.dataset, args.num_prompts, args.max_prompt_len)
    lens = [len(p) for p in prompts]
    print(f"{len(prompts)} {args.dataset} prompts, {min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.1f}), "
          f"{args.output_len} output tokens each")
    run(llm, prompts[:4], 8)  # warm-up
    outputs, result = run(llm, prompts, args.output_len)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    print(f"Output token throughput: {result['output_tok_s']:.1f} tok/s")
    if args.small_pool is None:
        return
    need = sum(lens) + args.output_len * len(prompts)
    dtype_bytes = torch.empty((), dtype=llm.engine.dtype).element_size()
    budget = int(args.small_pool * need) * kv_bytes_per_token(llm.engine.model.config, dtype_bytes)
    small = LLM(llm.loaded, kv_cache_memory=budget, max_model_len=max(lens) + args.output_len, **common)
    small_outputs, small_result = run(small, prompts, args.output_len)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outputs, small_outputs))
    print(f"small pool ({args.small_pool:.0%} of {need} tokens):",
          json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in small_result.items()}))
    print(f"outputs identical to the roomy run: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()

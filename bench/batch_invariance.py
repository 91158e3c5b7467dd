"""Batch-invariant greedy decoding on the bundled model in bf16 (the CPU serving default), on and off side by side.

    python bench/batch_invariance.py [--prompts 32] [--max-tokens 64] [--concurrency 64] [--output-tokens 128]

Invariance: --prompts real chat prompts (the first half from ShareGPT, the second from AlpacaEval, in
../shared/data or $QUANTKIT_DATA_DIR, each first user turn under the chat template, lengths as they come) x
--max-tokens greedy tokens through the engine under quantkit/benchmark/invariance.py's modes: (a) alone, (b) all at
once with prompts chunked by a --chunk-budget token budget, (c) all at once again with the prefix cache warm,
(d) n-gram speculation and (e) draft-model speculation (a W4 RTN copy of the model) on every step; the table counts
the prompts whose tokens equal (a)'s, with EngineConfig.batch_invariant on and off.

Prefill: the same prompts one at a time, one output token each, no prefix cache (the row attention kernel reads
each row's context once per row, or per 8 rows on AVX2, so long prompts pay most): seconds in all and for the four
longest, on and off.

Throughput: --concurrency chat prompts (the same sources: the first rows of each) of exactly --output-tokens tokens each
(ignore_eos), queued at once on a default engine (2048-token step budget, prefix caching on); output tokens / wall
seconds from the first request queued to the last token, after one short warm-up run per engine, on and off
alternating, --repeats times each.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from quantkit.benchmark.datasets import all_prompts
from quantkit.benchmark.invariance import MODES, greedy_runs, rtn_draft, run_engine
from quantkit.models.loader import load_model
from quantkit.serve.config import EngineConfig
from quantkit.serve.engine import LLMEngine
from quantkit.serve.llm import eos_token_ids
from quantkit.serve.sampling_params import SamplingParams

LABELS = {"alone": "(a) one at a time", "batched": "(b) all at once, chunked", "prefix_warm": "(c) prefix cache warm",
          "ngram": "(d) n-gram speculation", "draft": "(e) draft-model speculation (W4 RTN)"}


def chat_prompts(tokenizer, count: int, data_dir: Path | None = None) -> list[list[int]]:
    """count prompts: the first rows of ShareGPT for the first half, of AlpacaEval for the rest, as chat-template
    ids."""
    half = count // 2
    rows = all_prompts("sharegpt", data_dir=data_dir)[:half] + \
        all_prompts("alpacaeval", data_dir=data_dir)[:count - half]
    out = []
    for row in rows:
        ids = tokenizer.apply_chat_template(row.as_messages()[:1], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def throughput(model, tokenizer, eos, prompts, output_tokens: int, invariant: bool, kv_bytes: int) -> float:
    """Output tok/s of every prompt queued at once on a default engine (after a 4-request warm-up)."""
    cfg = EngineConfig(kv_cache_memory=kv_bytes, max_model_len=2048, batch_invariant=invariant)
    engine = LLMEngine(model, tokenizer, cfg, eos)
    run_engine(engine, prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), at_once=True)
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    start = time.perf_counter()
    tokens = run_engine(engine, prompts, params, at_once=True)
    elapsed = time.perf_counter() - start
    assert all(len(t) == output_tokens for t in tokens)
    return len(prompts) * output_tokens / elapsed


def prefill_seconds(model, tokenizer, eos, prompts, invariant: bool, kv_bytes: int) -> list[float]:
    """Per prompt, alone: wall seconds of prefill + one sampled token (after one warm-up prompt)."""
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=kv_bytes, max_model_len=2048,
                                                      enable_prefix_caching=False, batch_invariant=invariant), eos)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    run_engine(engine, prompts[:1], params, at_once=True)
    times = []
    for prompt in prompts:
        start = time.perf_counter()
        run_engine(engine, [prompt], params, at_once=True)
        times.append(time.perf_counter() - start)
    return times


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chunk-budget", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    ap.add_argument("--skip-modes", action="store_true", help="only the prefill and throughput sections")
    args = ap.parse_args()

    loaded = load_model(None, dtype=torch.bfloat16)
    tok, eos = loaded.tokenizer, eos_token_ids(loaded.tokenizer, loaded.path)
    prompts = chat_prompts(tok, args.prompts, data_dir=args.data_dir)
    lengths = sorted(len(p) for p in prompts)
    print(f"threads {torch.get_num_threads()}; {len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens "
          f"(median {lengths[len(lengths) // 2]}), {args.max_tokens} greedy tokens, bf16", flush=True)

    matches: dict[bool, dict[str, int]] = {}
    for invariant in () if args.skip_modes else (True, False):
        start, load0 = time.perf_counter(), loadavg()
        runs = greedy_runs(copy.deepcopy(loaded.model), tok, prompts, args.max_tokens, invariant, eos,
                           args.kv_cache_memory, 2048, args.chunk_budget, draft=rtn_draft(loaded.model))
        alone = runs["alone"].tokens
        matches[invariant] = {mode: sum(a == b for a, b in zip(run.tokens, alone)) for mode, run in runs.items()}
        spec = {m: (runs[m].stats["spec_decode_num_accepted_tokens"], runs[m].stats["spec_decode_num_draft_tokens"])
                for m in ("ngram", "draft")}
        print(f"batch_invariant={invariant}: {time.perf_counter() - start:.0f} s (load average {load0} -> "
              f"{loadavg()}); prefix-cache hits {runs['prefix_warm'].stats['prefix_cache_hits']}; accepted/drafted "
              + ", ".join(f"{m} {a}/{d}" for m, (a, d) in spec.items()), flush=True)
    if matches:
        print("\n| mode | identical to (a), batch_invariant on | off |\n|---|---|---|")
        for mode in MODES:
            print(f"| {LABELS[mode]} | {matches[True][mode]}/{len(prompts)} | {matches[False][mode]}/{len(prompts)} |")

    longest = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))[:4]
    print(f"\n| prefill, one prompt at a time | all {len(prompts)} (s) | the 4 longest, "
          f"{'/'.join(str(len(prompts[i])) for i in longest)} tokens (s) | load average |\n|---|---|---|---|")
    for invariant in (True, False):
        load0 = loadavg()
        times = prefill_seconds(copy.deepcopy(loaded.model), tok, eos, prompts, invariant, args.kv_cache_memory)
        print(f"| batch_invariant {'on' if invariant else 'off'} | {sum(times):.2f} | "
              f"{sum(times[i] for i in longest):.2f} | {load0}->{loadavg()} |", flush=True)

    load_prompts = chat_prompts(tok, args.concurrency, data_dir=args.data_dir)
    results: dict[bool, list[tuple[float, str]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for invariant in (True, False):
            load0 = loadavg()
            rate = throughput(copy.deepcopy(loaded.model), tok, eos, load_prompts, args.output_tokens, invariant,
                              args.kv_cache_memory)
            results[invariant].append((rate, f"{load0}->{loadavg()}"))
            print(f"throughput batch_invariant={invariant}: {rate:.1f} tok/s (load average {load0} -> {loadavg()})",
                  flush=True)
    on, off = (statistics.median(r for r, _ in results[m]) for m in (True, False))
    print(f"\n| {args.concurrency} concurrent x {args.output_tokens} tokens | output tok/s (median of "
          f"{args.repeats}) | runs (load average) |\n|---|---|---|")
    for invariant, rate in ((True, on), (False, off)):
        runs = ", ".join(f"{r:.1f} ({load})" for r, load in results[invariant])
        print(f"| batch_invariant {'on' if invariant else 'off'} | {rate:.1f} | {runs} |")
    print(f"\ncost of the mode: {100 * (off - on) / off:+.1f}% tok/s (positive: slower with it on)")


if __name__ == "__main__":
    main()

"""Speculative decoding on the bundled model: decode speed with n-gram lookup and with the W4 self-draft against
no speculation, side by side in one process (runs interleaved prompt by prompt), with acceptance rates.

    python bench/spec_decode.py [--draft DIR] [--prompts 6] [--max-tokens 128] [--k 4] [--batches 1,2,4,8]
                                [--workloads sonnet,chat] [--json spec_decode.json]

Workloads: "sonnet" is a sonnet of ../shared/data/sonnet/sonnet.txt followed by its first two lines again, as
plain text (predictable: the continuation repeats what the prompt holds); "chat" uses real ShareGPT first turns
under the chat template (unpredictable). Greedy, bf16 (the CPU serving
dtype), ignore_eos off. --draft: a W4 checkpoint of the bundled model (default: `quantkit calibrate --method rtn`
into a temporary folder first). Batch rows force speculation on (no switch-off) to find the batch size where it
stops paying; that is where `--speculative-disable-by-batch-size` should sit.
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

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def sonnet_prompts(tokenizer, count: int) -> list[list[int]]:
    """Predictable text: a sonnet of ../shared/data/sonnet, then its first two lines again (plain text, no chat
    template): the natural continuation repeats the rest of the sonnet, which is in the prompt."""
    lines = [line for line in (SHARED / "sonnet" / "sonnet.txt").read_text().splitlines() if line.strip()]
    prompts = []
    for i in range(count):
        sonnet = lines[14 * i: 14 * i + 14]
        text = "\n".join(sonnet) + "\n\n" + "\n".join(sonnet[:2]) + "\n"
        prompts.append(tokenizer.encode(text))
    return prompts


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    rows = (SHARED / "chat-sharegpt" / "sharegpt_v3_filtered_1000.jsonl").read_text().splitlines()
    prompts = []
    for line in rows:
        first = json.loads(line)["messages"][0]["content"]
        ids = chat_ids(tokenizer, first)
        if 16 <= len(ids) <= 400:
            prompts.append(ids)
        if len(prompts) == count:
            break
    return prompts


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def make_draft() -> Path:
    out = Path(tempfile.mkdtemp(prefix="quantkit-bench-draft-")) / "rtn-w4g64"
    subprocess.run([sys.executable, "-m", "quantkit.cli", "calibrate", "--method", "rtn", "--bits", "4",
                    "--group-size", "64", "--out", str(out), "--no-resume"], check=True, capture_output=True)
    return out


def run(llm, prompts: list[list[int]], params) -> tuple[float, int, dict]:
    """Generate all prompts at once -> (seconds, output tokens, speculative counters added by this run)."""
    before = llm.engine.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    after = llm.engine.stats()
    spec = {k: after[k] - before[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                              "spec_decode_num_accepted_tokens")}
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), spec


def summarise(name: str, seconds: float, tokens: int, spec: dict) -> dict:
    drafted, accepted, drafts = (spec["spec_decode_num_draft_tokens"], spec["spec_decode_num_accepted_tokens"],
                                 spec["spec_decode_num_drafts"])
    return {"config": name, "tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "acceptance": accepted / drafted if drafted else None,
            "mean_tokens_per_verify": 1 + accepted / drafts if drafts else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", type=Path, help="W4 checkpoint of the bundled model (default: made with RTN)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--batches", default="1,2,4,8", help="batch sizes of the sweep (sonnet workload)")
    ap.add_argument("--workloads", default="sonnet,chat")
    ap.add_argument("--json", type=Path, default=Path("spec_decode.json"))
    args = ap.parse_args()

    from quantkit.serve.llm import LLM
    from quantkit.serve.sampling_params import SamplingParams

    draft = args.draft or make_draft()
    common = dict(kv_cache_memory=1 << 30, max_model_len=2048)
    spec = dict(num_speculative_tokens=args.k, speculative_disable_by_batch_size=1024, speculative_min_acceptance=0.0)
    llms = {"none": LLM(None, **common),
            "ngram": LLM(None, speculative_method="ngram", **spec, **common),
            "w4-self-draft": LLM(None, speculative_model=str(draft), **spec, **common)}
    tokenizer = llms["none"].tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in llms.values():  # warm up (oneDNN primitives, the C decode kernel)
        llm.generate([chat_ids(tokenizer, "Hello")], SamplingParams(temperature=0.0, max_tokens=8))

    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "load_avg_start": os.getloadavg(), "k": args.k, "max_tokens": args.max_tokens, "single": [],
              "batch": []}
    workloads = {"sonnet": sonnet_prompts, "chat": chat_prompts}
    for workload in args.workloads.split(","):
        prompts = workloads[workload](tokenizer, args.prompts)
        totals = {name: [0.0, 0, {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                                  "spec_decode_num_accepted_tokens": 0}] for name in llms}
        for prompt in prompts:  # one request at a time, the configs interleaved
            for name, llm in llms.items():
                seconds, tokens, counters = run(llm, [prompt], params)
                totals[name][0] += seconds
                totals[name][1] += tokens
                for key, value in counters.items():
                    totals[name][2][key] += value
        base = totals["none"][1] / totals["none"][0]
        for name, (seconds, tokens, counters) in totals.items():
            row = {"workload": workload, **summarise(name, seconds, tokens, counters)}
            row["speedup"] = row["tok_s"] / base
            result["single"].append(row)
            print(json.dumps(row), file=sys.stderr)

    prompts = sonnet_prompts(tokenizer, max(int(b) for b in args.batches.split(",")))
    for batch in (int(b) for b in args.batches.split(",")):
        rows = {}
        for name, llm in llms.items():
            rows[name] = summarise(name, *run(llm, prompts[:batch], params))
        for name, row in rows.items():
            row.update(batch=batch, speedup=row["tok_s"] / rows["none"]["tok_s"])
            result["batch"].append(row)
            print(json.dumps(row), file=sys.stderr)
    result["load_avg_end"] = os.getloadavg()
    args.json.write_text(json.dumps(result, indent=1))
    print(table(result))


def table(result: dict) -> str:
    lines = ["| workload | batch | config | output tok/s | vs none | acceptance | tokens per verify step |",
             "|---|---|---|---|---|---|---|"]
    for row in result["single"] + result["batch"]:
        acc = f"{100 * row['acceptance']:.1f}%" if row["acceptance"] is not None else "-"
        per = f"{row['mean_tokens_per_verify']:.2f}" if row["mean_tokens_per_verify"] is not None else "-"
        lines.append(f"| {row.get('workload', 'sonnet')} | {row.get('batch', 1)} | {row['config']} | "
                     f"{row['tok_s']:.1f} | {row['speedup']:.2f}x | {acc} | {per} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

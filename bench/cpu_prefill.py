"""Prefill attention on CPU: the AMX kernel (kernels/cpu/paged_prefill.py, where the CPU has AMX) and the row kernel of
batch-invariant serving (kernels/cpu/paged_decode.py's paged_rows) against the SDPA path, through
TorchPagedAttention, on one layer of a 2048-token prefill step of real prompt lengths.

    python bench/cpu_prefill.py [--tokens 2048] [--repeats 20] [--past 0] [--window W]

The step's chunks are the lengths of the first ShareGPT prompts (chat-templated, bundled tokenizer) that fill
--tokens, each after --past cached tokens; SmolLM2-135M's heads (9 query, 3 kv, head_dim 64), block 16, bf16.
--window: a sliding-window layer (then "sdpa" is the masked torch path such layers take, and no AMX kernel).
The paths run alternately on the same inputs; prints the median milliseconds of each, its ratio to SDPA and its
GFLOP/s (4 * causal query-key pairs * head_dim * query heads).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine_throughput import chat_prompts
from quantkit.models.loader import load_tokenizer
from quantkit.kernels.cpu import paged_prefill as cpu_prefill
from quantkit.kernels.cpu.paged_decode import load_rows_kernel
from quantkit.models.attention import AttentionSpec
from quantkit.serve.attention import AttentionMetadata, TorchPagedAttention

HQ, HKV, D, BLOCK = 9, 3, 64, 16


def step_lengths(tokens: int) -> list[int]:
    """Prompt lengths of real chat prompts filling `tokens` (the last one cut to fit, as a chunk would be)."""
    lens, total = [], 0
    for ids in chat_prompts(load_tokenizer(None), "sharegpt", 256, 1024):
        take = min(len(ids), tokens - total)
        lens.append(take)
        total += take
        if total == tokens:
            return lens
    return lens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--past", type=int, default=0, help="cached tokens before each chunk")
    ap.add_argument("--window", type=int, default=None, help="the layer's sliding window (default: none)")
    args = ap.parse_args()
    q_lens = step_lengths(args.tokens)
    seq_lens = [n + args.past for n in q_lens]
    tables = torch.zeros(len(q_lens), -(-max(seq_lens) // BLOCK), dtype=torch.int32)
    slots, next_block = [], 0
    for s, n in enumerate(seq_lens):
        blocks = -(-n // BLOCK)
        tables[s, :blocks] = torch.arange(next_block, next_block + blocks, dtype=torch.int32)
        next_block += blocks
        positions = torch.arange(args.past, n)
        slots.append(tables[s, positions // BLOCK].long() * BLOCK + positions % BLOCK)
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(next_block, BLOCK, HKV, D, generator=gen).bfloat16(),
               torch.randn(next_block, BLOCK, HKV, D, generator=gen).bfloat16())]
    t = sum(q_lens)
    q = torch.randn(t, HQ, D, generator=gen).bfloat16()
    k, v = (torch.randn(t, HKV, D, generator=gen).bfloat16() for _ in range(2))
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), block_tables=tables,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl, num_decodes=0,
                             seq_lens_host=seq_lens, query_lens_host=q_lens)
    specs = [AttentionSpec(D ** -0.5, sliding_window=args.window)]
    backends = {"sdpa": TorchPagedAttention(caches, specs)}
    rows, amx = load_rows_kernel(), cpu_prefill.load_prefill_kernel()
    if rows is not None:
        backends["row kernel (batch-invariant)"] = TorchPagedAttention(caches, specs, rows_kernel=rows)
    if amx is not None and args.window is None:  # AMX CPUs only
        backends["amx kernel"] = TorchPagedAttention(caches, specs, prefill_kernel=amx)
    times = {name: [] for name in backends}
    for _ in range(args.repeats):
        for name, attn in backends.items():
            start = time.perf_counter()
            attn.begin_step(meta)
            attn(0, q, k, v)
            times[name].append(time.perf_counter() - start)
    ms = {name: 1000 * statistics.median(ts) for name, ts in times.items()}
    seen = args.window or max(seq_lens)  # query at position p sees min(p + 1, window) keys
    pairs = sum(min(pos + 1, seen) for q_len in q_lens for pos in range(args.past, args.past + q_len))
    print(f"{len(q_lens)} chunks, {t} tokens (lengths {min(q_lens)}-{max(q_lens)}), past {args.past}, "
          f"window {args.window}, {torch.get_num_threads()} threads")
    for name, value in ms.items():
        print(f"{name}: {value:.2f} ms, sdpa / it {ms['sdpa'] / value:.2f}x, "
              f"{4 * pairs * D * HQ / (value * 1e-3) / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()

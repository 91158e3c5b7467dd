"""Decode-sized quantized linears on CPU (1-4 rows): kernels/cpu/gemv.py's GEMV against torch's per-row int4/int8
kernels (kernels/cpu/tinygemm.py, what QLinear ran below 5 rows before) and the bf16 AMX GEMM of PackedLinear,
side by side in one run.

    python bench/cpu_gemv.py [--rows 1,2,4] [--bits 4,8] [--repeats 5] [--threads N]
    python bench/cpu_gemv.py --decode [--tokens 64] [--repeats 2]

Shapes: the bundled SmolLM2-135M's (q/o 576 x 576, k/v 192 x 576, gate/up 1536 x 576, down 576 x 1536), the fused
ones the serving runner builds (q|k|v 960 x 576, gate|up 3072 x 576) and 4096 x 4096 to see bandwidth. RTN with
groups of 64, symmetric. Each layer is timed over enough distinct copies of its weight (>= 16 MB in all, as a
forward pass meets 30 layers) that the weights stream from memory rather than the core's caches; figures are
microseconds per call (median of --repeats passes over the copies, wall time; the three kernels take turns
within each pass) and GB/s of weight bytes streamed
(GEMV: codes + fp16 scale/zero; tinygemm: int4 + bf16 scale/zero (8-bit: its two nibble planes); bf16: 2 B per
weight). Needs a CPU with AMX and AVX512-BF16. Prints os.getloadavg() before and after.

--decode: single-request decode tok/s of quantkit.LLM on the bundled model (one greedy request, --tokens tokens
after the prefill): bf16, W4 g64 RTN (its decoder linears quantized in memory) with torch's per-row kernels (the
GEMV switched off: what ran before) and W4 with the GEMV, taking turns --repeats times in one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from quantkit.config import QuantScheme
from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.kernels.cpu import gemv as cpu_gemv
from quantkit.kernels.cpu import tinygemm
from quantkit.quant.qlinear import QLinear
from quantkit.quant.scheme import quantize_rtn

SHAPES = [(576, 576), (192, 576), (960, 576), (1536, 576), (3072, 576), (576, 1536), (4096, 4096)]


def per_call_us(runs: list, repeats: int) -> list[float]:
    """runs: (fn, weights) pairs; per pair, microseconds per fn(w) call, median of `repeats` passes over its
    weights; the pairs take turns within each pass so that they meet the same machine."""
    for fn, weights in runs:
        for w in weights[:2]:
            fn(w)
    passes: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for (fn, weights), times in zip(runs, passes):
            start = time.perf_counter()
            for w in weights:
                fn(w)
            times.append((time.perf_counter() - start) / len(weights))
    return [statistics.median(t) * 1e6 for t in passes]


def nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(o) for o in obj)
    return 0


def decode(tokens: int, repeats: int) -> None:
    from quantkit import LLM
    from quantkit.benchmark.step import decode_rate, rtn_quantize_linears
    from quantkit.models.loader import load_model

    engines = {}
    for name in ("bf16", "W4"):
        loaded = load_model(None, dtype=torch.bfloat16)
        if name == "W4":
            rtn_quantize_linears(loaded.model, QuantScheme(4, 64, True))
        engines[name] = LLM(loaded, kv_cache_memory=64 << 20, max_model_len=1024).engine
    prompt = loaded.tokenizer.encode("Write a short story about a lighthouse keeper.")
    runs = [("bf16", "bf16", True), ("W4, torch per-row kernels", "W4", False), ("W4, GEMV", "W4", True)]
    gemv_available = cpu_gemv.available
    print(f"load average {os.getloadavg()}")
    print("| model | decode tok/s | threads | load average (1 min) |\n|---|---|---|---|")
    try:
        for _ in range(repeats):
            for label, name, gemv_on in runs:
                cpu_gemv.available = gemv_available if gemv_on else (lambda: False)
                decode_rate(engines[name], prompt, 4)  # warm-up: kernels copies, caches
                tok_s, _ = decode_rate(engines[name], prompt, tokens)
                print(f"| {label} | {tok_s:.1f} | {torch.get_num_threads()} | {os.getloadavg()[0]:.2f} |")
    finally:
        cpu_gemv.available = gemv_available


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--repeats", type=int, default=None, help="passes per figure (default 5; --decode: 2)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--decode", action="store_true", help="single-request decode of the bundled model instead")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if not (cpu_gemm.available() and cpu_gemv.available()):
        raise SystemExit("this CPU has no AMX/AVX512-BF16 (or Linux refused it): nothing to compare")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.decode:
        decode(args.tokens, args.repeats or 2)
        return
    repeats = args.repeats or 5
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    print("| N x K | bits | rows | GEMV us | tinygemm us | bf16 AMX us | GEMV GB/s | tinygemm GB/s | bf16 GB/s "
          "| tinygemm / GEMV | bf16 / GEMV |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        copies = max(4, min(30, (16 << 20) // (n * k)))
        floats = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(copies)]
        vnni = [cpu_gemm.pack_bf16(w.bfloat16()) for w in floats]
        for bits in (int(b) for b in args.bits.split(",")):
            layers = [QLinear.from_qtensor(quantize_rtn(w, QuantScheme(bits, 64, True))) for w in floats]
            amx = [layer.prepared("amx") for layer in layers]
            tiny = [layer.prepared("tinygemm") for layer in layers]
            sizes = (nbytes(amx[0][1][:2]), nbytes(tiny[0][1][-1]), n * k * 2)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=gen).bfloat16()
                times = per_call_us([(lambda p: cpu_gemv.matmul(x, *p, bits), amx),
                                     (lambda p: tinygemm.matmul(x, p), tiny),
                                     (lambda w: cpu_gemm.matmul_bf16(x, w), vnni)], repeats)
                rates = [b / t / 1e3 for b, t in zip(sizes, times)]
                print(f"| {n} x {k} | {bits} | {m} | " + " | ".join(f"{t:.1f}" for t in times) + " | "
                      + " | ".join(f"{r:.1f}" for r in rates) + f" | {times[1] / times[0]:.2f}x | "
                      f"{times[2] / times[0]:.2f}x |")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()

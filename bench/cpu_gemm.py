"""bf16 linears on CPU: oneDNN's prepacked matmul against kernels/cpu/gemm.py's AMX tile GEMM, side by side.

    python bench/cpu_gemm.py [--rows 1,16,64,128,2048] [--repeats 5]

Shapes are the bundled SmolLM2-135M's (q/o 576 x 576, k/v 192 x 576, gate/up 1536 x 576, down 576 x 1536,
lm_head 49152 x 576) plus the fused ones the serving runner builds (q|k|v 960 x 576, gate|up 3072 x 576). Each
layer is timed over 30 distinct copies of its weight, as a forward pass meets 30 layers, so the weights stream
from memory instead of sitting in cache; the figure is microseconds per call (median of --repeats passes over
the copies). Needs a CPU with AMX.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantkit.kernels.cpu import gemm as cpu_gemm

SHAPES = [(576, 576), (192, 576), (960, 576), (1536, 576), (3072, 576), (576, 1536), (49152, 576)]


def per_call_us(fn, weights: list, repeats: int) -> float:
    for w in weights[:2]:
        fn(w)
    passes = []
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(w)
        passes.append((time.perf_counter() - start) / len(weights))
    return statistics.median(passes) * 1e6


def layer_weights(n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Distinct bf16 copies of one N x K weight [N, K]: 30, as a forward pass meets 30 layers (4 of the lm_head)."""
    copies = 4 if n * k > 10_000_000 else 30
    return [(torch.randn(n, k, generator=gen) * 0.05).bfloat16() for _ in range(copies)]


def onednn_us(x: torch.Tensor, weights: list, repeats: int) -> float:
    """Microseconds per call of oneDNN's matmul of x [M, K] bf16 by each weight, prepacked for M rows."""
    prepacked = [torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0]) for w in weights]
    return per_call_us(lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), prepacked, repeats)


def arguments(doc: str, rows: str) -> argparse.Namespace:
    """--rows (comma-separated M values; default `rows`) and --repeats, with `doc` as the help."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=rows)
    ap.add_argument("--repeats", type=int, default=5)
    return ap.parse_args()


def main() -> None:
    args = arguments(__doc__, "1,16,64,128,2048")
    if not cpu_gemm.available():
        raise SystemExit("this CPU has no AMX (or Linux refused it): nothing to compare")
    print(f"threads {torch.get_num_threads()}")
    print("| N x K | rows | oneDNN prepacked (us) | AMX GEMM (us) | oneDNN / AMX |")
    print("|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        weights = layer_weights(n, k, gen)
        for m in (int(r) for r in args.rows.split(",")):
            if n > 10_000 and m > 128:
                continue  # the lm_head only sees the sampled rows
            x = torch.randn(m, k, generator=gen).bfloat16()
            vnni = [cpu_gemm.pack_bf16(w) for w in weights]
            t_onednn = onednn_us(x, weights, args.repeats)
            t_amx = per_call_us(lambda w: cpu_gemm.matmul_bf16(x, w), vnni, args.repeats)
            print(f"| {n} x {k} | {m} | {t_onednn:.0f} | {t_amx:.0f} | {t_onednn / t_amx:.2f}x |")


if __name__ == "__main__":
    main()

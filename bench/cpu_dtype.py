"""Which dtype torch's own CPU linears are fast in here: F.linear in float32 against bfloat16, side by side.

    python bench/cpu_dtype.py [--rows 1,8,64] [--repeats 5]

On a CPU where oneDNN has bf16 kernels (kernels/cpu/capability.py: AVX-512 BW/VL/DQ or AVX-NE-CONVERT) bf16 halves
the weight bytes a memory-bound step reads; without them torch's bf16 GEMM is a portable path. The bundled model's
shapes (bench/cpu_gemm.py's SHAPES but the lm_head), each over 30 distinct weight copies so weights stream from
memory; microseconds per call, median of --repeats passes.
"""

from __future__ import annotations

import os

import torch

from quantkit.kernels.cpu.capability import onednn_bf16

from cpu_gemm import SHAPES, arguments, layer_weights, per_call_us  # bench/cpu_gemm.py: the same runs


def main() -> None:
    args = arguments(__doc__, "1,8,64")
    print(f"oneDNN bf16 kernels: {onednn_bf16()}; threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.2f}")
    print("| N x K | rows | float32 (us) | bfloat16 (us) | bf16 / fp32 |")
    print("|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for n, k in (s for s in SHAPES if s[0] < 10_000):
        bf16 = layer_weights(n, k, gen)
        fp32 = [w.float() for w in bf16]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=gen)
            t32 = per_call_us(lambda w: torch.nn.functional.linear(x, w), fp32, args.repeats)
            xb = x.bfloat16()
            t16 = per_call_us(lambda w: torch.nn.functional.linear(xb, w), bf16, args.repeats)
            print(f"| {n} x {k} | {m} | {t32:.0f} | {t16:.0f} | {t16 / t32:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

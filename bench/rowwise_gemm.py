"""The row-invariant bf16 GEMM (kernels/cpu/rowwise_gemm.py) against what bf16 would run without it, side by side:
oneDNN's prepacked matmul, or on CPUs whose oneDNN has no bf16 kernels (AVX2) torch's own bf16 linear.

    python bench/rowwise_gemm.py [--rows 1,8,64,256] [--repeats 5]

Shapes (N x K) are the bundled SmolLM2-135M's: q/o 576 x 576, k/v 192 x 576, gate/up 1536 x 576, down 576 x 1536,
lm_head 49152 x 576, plus the fused q|k|v 960 x 576 and gate|up 3072 x 576 (with the SiLU epilogue) that
batch-invariant serving runs. Each layer is timed over 30 distinct copies of its weight (4 of the lm_head), as a
forward pass meets 30 layers, so the weights stream from memory instead of sitting in cache; the figure is
microseconds per call, the median of --repeats passes over the copies. oneDNN's gate|up row is its plain GEMM
without the epilogue (what it would have to add on top). On CPUs with AMX, the AMX tile GEMM (kernels/cpu/gemm.py,
also row-invariant: its threads split columns and every row accumulates K in one order) runs beside them.
"""

from __future__ import annotations

import torch

from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.kernels.cpu import rowwise_gemm
from quantkit.kernels.cpu.capability import onednn_bf16

from cpu_gemm import SHAPES, arguments, layer_weights, onednn_us, per_call_us  # bench/cpu_gemm.py: the same runs

FUSED_ACT = (3072, 576)  # gate|up: the rowwise kernel applies silu(gate) * up in its epilogue


def main() -> None:
    args = arguments(__doc__, "1,8,64,256")
    if not rowwise_gemm.available():
        raise SystemExit("the rowwise GEMM did not build here (no C compiler?)")
    with open("/proc/loadavg") as f:
        print(f"threads {torch.get_num_threads()}, load average {f.read().split()[0]}")
    amx, onednn = cpu_gemm.available(), onednn_bf16()
    base = "oneDNN prepacked" if onednn else "torch bf16 linear"
    print(f"rowwise GEMM build: {rowwise_gemm.isa()}")
    print(f"| N x K | rows | {base} (us) | rowwise (us) | rowwise / {base} |"
          + (" AMX (us) | AMX / rowwise |" if amx else ""))
    print("|---|---|---|---|---|" + ("---|---|" if amx else ""))
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        weights = layer_weights(n, k, gen)
        act = (n, k) == FUSED_ACT
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=gen).bfloat16()
            vnni = [cpu_gemm.pack_bf16(w) for w in weights]
            t_onednn = onednn_us(x, weights, args.repeats) if onednn else per_call_us(
                lambda w: torch.nn.functional.linear(x, w), weights, args.repeats)
            t_rows = per_call_us(lambda w: rowwise_gemm.matmul(x, w, act=act), vnni, args.repeats)
            label = f"{n} x {k}" + (" (+SiLU)" if act else "")
            row = f"| {label} | {m} | {t_onednn:.0f} | {t_rows:.0f} | {t_rows / t_onednn:.2f}x |"
            if amx:
                t_amx = per_call_us(lambda w: cpu_gemm.matmul_bf16(x, w, act=act), vnni, args.repeats)
                row += f" {t_amx:.0f} | {t_amx / t_rows:.2f}x |"
            print(row, flush=True)


if __name__ == "__main__":
    main()

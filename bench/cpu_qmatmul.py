"""Quantized linears of 5 rows and more on AVX512-BF16 CPUs without AMX: kernels/cpu/rowwise_gemm.py's qmatmul
(each 64-column panel dequantized to bf16 once per call, then AVX-512 BF16 dot products) against what QLinear ran
there before, torch's per-row int4/int8 kernels (kernels/cpu/tinygemm.py) up to 64 rows and dequantize + F.linear
above, and the bf16 rowwise GEMM of the unquantized weight, side by side in one run.

    python bench/cpu_qmatmul.py [--rows 5,8,16,32,64,128,512] [--bits 4,8] [--repeats 5] [--threads N]
    python bench/cpu_qmatmul.py --decode [--batch 8,64] [--steps 16] [--repeats 2]

Shapes: the bundled SmolLM2-135M's fused and plain linears (bench/cpu_gemv.py's list). RTN with groups of 64,
symmetric; each layer timed over distinct copies of its weight (>= 16 MB in all) as in bench/cpu_gemv.py;
microseconds per call (median of --repeats passes, the kernels taking turns within each pass). Prints
os.getloadavg() before and after.

--decode: decode steps of the bundled model with RTN W4 g64 (its decoder linears quantized in memory) at --batch
sequences (quantkit.benchmark.step.profile_batch: wall, kernels and host ms per step), two engines taking turns: one
with the rowwise GEMM switched off (torch's per-row kernels, eager steps: what ran before), one with it (and its
step plans); and the bytes each holds for its W4 layers (buffers and kernel copies).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from cpu_gemv import SHAPES, per_call_us
from quantkit.config import QuantScheme
from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.kernels.cpu import rowwise_gemm, tinygemm
from quantkit.quant.qlinear import _KERNEL_MAX_M, QLinear
from quantkit.quant.scheme import dequantize, quantize_rtn


def torch_path(x: torch.Tensor, layer: QLinear) -> torch.Tensor:
    """QLinear's CPU path before qmatmul: torch's per-row kernel up to its row limit, else dequantize + F.linear."""
    packed = layer.prepared("tinygemm")
    if x.shape[0] <= _KERNEL_MAX_M[packed[0]]:
        return tinygemm.matmul(x, packed)
    return F.linear(x, dequantize(layer.qtensor(), torch.bfloat16))


def decode(batches: list[int], steps: int, repeats: int) -> None:
    from quantkit import LLM
    from quantkit.benchmark.step import profile_batch, rtn_quantize_linears
    from quantkit.models.loader import load_model

    engines = {}
    for rowwise in (False, True):
        loaded = load_model(None, dtype=torch.bfloat16)
        rtn_quantize_linears(loaded.model, QuantScheme(4, 64, True))
        engines[rowwise] = LLM(loaded, max_num_seqs=max(batches), max_model_len=256, kv_cache_memory=512 << 20).engine
    switch = rowwise_gemm.quantized_available
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    print("| batch | torch per-row kernels: wall / kernels / host ms | rowwise GEMM: wall / kernels / host ms "
          "| before / after | load (1 min) |\n|---|---|---|---|---|")
    try:
        for batch in batches:
            for _ in range(repeats):
                rows = {}
                for rowwise, engine in engines.items():
                    rowwise_gemm.quantized_available = switch if rowwise else (lambda: False)
                    rows[rowwise] = profile_batch(engine, batch, 128, steps)
                cells = [f"{r['wall_s'] * 1e3:.2f} / {r['kernel_s'] * 1e3:.2f} / "
                         f"{(r['wall_s'] - r['kernel_s']) * 1e3:.2f}" for r in (rows[False], rows[True])]
                print(f"| {batch} | {cells[0]} | {cells[1]} | {rows[False]['wall_s'] / rows[True]['wall_s']:.2f}x | "
                      f"{os.getloadavg()[0]:.2f} |")
    finally:
        rowwise_gemm.quantized_available = switch
    held = {rowwise: quantized_bytes(engine.runner.model) / 2**20 for rowwise, engine in engines.items()}
    print(f"W4 layers' buffers and kernel copies held: {held[False]:.1f} MiB before, {held[True]:.1f} MiB after")


def quantized_bytes(model: torch.nn.Module) -> int:
    """Bytes of every QLinear's buffers and built kernel copies (storages shared by several count once)."""
    storages = {}
    for layer in (m for m in model.modules() if isinstance(m, QLinear)):
        for t in [*layer.buffers(), *_tensors(list(layer._prepared.values()))]:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for item in obj for t in _tensors(item)] if isinstance(obj, (list, tuple)) else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="5,8,16,32,64,128,512")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--decode", action="store_true", help="W4 decode steps of the bundled model instead")
    ap.add_argument("--batch", default="8,64")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    if not rowwise_gemm.quantized_available():
        raise SystemExit("this CPU has neither AVX512-BF16 nor AVX2 (or no compiler): nothing to compare")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.decode:
        decode([int(b) for b in args.batch.split(",")], args.steps, min(args.repeats, 2))
        return
    print(f"threads {torch.get_num_threads()}, AMX {cpu_gemm.available()}, load average {os.getloadavg()}")
    print("| N x K | bits | rows | qmatmul us | torch path us | bf16 rowwise us | torch path / qmatmul "
          "| bf16 / qmatmul |")
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES[:-1]:  # 4096 x 4096 (bandwidth) is bench/cpu_gemv.py's question
        copies = max(4, min(30, (16 << 20) // (n * k)))
        floats = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(copies)]
        vnni = [cpu_gemm.pack_bf16(w.bfloat16()) for w in floats]
        for bits in (int(b) for b in args.bits.split(",")):
            layers = [QLinear.from_qtensor(quantize_rtn(w, QuantScheme(bits, 64, True))) for w in floats]
            packed = [layer.prepared("amx")[1] for layer in layers]
            for layer in layers:
                layer.prepared("tinygemm")  # built before the timing
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=gen).bfloat16()
                times = per_call_us([(lambda p: rowwise_gemm.qmatmul(x, p, bits), packed),
                                     (lambda layer: torch_path(x, layer), layers),
                                     (lambda w: rowwise_gemm.matmul(x, w), vnni)], repeats=args.repeats)
                print(f"| {n} x {k} | {bits} | {m} | " + " | ".join(f"{t:.0f}" for t in times)
                      + f" | {times[1] / times[0]:.2f}x | {times[2] / times[0]:.2f}x |")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()

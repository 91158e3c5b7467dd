"""QLinear on CPU: time per forward of each path against a float Linear, and bytes held per layer.

    python bench/qlinear_cpu.py [--threads 1] [--repeats 20]

Shapes are the bundled SmolLM2-135M's MLP (1536 x 576 and 576 x 1536). For each scheme and row count M it times
(best of --repeats, microseconds of this process's CPU time, which other processes on a shared machine disturb
less than wall time): the float Linear in fp32 and bf16, QLinear with fp32 input (always dequantize +
matmul) and QLinear with bf16 input (what QLinear.forward picks: on AMX CPUs the GEMV of kernels/cpu/gemv.py
below 5 rows and the AMX GEMM from 5; elsewhere torch's packed kernel when M <= the kernel's threshold, else
dequantize + matmul), plus torch's packed kernel forced at every M, which is how qlinear._KERNEL_MAX_M was chosen
(the M where the kernel stops beating one dequantization). bench/cpu_gemv.py compares the few-row kernels.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from quantkit.config import QuantScheme
from quantkit.kernels.cpu import tinygemm
from quantkit.quant.qlinear import _KERNEL_MAX_M, QLinear
from quantkit.quant.scheme import quantize_rtn

SHAPES = [(1536, 576), (576, 1536)]
SCHEMES = [QuantScheme(4, 64, True), QuantScheme(4, 64, False), QuantScheme(8, -1, True), QuantScheme(8, 64, True)]
ROWS = [1, 4, 16, 32, 64, 256]


def best_us(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"kernel thresholds (rows): {_KERNEL_MAX_M}")
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
        for scheme in SCHEMES:
            layer = QLinear.from_qtensor(quantize_rtn(w, scheme))
            held = sum(b.numel() * b.element_size() for b in layer.buffers())
            prepared = layer.prepared("tinygemm")  # torch's packed-kernel tensors, or None
            kind, tensors = prepared or ("none", None)
            own = {b.data_ptr() for b in layer.buffers()}
            kernel_bytes = 0 if tensors is None else sum(
                t.numel() * t.element_size() for t in _flat_tensors(tensors) if t.data_ptr() not in own)
            print(f"\n{n} x {k} {scheme.name()}: buffers {held / (n * k):.3f} B/weight, + kernel '{kind}' "
                  f"{kernel_bytes / (n * k):.3f} B/weight (fp16 2, fp32 4)")
            print(f"{'M':>5} {'fp32 dense':>11} {'QLinear fp32':>13} {'bf16 dense':>11} {'QLinear bf16':>13} {'kernel forced':>14}")
            for m in ROWS:
                x = torch.randn(m, k)
                xb = x.bfloat16()
                wb = w.bfloat16()
                forced = best_us(lambda: tinygemm.matmul(xb, prepared), args.repeats) if tensors is not None \
                    else float("nan")
                print(f"{m:>5} {best_us(lambda: F.linear(x, w), args.repeats):>11.0f} "
                      f"{best_us(lambda: layer(x), args.repeats):>13.0f} "
                      f"{best_us(lambda: F.linear(xb, wb), args.repeats):>11.0f} "
                      f"{best_us(lambda: layer(xb), args.repeats):>13.0f} {forced:>14.0f}")


def _flat_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _flat_tensors(item)


if __name__ == "__main__":
    main()

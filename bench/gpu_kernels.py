"""GPU benchmark of quantkit.kernels: dequant-GEMM (W4/W8) vs torch fp16, paged-attention decode, M crossovers.

    python bench/gpu_kernels.py [--out bench_kernels.json] [--dtype fp16|bf16] [--bandwidth-gbs 4800] [--quick]
    python bench/gpu_kernels.py --dry-run     # every step on tiny shapes in the Triton CPU interpreter (checks the
                                          # script itself; its timings mean nothing)

Steps: (1) correctness of every path (GEMV, GEMM, dequantize+cuBLAS, attention) on the real shapes against torch
references; (2) Llama-2-7B / Llama-3-8B Linear shapes x M in {1, 4, 16, 64, 256, 1024}: time of W4 and W8
against torch fp16 F.linear, achieved GB/s and % of the memory-bandwidth roofline; (3) paged-attention decode
GB/s at contexts 512..8192; (3b) the decode split sweep: at batch 1 and 8, contexts 2048 and 8192, every split
count of SPLIT_CANDIDATES and the default, the fastest per row (for kernels/triton/paged_attention.py's
PROGRAMS_PER_SM and MIN_TILES_PER_SPLIT); (4) the M crossovers between the three qgemm paths, with the constants
they imply for kernels/triton/qgemm.py; (5) the issue's performance goals, pass/fail. Prints markdown; writes JSON
(--out).

Timing: triton.testing.do_bench_cudagraph (no launch overhead), median. Every timed call reads a different copy of
its weights / KV blocks, cycling through enough copies to cover twice the GPU's L2, so no figure is an L2 hit
(a real model never re-reads one layer's weights from L2 either). The first run autotunes the kernels (minutes;
cached on disk for the next run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

M_VALUES = (1, 4, 16, 64, 256, 1024)
CONTEXTS = (512, 1024, 2048, 4096, 8192)
ATTN_BATCHES = (1, 8, 32)
SPLIT_BATCHES, SPLIT_CONTEXTS = (1, 8), (2048, 8192)  # the decode split sweep's rows
SPLIT_CANDIDATES = (8, 16, 32, 64, 128)  # split counts it times at every row, with the default
CROSSOVER_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# (model, layer) -> (N, K) = (out_features, in_features)
LINEAR_SHAPES = {
    ("llama2-7b", "q/k/v/o"): (4096, 4096),
    ("llama2-7b", "gate/up"): (11008, 4096),
    ("llama2-7b", "down"): (4096, 11008),
    ("llama3-8b", "q/o"): (4096, 4096),
    ("llama3-8b", "k/v"): (1024, 4096),
    ("llama3-8b", "gate/up"): (14336, 4096),
    ("llama3-8b", "down"): (4096, 14336),
}
CROSSOVER_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
ATTN_HEADS = (32, 8, 128)  # Llama-3-8B: query heads, kv heads, head_dim
BLOCK_SIZE = 16
# peak HBM bandwidth, GB/s, by device-name fragments (first match wins)
PEAK_GBS = (
    (("H200",), 4800.0), (("H100", "PCIe"), 2000.0), (("H100",), 3350.0),
    (("A100", "80GB", "PCIe"), 1935.0), (("A100", "80GB"), 2039.0), (("A100",), 1555.0),
)
# issue 19: W4 >= 2.5x fp16 and >= 70% of the bandwidth at M <= 16; batch-1 attention at 8192 >= 60%
GOAL_W4_SPEEDUP, GOAL_W4_FRACTION, GOAL_W8_SPEEDUP = 2.5, 0.70, 1.8
GOAL_ATTN_FRACTION, GOAL_ATTN_BATCH1_FRACTION = 0.70, 0.60


def variants(quick: bool) -> list:
    from quantkit.config import QuantScheme

    schemes = [QuantScheme(4, 128, sym=True), QuantScheme(8, 128, sym=True)]
    if not quick:
        schemes.append(QuantScheme(4, 128, sym=False, act_order=True))
    return schemes


def random_qtensor(n, k, q, device, gen):
    """A QTensor with uniform random codes, fp16 scales ~0.01, and a GPTQ-style act-order g_idx when asked."""
    import torch

    from quantkit.quant.scheme import QTensor

    groups = k // q.group_size if q.group_size != -1 else 1
    codes = torch.randint(0, q.maxq + 1, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=gen) * 0.01 + 0.002).half()
    mid = torch.full((n, groups), 1 << (q.bits - 1), dtype=torch.uint8)
    zeros = mid if q.sym else torch.randint(0, q.maxq + 1, (n, groups), generator=gen, dtype=torch.uint8)
    g_idx = None
    if q.act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // q.group_size).to(torch.int32)
    return QTensor(codes, zeros, scales, g_idx, q.bits, q.group_size, q.sym).to(device)


class Bench:
    """Device, dtype, timer and roofline facts of one run."""

    def __init__(self, args):
        import torch

        self.dry = args.dry_run
        self.device = torch.device("cpu" if self.dry else "cuda")
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
        if self.dry:
            self.name, self.l2_bytes, self.peak_gbs = "CPU (Triton interpreter, dry run)", 1 << 20, args.bandwidth_gbs
        else:
            props = torch.cuda.get_device_properties(self.device)
            self.name = props.name
            self.l2_bytes = getattr(props, "L2_cache_size", 50 << 20) or 50 << 20
            self.peak_gbs = args.bandwidth_gbs or next(
                (bw for parts, bw in PEAK_GBS if all(p in self.name for p in parts)), None)
        self.gen = torch.Generator().manual_seed(0)

    def copies(self, nbytes: int) -> int:
        """Distinct copies of an operand of `nbytes` to cycle through so the set spans 2x L2 (1 in a dry run)."""
        return 1 if self.dry else max(1, min(64, math.ceil(2 * self.l2_bytes / max(nbytes, 1))))

    def time_us(self, fns) -> float:
        """Median microseconds per call of a list of equivalent calls (each on its own operand copy)."""
        def run():
            for fn in fns:
                fn()
        if self.dry:
            run()
            start = time.perf_counter()
            run()
            return (time.perf_counter() - start) * 1e6 / len(fns)
        import triton.testing

        return triton.testing.do_bench_cudagraph(run, rep=25, return_mode="median") * 1e3 / len(fns)

    def roofline(self, nbytes: int, us: float) -> tuple[float, float | None]:
        """(GB/s, fraction of peak or None) for `nbytes` moved in `us` microseconds."""
        gbs = nbytes / (us * 1e-6) / 1e9
        return gbs, (gbs / self.peak_gbs if self.peak_gbs else None)


def quant_bytes(n, k, q, m) -> int:
    """Bytes a W-quantized linear moves: packed weight + fp16 scales (+ uint8 zeros when asym) + x + out."""
    groups = k // q.group_size if q.group_size != -1 else 1
    return n * k * q.bits // 8 + groups * n * (2 + (0 if q.sym else 1)) + 2 * m * (k + n)


def with_copies(pw, count):
    """`count` PackedWeights with their own storage (the first is pw itself)."""
    clone = lambda t: None if t is None else t.clone()  # noqa: E731
    return [pw] + [dataclasses.replace(pw, qweight=clone(pw.qweight), scales=clone(pw.scales),
                                       zeros=clone(pw.zeros), perm=clone(pw.perm)) for _ in range(count - 1)]


def check_linear(b: Bench, n, k, q, ms) -> dict:
    """qgemm.matmul vs fp32 x @ dequantize(qt).T on one shape, every path; relative Frobenius error."""
    import torch

    from quantkit.kernels.triton import qgemm
    from quantkit.quant import scheme

    qt = random_qtensor(n, k, q, b.device, b.gen)
    pw = qgemm.prepare(qt)
    w = scheme.dequantize(qt)  # [N, K] fp32
    tol = 2e-3 if b.dtype == torch.float16 else 1.5e-2  # weight rounding to x's dtype: ~u / sqrt(3) relative
    worst, failed = 0.0, []
    for m in ms:
        x = torch.randn(m, k, generator=b.gen).to(b.device, b.dtype)
        ref = x.float() @ w.t()
        err = ((qgemm.matmul(x, pw).float() - ref).norm() / ref.norm()).item()
        worst = max(worst, err)
        if not err < tol:
            failed.append(f"M={m} ({qgemm.kernel_for(m)}): relative error {err:.2e}")
            print(f"correctness FAILED: {n}x{k} {q.name()} {failed[-1]} >= {tol:.0e}", file=sys.stderr, flush=True)
    return {"shape": [n, k], "scheme": q.name(), "max_rel_err": worst, "tol": tol, "failed": failed}


def check_attention(b: Bench, batch, context, heads) -> dict:
    """Decode and prefill kernels vs their torch references on one real-size paged cache."""
    import torch

    from quantkit.kernels.triton import paged_attention, paged_prefill

    hq, hkv, d = heads
    cache = make_cache(b, batch, context, hkv, d, copies=1)[0]
    q = torch.randn(batch, hq, d, generator=b.gen).to(b.device, b.dtype)
    tol = dict(rtol=2e-3, atol=4e-3) if b.dtype == torch.float16 else dict(rtol=1.6e-2, atol=3e-2)
    args = (q, cache["k"], cache["v"], cache["block_tables"], cache["seq_lens"])
    torch.testing.assert_close(paged_attention.paged_attention_decode(*args),
                               paged_attention.paged_attention_decode_ref(*args), **tol)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=b.device)
    torch.testing.assert_close(paged_prefill.paged_attention_prefill(*args[:4], qsl, args[4], max_query_len=1),
                               paged_prefill.paged_attention_prefill_ref(*args[:4], qsl, args[4]), **tol)
    return {"attention": [batch, context, hq, hkv, d], **tol}


def make_cache(b: Bench, batch, context, hkv, d, copies):
    """`copies` paged caches of `batch` sequences x `context` tokens, blocks shuffled, sharing one pool."""
    import torch

    per_copy = batch * math.ceil(context / BLOCK_SIZE)
    pool = per_copy * copies
    k = torch.randn(pool, BLOCK_SIZE, hkv, d, generator=b.gen).to(b.device, b.dtype)
    v = torch.randn(pool, BLOCK_SIZE, hkv, d, generator=b.gen).to(b.device, b.dtype)
    order = torch.randperm(pool, generator=b.gen).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=b.device)
    return [{"k": k, "v": v, "seq_lens": seq_lens,
             "block_tables": order[c * per_copy:(c + 1) * per_copy].reshape(batch, -1).to(b.device)}
            for c in range(copies)]


def bench_linear(b: Bench, shapes, ms, schemes) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from quantkit.kernels.triton import qgemm

    rows = []
    for (n, k), layers in shapes.items():
        w16 = torch.randn(n, k, generator=b.gen).to(b.device, b.dtype) * 0.02
        fp16_copies = [w16] + [w16.clone() for _ in range(b.copies(2 * n * k) - 1)]
        prepared = {}
        for name, q in schemes.items():
            pw = qgemm.prepare(random_qtensor(n, k, q, b.device, b.gen))
            prepared[name] = with_copies(pw, b.copies(quant_bytes(n, k, q, 0)))
        for m in ms:
            x = torch.randn(m, k, generator=b.gen).to(b.device, b.dtype)
            t16 = b.time_us([lambda w=w: F.linear(x, w) for w in fp16_copies])
            gbs16, frac16 = b.roofline(2 * (n * k + m * (k + n)), t16)
            for name, q in schemes.items():
                tq = b.time_us([lambda p=p: qgemm.matmul(x, p) for p in prepared[name]])
                gbs, frac = b.roofline(quant_bytes(n, k, q, m), tq)
                rows.append({"layers": layers, "N": n, "K": k, "M": m, "scheme": name, "path": qgemm.kernel_for(m),
                             "us": tq, "fp16_us": t16, "speedup": t16 / tq, "gbs": gbs, "peak_frac": frac,
                             "fp16_gbs": gbs16, "fp16_peak_frac": frac16})
                progress(rows[-1])
        del fp16_copies, prepared
    return rows


def progress(row: dict) -> None:
    """One measured row to stderr as it lands, so a run stopped at its time limit still leaves its figures."""
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), file=sys.stderr,
          flush=True)


def decode_inputs(b: Bench, batch, context, heads):
    """(caches, q, bytes a decode moves): enough paged caches to cycle past L2 (make_cache) and the query; the
    bytes are K and V (2 bytes each) and q + out."""
    import torch

    hq, hkv, d = heads
    cache_bytes = 2 * batch * context * hkv * d * 2
    caches = make_cache(b, batch, context, hkv, d, b.copies(cache_bytes))
    q = torch.randn(batch, hq, d, generator=b.gen).to(b.device, b.dtype)
    return caches, q, cache_bytes + 2 * 2 * batch * hq * d


def time_decode(b: Bench, caches, q, num_splits=None) -> float:
    """Median us of paged_attention_decode over the caches (num_splits None: the launcher's default)."""
    from quantkit.kernels.triton import paged_attention

    return b.time_us([lambda c=c: paged_attention.paged_attention_decode(
        q, c["k"], c["v"], c["block_tables"], c["seq_lens"], num_splits=num_splits) for c in caches])


def bench_attention(b: Bench, batches, contexts, heads) -> list[dict]:
    rows = []
    for batch in batches:
        for context in contexts:
            caches, q, nbytes = decode_inputs(b, batch, context, heads)
            us = time_decode(b, caches, q)
            gbs, frac = b.roofline(nbytes, us)
            rows.append({"batch": batch, "context": context, "us": us, "gbs": gbs, "peak_frac": frac})
            progress(rows[-1])
            del caches
    return rows


def sweep_decode_splits(b: Bench, batches, contexts, candidates, heads) -> list[dict]:
    """Per (batch, context): paged_attention_decode at each split count of `candidates` and the default, as the
    launcher rounds them (decode_splits: whole tiles, none past the block table; equal counts timed once); the
    fastest, with GB/s and % of peak, and the default's time."""
    from quantkit.kernels.triton import paged_attention

    rows = []
    for batch in batches:
        for context in contexts:
            caches, q, nbytes = decode_inputs(b, batch, context, heads)
            plan = lambda n: paged_attention.decode_splits(  # noqa: E731
                batch, heads[1], caches[0]["block_tables"].shape[1] * BLOCK_SIZE, paged_attention.DECODE_BLOCK_N,
                b.device, n)[0]
            default = plan(None)
            times = {n: time_decode(b, caches, q, n) for n in sorted({plan(n) for n in candidates} | {default})}
            best = min(times, key=times.get)
            gbs, frac = b.roofline(nbytes, times[best])
            rows.append({"batch": batch, "context": context, "default_splits": default, "default_us": times[default],
                         "default_peak_frac": b.roofline(nbytes, times[default])[1], "best_splits": best,
                         "best_us": times[best], "gbs": gbs, "peak_frac": frac, "times_us": times})
            progress(rows[-1])
            del caches
    return rows


def bench_crossover(b: Bench, shapes, ms, q) -> dict:
    """Time the three qgemm paths over M; the largest M where GEMV still beats GEMM, the first M from which
    dequantize+cuBLAS beats GEMM for good, per shape, and the constants that hold for every shape."""
    import torch

    from quantkit.kernels.triton import dequant_gemm, dequant_gemv, dequantize, qgemm

    per_shape = {}
    for n, k in shapes:
        pws = with_copies(qgemm.prepare(random_qtensor(n, k, q, b.device, b.gen)), b.copies(quant_bytes(n, k, q, 0)))
        times = {"gemv": {}, "gemm": {}, "dequant": {}}
        for m in ms:
            x = torch.randn(m, k, generator=b.gen).to(b.device, b.dtype)
            if m <= dequant_gemv.GEMV_MAX_M:
                times["gemv"][m] = b.time_us([lambda p=p: dequant_gemv.dequant_gemv(x, p) for p in pws])
            times["gemm"][m] = b.time_us([lambda p=p: dequant_gemm.dequant_gemm(x, p) for p in pws])
            times["dequant"][m] = b.time_us([lambda p=p: x @ dequantize.dequantize(p, b.dtype) for p in pws])
        gemv_ms = sorted(times["gemv"])
        gemv_max = max([m for m in gemv_ms if all(times["gemv"][j] <= times["gemm"][j] for j in gemv_ms if j <= m)],
                       default=0)
        dequant_min = next((m for m in ms if all(times["dequant"][j] <= times["gemm"][j] for j in ms if j >= m)),
                           None)
        per_shape[f"{n}x{k}"] = {"times_us": times, "gemv_max_m": gemv_max, "dequant_min_m": dequant_min}
    gemv_maxes = [s["gemv_max_m"] for s in per_shape.values()]
    dequant_mins = [s["dequant_min_m"] for s in per_shape.values()]
    return {"scheme": q.name(), "per_shape": per_shape,
            "recommended": {"GEMV_MAX_M": min(gemv_maxes),
                            "DEQUANT_MIN_M": None if None in dequant_mins else max(dequant_mins)},
            "current": {"GEMV_MAX_M": dequant_gemv.GEMV_MAX_M, "DEQUANT_MIN_M": qgemm.DEQUANT_MIN_M}}


def goals(checks, linear, attention) -> list[dict]:
    """The issue's targets, evaluated on the measured rows."""
    big = [r for r in linear if r["N"] >= 4096 and r["K"] >= 4096]
    linear_checks = [c for c in checks if "max_rel_err" in c]
    out = [{"goal": "every path within its tolerance of the fp32 reference (relative error / tolerance)",
            "worst": max(c["max_rel_err"] / c["tol"] for c in linear_checks),
            "pass": not any(c["failed"] for c in linear_checks)}]
    for scheme, target in (("w4g128", GOAL_W4_SPEEDUP), ("w8g128", GOAL_W8_SPEEDUP)):
        small = [r["speedup"] for r in big if r["scheme"] == scheme and r["M"] <= 16]
        if small:
            out.append({"goal": f"{scheme} >= {target}x fp16 at M <= 16 on >= 4096x4096",
                        "worst": min(small), "pass": min(small) >= target})
    fracs = [r["peak_frac"] for r in big if r["scheme"] == "w4g128" and r["M"] <= 16 and r["peak_frac"] is not None]
    if fracs:
        out.append({"goal": f"w4g128 >= {GOAL_W4_FRACTION:.0%} of bandwidth at M <= 16 on >= 4096x4096",
                    "worst": min(fracs), "pass": min(fracs) >= GOAL_W4_FRACTION})
    large = [r["speedup"] for r in linear if r["M"] >= 1024]
    if large:
        out.append({"goal": "never slower than fp16 at M >= 1024", "worst": min(large), "pass": min(large) >= 1.0})
    fracs = [r["peak_frac"] for r in attention if r["peak_frac"] is not None and r["context"] >= 2048]
    if fracs:
        out.append({"goal": f"attention decode >= {GOAL_ATTN_FRACTION:.0%} of bandwidth (contexts >= 2048)",
                    "worst": min(fracs), "pass": min(fracs) >= GOAL_ATTN_FRACTION})
    batch1 = [r["peak_frac"] for r in attention
              if r["peak_frac"] is not None and r["batch"] == 1 and r["context"] >= 8192]
    if batch1:
        out.append({"goal": f"batch-1 attention decode >= {GOAL_ATTN_BATCH1_FRACTION:.0%} of bandwidth at 8192",
                    "worst": min(batch1), "pass": min(batch1) >= GOAL_ATTN_BATCH1_FRACTION})
    return out


def pct(frac) -> str:
    return "n/a" if frac is None else f"{100 * frac:.0f}%"


def markdown(result) -> str:
    lines = [f"## quantkit kernels on {result['device']} ({result['dtype']}, peak {result['peak_gbs'] or '?'} GB/s)",
             "", "### Linear layers (time in us; GB/s and % of the bandwidth roofline)", "",
             "| layers | N x K | M | scheme | path | us | fp16 us | speedup | GB/s | % peak | fp16 % peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["linear"]:
        lines.append(f"| {r['layers']} | {r['N']}x{r['K']} | {r['M']} | {r['scheme']} | {r['path']} | {r['us']:.1f} | "
                     f"{r['fp16_us']:.1f} | {r['speedup']:.2f}x | {r['gbs']:.0f} | {pct(r['peak_frac'])} | "
                     f"{pct(r['fp16_peak_frac'])} |")
    hq, hkv, d = result["attention_heads"]
    lines += ["", f"### Paged-attention decode (heads {hq} q / {hkv} kv, head_dim {d}, block {BLOCK_SIZE})", "",
              "| batch | context | us | GB/s | % peak |", "|---|---|---|---|---|"]
    for r in result["attention"]:
        lines.append(f"| {r['batch']} | {r['context']} | {r['us']:.1f} | {r['gbs']:.0f} | {pct(r['peak_frac'])} |")
    lines += ["", "### Decode split sweep (the fastest split count per row; default: decode_splits)", "",
              "| batch | context | default splits | default us | default % peak | best splits | best us | GB/s | "
              "% peak | us by splits |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["attention_splits"]:
        by_splits = ", ".join(f"{n}: {us:.1f}" for n, us in r["times_us"].items())
        lines.append(f"| {r['batch']} | {r['context']} | {r['default_splits']} | {r['default_us']:.1f} | "
                     f"{pct(r['default_peak_frac'])} | {r['best_splits']} | {r['best_us']:.1f} | {r['gbs']:.0f} | "
                     f"{pct(r['peak_frac'])} | {by_splits} |")
    cross = result["crossover"]
    lines += ["", f"### qgemm crossovers ({cross['scheme']})", "",
              "| shape | GEMV wins up to M | dequant+cuBLAS wins from M |", "|---|---|---|"]
    for shape, s in cross["per_shape"].items():
        lines.append(f"| {shape} | {s['gemv_max_m']} | {s['dequant_min_m']} |")
    lines += ["", f"recommended {cross['recommended']} (kernels/triton/qgemm.py now: {cross['current']})", "",
              "### Goals", "", "| goal | worst measured | pass |", "|---|---|---|"]
    for g in result["goals"]:
        lines.append(f"| {g['goal']} | {g['worst']:.2f} | {'yes' if g['pass'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_kernels.json"), help="JSON results file")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="activation dtype")
    parser.add_argument("--bandwidth-gbs", type=float, default=None,
                        help="peak memory bandwidth in GB/s (default: known H200/H100/A100 figures by device name)")
    parser.add_argument("--quick", action="store_true", help="4096x4096 and 14336x4096 only, W4/W8 sym, fewer M")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes in the Triton CPU interpreter: checks the script, timings meaningless")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        import torch

        if not torch.cuda.is_available():
            print("bench/gpu_kernels.py needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); "
                  "use --dry-run to check the script on CPU", file=sys.stderr)
            return 2
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("unset TRITON_INTERPRET: the benchmark times compiled kernels", file=sys.stderr)
            return 2
    b = Bench(args)
    schemes = {q.name(): q for q in variants(args.quick)}
    if args.dry_run:
        shapes = {(96, 64): "tiny-a", (48, 128): "tiny-b"}
        ms, cross_ms, batches, contexts, heads = (1, 4, 17), (1, 4, 16, 17, 32), (2,), (20, 40), (4, 2, 32)
        split_rows, split_candidates = ((1, 2), (300,)), (2, 3, 8)  # 5 tiles of 64 tokens: 2, 3 and 5 splits
        cross_shapes, check_ms = ((96, 64),), (1, 17)
        schemes = {q.name(): q for q in (dataclasses.replace(q, group_size=32) for q in schemes.values())}
    else:
        keep = {(4096, 4096), (14336, 4096)} if args.quick else None
        shapes = {}
        for (model, layer), shape in LINEAR_SHAPES.items():
            if keep is None or shape in keep:
                shapes[shape] = f"{shapes[shape]}, {model} {layer}" if shape in shapes else f"{model} {layer}"
        ms = (1, 16, 1024) if args.quick else M_VALUES
        cross_ms = (1, 4, 16, 64, 256, 1024, 4096) if args.quick else CROSSOVER_M
        batches, contexts, heads = ATTN_BATCHES, CONTEXTS, ATTN_HEADS
        split_rows, split_candidates = (SPLIT_BATCHES, SPLIT_CONTEXTS), SPLIT_CANDIDATES  # --quick too: ~24 timings
        cross_shapes = ((4096, 4096),) if args.quick else CROSSOVER_SHAPES
        from quantkit.kernels.triton.qgemm import DEQUANT_MIN_M

        check_ms = (1, 16, 64, DEQUANT_MIN_M)

    print(f"device {b.name}, peak {b.peak_gbs or '?'} GB/s, L2 {b.l2_bytes >> 20} MiB, dtype {args.dtype}",
          file=sys.stderr)
    checks = [check_linear(b, n, k, q, check_ms) for (n, k) in shapes for q in schemes.values()]
    checks.append(check_attention(b, batches[-1], contexts[-1], heads))
    failures = sum(len(c.get("failed", ())) for c in checks)
    print(f"correctness: {len(checks)} checks, {failures} failed (timed all the same)", file=sys.stderr)
    linear = bench_linear(b, shapes, ms, schemes)
    attention = bench_attention(b, batches, contexts, heads)
    attention_splits = sweep_decode_splits(b, *split_rows, split_candidates, heads)
    crossover = bench_crossover(b, cross_shapes, cross_ms, next(iter(schemes.values())))
    result = {"device": b.name, "dtype": args.dtype, "peak_gbs": b.peak_gbs, "dry_run": args.dry_run,
              "correctness": checks, "linear": linear, "attention": attention, "attention_heads": heads,
              "attention_splits": attention_splits,
              "crossover": crossover,
              "goals": goals(checks, linear, attention)}
    print(markdown(result))
    from quantkit.atomic import write_json

    write_json(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

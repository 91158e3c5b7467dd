"""The dequant-GEMV's K loop as the GPU would run it, measured without a GPU: compiles quantkit's Triton GEMV for
sm_90 (H100/H200) with the ptxas bundled with triton, disassembles it (triton's nvdisasm) and counts the
instructions of its main loop per weight each thread decodes, by kind.

    python bench/gpu_sass.py [--arch 90] [--sms 132] [--clock-ghz 1.98] [--peak-gbs 4800]

Instructions per weight is a static count, not a timing: it shows the arithmetic the kernel spends per weight (the
int -> float conversions, shared-memory round trips, unpacking) before any GPU run. The "issue bound" converts it
to the fastest a 14336 x 4096 layer (Llama-3-8B's gate/up) could run if every scheduler issued one instruction per
clock (4 per SM, 32 lanes each) and nothing stalled; "memory / issue" is the time its packed weight and scales
take at the HBM bandwidth over that bound (below 100%: the arithmetic, not the bytes, would set the speed). A
ceiling, never a measurement.

Two columns say whether the loop hides memory latency: "waits for" is the async-copy groups the loop's wait leaves
in flight (DEPBAR.LE SB0, n: 0 = it waits for every copy, the next tile's included, so each tile's load latency
is exposed), and "sync loads" the plain global loads inside the loop (LDG: each is waited for where its value is
used). The second table gives both for the paged-attention decode kernel (head_dim 128, GQA 4, 64-token tiles,
16-token cache blocks).
Run with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton

from quantkit.kernels.triton import aot, dequant_gemv, dequantize, paged_attention

# (label, activation dtype, bits, group, sym, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps)
CASES = (
    ("M<=16 fp16 W4 g128 sym", "fp16", 4, 128, True, 16, 128, 128, 8, 4),
    ("M<=16 bf16 W4 g128 sym", "bf16", 4, 128, True, 16, 128, 128, 8, 4),
    ("M<=16 fp16 W4 g128 asym", "fp16", 4, 128, False, 16, 128, 128, 8, 4),
    ("M<=16 fp16 W4 g64 sym", "fp16", 4, 64, True, 16, 128, 64, 8, 4),
    ("M<=16 fp16 W4 g64 sym, two groups a tile", "fp16", 4, 64, True, 16, 128, 128, 8, 4),
    ("M<=16 fp16 W4 g32 sym, two groups a tile", "fp16", 4, 32, True, 16, 128, 64, 8, 4),
    ("M<=16 fp16 W4 g128 sym, two groups a tile", "fp16", 4, 128, True, 16, 128, 256, 8, 4),
    ("M<=16 fp16 W8 g128 sym", "fp16", 8, 128, True, 16, 128, 128, 8, 4),
    ("M=32 fp16 W4 g128 sym", "fp16", 4, 128, True, 32, 128, 128, 8, 4),
    ("M=64 fp16 W4 g128 sym", "fp16", 4, 128, True, 64, 128, 128, 4, 4),
)
KINDS = ("I2F", "F2F", "F2FP", "FFMA", "FMUL", "FADD", "HADD2", "HFMA2", "HMUL2", "LOP3", "SHF", "SGXT", "PRMT",
         "IMAD", "LEA", "HMMA", "LDG", "LDS", "LDSM", "STS", "BAR")
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[.\w]*\s*([^;]*);")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def compile_gemv(arch, dtype, bits, group, sym, block_m, block_n, block_k, split, warps):
    consts = dict(BITS=bits, GROUP_K=group, SYM=sym, HAS_PERM=False, HAS_BIAS=False, FP32_DOT=False,
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, EVEN_K=True, EVEN_N=True,
                  TILE_GROUPS=dequantize.tile_groups(block_k, group))
    ptrs = dict(qw_ptr="i32", s_ptr="fp16", z_ptr="u8", perm_ptr="i32", x_ptr=dtype, bias_ptr=dtype, out_ptr=dtype,
                ws_ptr="fp32", cnt_ptr="i32")
    # a launch on the 4096 x 14336 layers: every pointer and every size but M (the rows) a multiple of 16
    aligned = (*ptrs, "N", "K", "M_BUCKET", "stride_xm", "stride_om", "stride_qw", "stride_sg")
    return aot.compile_for(arch, dequant_gemv._gemv_kernel, ptrs, consts, warps=warps,
                           stages=dequant_gemv.GEMV_STAGES, aligned=aligned)


def disassemble(cubin: bytes) -> str:
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def main_loop(sass: str) -> tuple[collections.Counter, str]:
    """(opcodes, waits) of the longest backward branch's body (the K loop: the rest runs once per program); waits:
    the copy groups each async-copy wait in it leaves in flight, comma-separated ("-": none)."""
    ops, labels, loop = [], {}, (0, 0)
    for line in sass.splitlines():
        if m := LABEL.match(line):
            labels[m[1]] = len(ops)
        elif m := INSTRUCTION.search(line):
            ops.append((m[1], m[2]))
            target = re.search(r"(\.L_x_\d+)", m[2]) if m[1] == "BRA" else None
            start = labels.get(target[1], len(ops)) if target else len(ops)  # a backward branch: a label before it
            if len(ops) - start > loop[1] - loop[0]:
                loop = (start, len(ops))
    body = ops[loop[0]:loop[1]]
    waits = [str(int(operands.split(",")[-1], 16)) for op, operands in body if op == "DEPBAR"]
    return collections.Counter(op for op, _ in body), ",".join(waits) or "-"


def compile_decode_attention(arch, stages):
    ptrs = dict(q_ptr="fp16", k_ptr="fp16", v_ptr="fp16", out_ptr="fp16", bt_ptr="i32", lens_ptr="i32",
                part_out_ptr="fp32", part_lse_ptr="fp32", cnt_ptr="i32")
    consts = dict(GROUP=4, HEAD_DIM=128, NUM_SPLITS=32, FP32_DOT=False, WINDOWED=False, SOFTCAP=False, BLOCK_SIZE=16,
                  BLOCK_H=16, BLOCK_D=128, BLOCK_N=paged_attention.DECODE_BLOCK_N, BLOCK_G=4,
                  MERGE_SPLITS=paged_attention.merge_step(32, 4, 128))
    aligned = (*ptrs, "min_partition", "stride_qs", "stride_qh", "stride_os", "stride_oh",
               "stride_kb", "stride_ks", "stride_kh", "stride_bt")
    return aot.compile_for(arch, paged_attention._decode_kernel, ptrs, consts, floats=("qk_scale", "cap_log2"),
                           wide=("stride_kb",), warps=paged_attention.attention_warps(128), stages=stages,
                           aligned=aligned)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU the bound is for (H200: 132)")
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="its boost clock (H200: 1.98)")
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="its HBM bandwidth (H200: 4800)")
    args = ap.parse_args()
    n, k = 14336, 4096
    print("| case (BLOCK_N x BLOCK_K, warps) | instr / weight | issue bound, 14336x4096 | memory / issue | "
          "waits for | sync loads | main kinds per 128 weights |")
    print("|---|---|---|---|---|---|---|")
    for label, *case in CASES:
        kernel = compile_gemv(args.arch, *case)
        ops, waits = main_loop(disassemble(kernel.asm["cubin"]))
        bits, group, block_n, block_k, warps = case[1], case[2], case[5], case[6], case[8]
        per_weight = sum(ops.values()) / (block_n * block_k / (32 * warps))
        us = n * k * per_weight / (4 * 32 * args.sms * args.clock_ghz * 1e3)
        memory_us = (n * k * bits / 8 + n * k // group * (2 if case[3] else 3)) / (args.peak_gbs * 1e3)
        scale = 128 / (block_n * block_k / (32 * warps))
        kinds = ", ".join(f"{kind} {ops[kind] * scale:.0f}" for kind in KINDS if ops[kind])
        print(f"| {label} ({block_n}x{block_k}, {warps}) | {per_weight:.2f} | {us:.1f} us | {memory_us / us:.0%} | "
              f"{waits} | {ops['LDG']} | {kinds} |", flush=True)
    print("\n| paged-attention decode, stages | shared KiB | instructions a tile | waits for | sync loads |")
    print("|---|---|---|---|---|")
    for stages in sorted({3, paged_attention.DECODE_STAGES}):
        kernel = compile_decode_attention(args.arch, stages)
        ops, waits = main_loop(disassemble(kernel.asm["cubin"]))
        print(f"| {stages}{' (DECODE_STAGES)' if stages == paged_attention.DECODE_STAGES else ''} | "
              f"{kernel.metadata.shared / 1024:.1f} | {sum(ops.values())} | {waits} | {ops['LDG']} |", flush=True)


if __name__ == "__main__":
    main()

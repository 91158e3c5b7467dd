# dequant_gemv - x [M, K] fp16/bf16 (M <= GEMV_MAX_M) @ W'[K, N] (PackedWeight, 4/8-bit) -> out [M, N], x.dtype
"""Decode-time dequant-GEMM: split-K over many small programs so a decode batch (M <= 64 rows) still streams the
packed weight at full memory bandwidth.

Grid (cdiv(N, BLOCK_N), SPLIT_K): program (pid_n, pid_k) owns output columns [pid_n*BLOCK_N, +BLOCK_N) and the
K slice [pid_k*k_per_split, +k_per_split). The rows are padded to BLOCK_M = 16, 32 or 64 (one row too: the
tensor cores have time to spare, and the decoding that sets the pace is the same) and multiplied by tl.dot on the
exact integers code - zero (dequantize.dequant_dot). Codes become floats by bit tricks, never by an int -> float
conversion (dequantize.position_values). Accumulation is fp32. bench/gpu_sass.py counts the loop's instructions
per weight without a GPU.

Split-K reduction in ONE launch (no memset, no cast kernel): every program stores its fp32 partial [M, BLOCK_N]
in its own slice of a per-device workspace [SPLIT_K, M, N] (plain stores), then bumps a per-column-tile arrival
counter (acq_rel); the program that arrives last sums the SPLIT_K slices, adds the bias, writes `out` in x's
dtype and puts the counter back to zero. Invariant between launches: the counters are all zero (the slices need
no clearing: each launch overwrites every element it reads). Launches on one stream are serialised, so the shared
workspace is safe; concurrent launches on different streams of one device are not supported.
An earlier version accumulated the partials with fp32 atomic adds into one [M, N] slice; on an H200 (Triton
3.6) its M > 1 path lost the partials of one or two rows in 16 of the 24 tile configs at N = 14336 (rows whose
relative error reached 0.7, fp32 reference), while every SPLIT_K = 1 config and every M = 1 launch was right.
The slices are right in every case measured (BENCHMARKS.md, "GPU").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import SplitWorkspaces, fp32_dot, quick_bench
from .dequantize import (TILE_FACTS, check_matmul_inputs, dequant_dot, dequant_matmul_ref, min_block_k, tile_groups,
                         weight_args, weight_meta)
from .repack import PackedWeight

GEMV_MAX_M = 64  # rows one launch handles: every decode batch bucket up to 64 (more rows go to dequant_gemm)
_MIN_BLOCK_N = 32  # no config has a smaller BLOCK_N: sizes the counter array
WORKSPACE_ROWS = 256  # SPLIT_K * BLOCK_M of every config: the workspace holds [WORKSPACE_ROWS, N] fp32
GEMV_STAGES = 4  # software-pipeline depth of every config (_configs)
_MAX_ACC = 64 * 128  # fp32 accumulator elements per program (BLOCK_M * BLOCK_N) that fit sm_90 registers


def block_m(m: int) -> int:
    """Rows of a program's tile for M rows: 16, 32 or 64 (tl.dot, padded)."""
    return max(16, triton.next_power_of_2(m))


def _configs() -> list[triton.Config]:
    """Candidate tiles (BLOCK_N, BLOCK_K, warps) x splits for H100/H200/A100-class GPUs, autotuned per (N, K,
    M bucket, bits, group); _prune keeps at most 28 per key (fewer above 16 rows), about a minute of tuning.
    Four stages: the K loop waits for its current tile while the next two tiles' words and x are in flight (sm_90
    SASS: DEPBAR.LE SB0, 0x4; three stages keep one tile ahead; a streaming program needs the bytes in flight)."""
    tiles = ((128, 64, 4), (256, 64, 8), (64, 128, 4), (128, 128, 4), (128, 128, 8), (256, 128, 8), (128, 256, 8))
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}, num_warps=warps, num_stages=GEMV_STAGES)
            for bn, bk, warps in tiles for split in (1, 4, 8, 16)]


def _prune(configs, named_args, **kwargs):
    """Keep K tiles dequant_dot takes, splits that leave every program a full K tile and fit the workspace, tiles
    not far wider than N whose accumulator fits registers, and (when some do) K tiles on dequant_dot's
    exact-integer path (tile_groups)."""
    k, n, rows, group_k = named_args["K"], named_args["N"], kwargs["BLOCK_M"], kwargs["GROUP_K"]
    kept = [c for c in configs
            if c.kwargs["BLOCK_K"] >= min_block_k(kwargs["BITS"])
            and c.kwargs["SPLIT_K"] * c.kwargs["BLOCK_K"] <= max(k, c.kwargs["BLOCK_K"])
            and c.kwargs["SPLIT_K"] * rows <= WORKSPACE_ROWS and rows * c.kwargs["BLOCK_N"] <= _MAX_ACC
            and c.kwargs["BLOCK_N"] <= max(_MIN_BLOCK_N, triton.next_power_of_2(n))]
    exact = [c for c in kept if tile_groups(c.kwargs["BLOCK_K"], group_k)]
    return exact or kept or configs[:1]


@triton.jit
def _gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr,  # the dequant-matmul arguments (dequantize.py)
    ws_ptr,  # fp32 workspace, >= SPLIT_K * M * N elements: the partial sums, slice pid_k at pid_k * M * N
    cnt_ptr,  # int32 arrival counters, >= cdiv(N, BLOCK_N), all zero on entry and on exit
    M, N, K, M_BUCKET, stride_xm, stride_om, stride_qw, stride_sg,
    BITS: tl.constexpr, GROUP_K: tl.constexpr, SYM: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, TILE_GROUPS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    mask_m = offs_m < M
    # K slice of this program: whole BLOCK_K tiles, so a tile never straddles a group boundary it should not
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        acc = dequant_dot(x_ptr, offs_m, mask_m, stride_xm, perm_ptr, acc, qw_ptr, s_ptr, z_ptr, k0, offs_n, K, N,
                          stride_qw, stride_sg, BITS, GROUP_K, SYM, HAS_PERM, BLOCK_K, FP32_DOT, EVEN_K, EVEN_N,
                          TILE_GROUPS)
    mask_out = mask_m[:, None] & (offs_n < N)[None, :]
    out_offs = offs_m[:, None] * stride_om + offs_n[None, :]  # (m, n) of out
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)
    else:
        slice_offs = offs_m[:, None] * N + offs_n[None, :]  # (m, n) in a [M, N] slice of the workspace
        tl.store(ws_ptr + pid_k * M * N + slice_offs, acc, mask=mask_out)
        tl.debug_barrier()  # every thread's partial is stored before the counter is bumped (release below)
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            # last program of this column tile: every slice is in L2; .cg bypasses a possibly stale L1
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(ws_ptr + s * M * N + slice_offs, mask=mask_out, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=mask_out)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


# the CPU interpreter cannot time configs: it runs this small one
INTERPRETER_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2}

_gemv_even = triton.heuristics(TILE_FACTS)(_gemv_kernel)
_gemv_tuned = triton.autotune(_configs(), key=["N", "K", "M_BUCKET", "BITS", "GROUP_K"],
                              prune_configs_by={"early_config_prune": _prune},
                              do_bench=quick_bench, cache_results=True)(_gemv_even)

_WORKSPACES = SplitWorkspaces()  # per device: the [WORKSPACE_ROWS, N] fp32 slices and the column-tile counters


def reserve_workspace(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Make the device's split-K workspace fit N columns (call at load time, outside CUDA-graph capture)."""
    return _WORKSPACES.reserve(device, WORKSPACE_ROWS * n, triton.cdiv(n, _MIN_BLOCK_N))


def dequant_gemv(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_M) -> [M, N] in x.dtype. `config` (BLOCK_N, BLOCK_K, SPLIT_K) skips autotuning."""
    check_matmul_inputs(x, pw, bias)
    m, k = x.shape
    n = pw.out_features
    assert 1 <= m <= GEMV_MAX_M, f"M={m} is outside the GEMV range 1..{GEMV_MAX_M}"
    ws, cnt = reserve_workspace(x.device, n)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    rows = block_m(m)
    args = (x, *weight_args(pw),
            bias if bias is not None else x, out, ws, cnt, m, n, k, rows,
            x.stride(0), out.stride(0), pw.qweight.stride(0), pw.scales.stride(0))
    meta = dict(**weight_meta(pw), HAS_BIAS=bias is not None, FP32_DOT=fp32_dot(x.dtype), BLOCK_M=rows)
    if config is None and triton.knobs.runtime.interpret:
        config = INTERPRETER_CONFIG
    if config is None:
        grid = lambda c: (triton.cdiv(n, c["BLOCK_N"]), c["SPLIT_K"])  # noqa: E731
        _gemv_tuned[grid](*args, **meta)
    else:
        split = config["SPLIT_K"]
        assert split * rows <= WORKSPACE_ROWS, f"SPLIT_K={split} x {rows} rows: the workspace holds {WORKSPACE_ROWS}"
        assert config["BLOCK_K"] >= min_block_k(pw.bits), f"BLOCK_K={config['BLOCK_K']} < {min_block_k(pw.bits)}"
        _gemv_even[(triton.cdiv(n, config["BLOCK_N"]), config["SPLIT_K"])](*args, **meta, **config)
    return out


dequant_gemv_ref = dequant_matmul_ref

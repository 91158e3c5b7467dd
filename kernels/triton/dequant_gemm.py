# dequant_gemm - x [M, K] fp16/bf16 @ W'[K, N] (PackedWeight, 4/8-bit) -> out [M, N], x.dtype
"""Medium-M dequant-GEMM: classic tiled matmul whose B tile is decoded from the packed weight in registers.

Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),), programs ordered in GROUP_M-row bands so neighbouring programs
share x rows and weight columns in L2 (Triton matmul tutorial ordering). fp32 accumulator; each K tile loads
its group's scales once and multiplies the exact integers code - zero (dequantize.dequant_dot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import fp32_dot, quick_bench
from .dequantize import (TILE_FACTS, check_matmul_inputs, dequant_dot, dequant_matmul_ref, min_block_k, tile_groups,
                         weight_args, weight_meta)
from .repack import PackedWeight


def _configs() -> list[triton.Config]:
    """Candidate tiles for H100/H200/A100-class GPUs (autotuned per (N, K, M bucket), cached on disk)."""
    shapes = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); BLOCK_K >= min_block_k(4)
        (16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
        (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 8, 3), (128, 64, 128, 8, 3),
        (128, 128, 64, 8, 3), (128, 256, 128, 8, 2), (256, 64, 128, 8, 3),
    ]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in shapes]


def _prune(configs, named_args, **kwargs):
    """Keep K tiles dequant_dot takes and row tiles not far taller than the M bucket (they only multiply
    padding); when some remain, keep the K tiles on dequant_dot's exact-integer path (tile_groups)."""
    bucket, group_k = named_args["M_BUCKET"], kwargs["GROUP_K"]
    kept = [c for c in configs
            if c.kwargs["BLOCK_M"] <= max(16, bucket) and c.kwargs["BLOCK_K"] >= min_block_k(kwargs["BITS"])]
    exact = [c for c in kept if tile_groups(c.kwargs["BLOCK_K"], group_k)]
    return exact or kept or configs[:1]


@triton.jit
def _gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, bias_ptr, out_ptr,  # the dequant-matmul arguments (dequantize.py)
    M, N, K, M_BUCKET, stride_xm, stride_om, stride_qw, stride_sg,
    BITS: tl.constexpr, GROUP_K: tl.constexpr, SYM: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, TILE_GROUPS: tl.constexpr,
):
    # program id -> (pid_m, pid_n), walking GROUP_M row tiles down one column band before moving right
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * num_n)
    first_m = band * GROUP_M
    rows_in_band = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % rows_in_band
    pid_n = (pid % (GROUP_M * num_n)) // rows_in_band

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = dequant_dot(x_ptr, offs_m, mask_m, stride_xm, perm_ptr, acc, qw_ptr, s_ptr, z_ptr, k0, offs_n, K, N,
                          stride_qw, stride_sg, BITS, GROUP_K, SYM, HAS_PERM, BLOCK_K, FP32_DOT, EVEN_K,
                          EVEN_N, TILE_GROUPS)  # fp32 accumulate
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    # out (m, n) at out_ptr + m * stride_om + n
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & (offs_n < N)[None, :])


# the CPU interpreter cannot time configs: it runs this small one
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 4}

_gemm_even = triton.heuristics(TILE_FACTS)(_gemm_kernel)
_gemm_tuned = triton.autotune(_configs(), key=["N", "K", "M_BUCKET", "BITS", "GROUP_K"],
                              prune_configs_by={"early_config_prune": _prune}, do_bench=quick_bench,
                              cache_results=True)(_gemm_even)


def m_bucket(m: int) -> int:
    """Autotune key for M: the next power of two, capped (tiles stop changing past 1024 rows)."""
    return min(triton.next_power_of_2(m), 1024)


def dequant_gemm(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype. `config` (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M) skips autotuning."""
    check_matmul_inputs(x, pw, bias)
    m, k = x.shape
    n = pw.out_features
    assert m >= 1, "x has no rows"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    args = (x, *weight_args(pw),
            bias if bias is not None else x, out, m, n, k, m_bucket(m),
            x.stride(0), out.stride(0), pw.qweight.stride(0), pw.scales.stride(0))
    meta = dict(**weight_meta(pw), HAS_BIAS=bias is not None, FP32_DOT=fp32_dot(x.dtype))
    if config is None and triton.knobs.runtime.interpret:
        config = INTERPRETER_CONFIG
    if config is None:
        grid = lambda c: (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),)  # noqa: E731
        _gemm_tuned[grid](*args, **meta)
    else:
        assert config["BLOCK_K"] >= min_block_k(pw.bits), f"BLOCK_K={config['BLOCK_K']} < {min_block_k(pw.bits)}"
        _gemm_even[(triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)](*args, **meta, **config)
    return out


dequant_gemm_ref = dequant_matmul_ref

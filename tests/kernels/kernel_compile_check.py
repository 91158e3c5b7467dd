"""Compile every quantkit Triton kernel to a cubin for one GPU architecture without a GPU (the ptxas bundled with
triton does the last step). Run as `python tests/kernels/kernel_compile_check.py 90` with TRITON_INTERPRET unset;
tests/test_kernels_compile.py runs it for sm_90. Prints "compiled <n> kernels for sm_<arch>".
"""

from __future__ import annotations

import sys

import triton

from quantkit.kernels.triton import (
    aot, dequant_gemm, dequant_gemv, dequantize, fused_moe, kv_store, paged_attention, paged_prefill, repack, rmsnorm,
    rope, silu_gate,
)

SMEM_LIMIT = {80: 166912, 90: 232448}  # bytes of shared memory one program may use
COMPILED: list[str] = []  # names of the kernels compiled so far


def compile_for(arch: int, fn, pointers: dict, consts: dict, floats=(), wide=(), warps=4, stages=3):
    """aot.compile_for, checked: a cubin within the architecture's shared memory per program."""
    kernel = aot.compile_for(arch, fn, pointers, consts, floats, wide, warps, stages)
    assert kernel.asm["cubin"], f"{fn.__name__}: no cubin"
    assert kernel.metadata.shared <= SMEM_LIMIT[arch], f"{fn.__name__}: {kernel.metadata.shared} B shared memory"
    COMPILED.append(fn.__name__)


WEIGHT_PTRS = dict(qw_ptr="i32", s_ptr="fp16", z_ptr="u8", perm_ptr="i32")


def act_ptrs(dtype: str, *names) -> dict:
    return {name: dtype for name in names}


def dequant_gemm_kernels(arch: int) -> None:
    # one group per K tile (the exact-integer path), sym fp16 and asym bf16; and groups shorter than the tile
    # (the last with masks: K and N off the tiles)
    cases = [(4, 128, True, False, 16, "fp16", True), (4, 128, False, False, 64, "bf16", True),
             (8, 32, False, True, 16, "bf16", False)]
    for bits, group, sym, perm, block_m, dtype, even in cases:
        consts = dict(BITS=bits, GROUP_K=group, SYM=sym, HAS_PERM=perm, HAS_BIAS=True, FP32_DOT=False,
                      BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, SPLIT_K=8, EVEN_K=even, EVEN_N=even,
                      TILE_GROUPS=dequantize.tile_groups(128, group))
        ptrs = {**WEIGHT_PTRS, **act_ptrs(dtype, "x_ptr", "bias_ptr", "out_ptr"), "ws_ptr": "fp32", "cnt_ptr": "i32"}
        compile_for(arch, dequant_gemv._gemv_kernel, ptrs, consts, stages=dequant_gemv.GEMV_STAGES)
        consts = dict(BITS=bits, GROUP_K=group, SYM=sym, HAS_PERM=perm, HAS_BIAS=False, FP32_DOT=False,
                      BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, EVEN_K=even, EVEN_N=even,
                      TILE_GROUPS=dequantize.tile_groups(128, group))
        compile_for(arch, dequant_gemm._gemm_kernel, {**WEIGHT_PTRS, **act_ptrs(dtype, "x_ptr", "bias_ptr", "out_ptr")},
                    consts, warps=4, stages=4)
    compile_for(arch, dequantize._dequantize_kernel, {**WEIGHT_PTRS, "out_ptr": "fp16"},
                dict(BITS=4, GROUP_K=128, SYM=False, HAS_PERM=True, BLOCK_K=64, BLOCK_N=128))
    compile_for(arch, repack._repack_kernel, dict(codes_ptr="u8", perm_ptr="i32", out_ptr="i32"),
                dict(BITS=4, HAS_PERM=True, BLOCK_W=16, BLOCK_N=64))


def attention_and_layer_kernels(arch: int) -> None:
    cache = act_ptrs("bf16", "q_ptr", "k_ptr", "v_ptr", "out_ptr")
    # one split (writes out); 8 splits with window and soft-cap (the last arrival merges); 32 splits
    for splits, group, masks in [(1, 4, False), (8, 8, True), (32, 4, False)]:
        compile_for(arch, paged_attention._decode_kernel,
                    {**cache, "bt_ptr": "i32", "lens_ptr": "i32", "part_out_ptr": "fp32", "part_lse_ptr": "fp32",
                     "cnt_ptr": "i32"},
                    dict(GROUP=group, HEAD_DIM=128, NUM_SPLITS=splits, FP32_DOT=False, WINDOWED=masks, SOFTCAP=masks,
                         BLOCK_SIZE=16, BLOCK_H=16, BLOCK_D=128, BLOCK_N=64, BLOCK_G=group,
                         MERGE_SPLITS=paged_attention.merge_step(splits, group, 128)),
                    floats=("qk_scale", "cap_log2"), wide=("stride_kb",), warps=8, stages=paged_attention.DECODE_STAGES)
    compile_for(arch, paged_prefill._prefill_kernel, {**cache, "bt_ptr": "i32", "qsl_ptr": "i32", "lens_ptr": "i32"},
                dict(GROUP=4, HEAD_DIM=128, FP32_DOT=False, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_D=128, BLOCK_N=64),
                floats=("qk_scale",), wide=("stride_kb",), warps=8, stages=2)
    compile_for(arch, kv_store._kv_store_kernel, {**act_ptrs("fp16", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr"),
                                                  "slot_ptr": "i64"},
                dict(HEAD_DIM=128, NUM_ELEMS=1024, BLOCK=1024), wide=("stride_cb",))
    norm_ptrs = act_ptrs("bf16", "x_ptr", "res_ptr", "w_ptr", "b_ptr", "out_ptr", "res_out_ptr")
    for fp32 in (False, True):  # RMSNorm; LayerNorm with bias, rounded once (fp32_norm)
        compile_for(arch, rmsnorm._rmsnorm_kernel, norm_ptrs, dict(HAS_RESIDUAL=True, FP32_SCALE=fp32, CENTERED=fp32,
                                                                    HAS_BIAS=fp32, BLOCK_H=4096),
                    floats=("eps", "offset"), warps=16)
    for act, has_up in ((0, True), (2, False)):  # SwiGLU; relu^2 alone
        compile_for(arch, silu_gate._silu_gate_kernel, act_ptrs("fp16", "g_ptr", "u_ptr", "out_ptr"),
                    dict(ACT=act, HAS_UP=has_up, EXACT_BF16=False, BLOCK=1024))
    compile_for(arch, rope._rope_kernel, act_ptrs("bf16", "q_ptr", "k_ptr", "cos_ptr", "sin_ptr"),
                dict(HALF=64, BLOCK=64, EXACT_BF16=False))


def moe_kernels(arch: int) -> None:
    # the grouped expert GEMM: bf16 gate/up (rows of x by slot // k) at the large-batch tile; bf16 and fp32 (IEEE
    # dot) down projections with the routing weight, at the decode tile (fused_moe.default_config); W4 g128
    # act-order packed experts (PackedExperts) at both tiles
    plain = dict(PACKED=False, BITS=4, GROUP_K=1, SYM=True, HAS_PERM=False)
    w4 = dict(PACKED=True, BITS=4, GROUP_K=128, SYM=False, HAS_PERM=True)
    for dtype, row_div, weighted, ieee, weight, (bm, bn, bk) in [("bf16", 2, False, False, plain, (64, 64, 32)),
                                                                 ("bf16", 1, True, False, plain, (16, 32, 64)),
                                                                 ("fp32", 1, True, True, plain, (16, 32, 64)),
                                                                 ("bf16", 2, False, False, w4, (64, 64, 32)),
                                                                 ("fp16", 1, True, False, w4, (16, 32, 64))]:
        packed = weight["PACKED"]
        compile_for(arch, fused_moe._expert_gemm_kernel,
                    {**act_ptrs(dtype, "a_ptr", "out_ptr"), "w_ptr": "i32" if packed else dtype,
                     "s_ptr": "fp16" if packed else dtype, "z_ptr": "u8" if packed else dtype,
                     "perm_ptr": "i32" if packed else dtype, "rw_ptr": "fp32", "slots_ptr": "i32",
                     "block_expert_ptr": "i32"},
                    dict(ROW_DIV=row_div, MUL_WEIGHT=weighted, FP32_DOT=False, IEEE=ieee, EXACT_BF16=False, **weight,
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk))


def main(arch: int) -> None:
    assert not triton.knobs.runtime.interpret, "run without TRITON_INTERPRET=1"
    dequant_gemm_kernels(arch)
    attention_and_layer_kernels(arch)
    moe_kernels(arch)
    print(f"compiled {len(COMPILED)} kernels for sm_{arch}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)

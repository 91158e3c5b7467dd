# fused_moe - x [T, H] through each token's k SwiGLU experts (w_gate_up [E, 2I, H], w_down [E, H, I]) weighted by
#             weights [T, k] -> [T, H], fp16/bf16/fp32; expert weights float or W4/W8 packed (packed_experts.py)
"""The serving MoE on CUDA as two grouped GEMMs over all experts (the shape of vLLM's fused_moe):

    slots, block_expert = align_block_size(experts, E, BLOCK_M)   # torch ops, no host sync
    gate_up = x[slot // k] @ w_gate_up[e].T      [T*k, 2I]   one launch: every block of BLOCK_M slots is one expert's
    act = silu(gate) * up                        [T*k, I]    silu_gate.py
    y = weight[slot] * (act[slot] @ w_down[e].T) [T*k, H]    one launch, the routing weight in its epilogue
    out = sum over the k choices of y            [T, H]

Slot s = t * k + j is token t's j-th choice (experts.flatten()). The alignment sorts the slots by expert and pads
each expert's run to a multiple of BLOCK_M with the sentinel T*k, so every block of BLOCK_M sorted slots belongs to
one expert (block_expert[b]; -1 for the unused blocks past the last run, which exit at once). Rounding follows the
module path (quantkit/models/moe.py with nn.Linear experts): each GEMM accumulates in fp32 and rounds to the dtype
like a Linear, silu(gate) * up rounds like torch's two ops, the weight multiplies the rounded expert output and the
product is rounded; the k products are summed in fp32 and rounded once (MoE.forward adds them one by one in the
dtype: the same for k <= 2, within one rounding per extra choice beyond). Packed experts (PackedExperts, repack.py's
layout per expert) are decoded tile by tile in registers (dequantize.dequant_tile) and rounded to x's dtype before
the dot, as qgemm's kernels do; with act-order each expert gathers x's columns through its own perm.
"""

from __future__ import annotations

from typing import Union

import torch
import triton
import triton.language as tl

from .common import exact_bf16_cast, fp32_dot, mma, round_to
from .dequantize import dequant_tile
from .packed_experts import PackedExperts, dequantize_experts_ref
from .silu_gate import silu_gate

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}  # the CPU interpreter: small tiles, fast


def default_config(num_slots: int, num_experts: int) -> dict:
    """Tiles by the mean slots per expert (vLLM's untuned defaults: few tokens per expert take 16-row blocks, so
    decode pads little). Not yet timed on a GPU: a tuned table per (E, N, GPU) is the next step."""
    if triton.knobs.runtime.interpret:
        return dict(INTERPRETER_CONFIG)
    if num_slots <= 16 * num_experts:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}


def align_block_size(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] (ids < num_experts) -> (slots int32 [S_pad], block_expert int32 [S_pad / block_m]).

    slots: the T*k slot ids grouped by expert (ascending expert, ascending slot within one), each expert's run
    padded with T*k to a multiple of block_m, then T*k to the end; S_pad = T*k + min(E, T*k) * (block_m - 1)
    rounded up to block_m is the most any routing needs, so the grid depends only on the shapes (no host sync).
    block_expert[b]: the expert of slots[b*block_m : (b+1)*block_m], -1 past the last run."""
    flat = experts.reshape(-1).long()  # [S]
    num_slots = flat.numel()
    dev = flat.device
    capacity = triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = padded.cumsum(0)  # [E]: expert e's padded run is [run_end[e] - padded[e], run_end[e])
    order = flat.argsort(stable=True)  # [S] slots by expert
    by_expert = flat[order]
    rank = torch.arange(num_slots, device=dev) - (counts.cumsum(0) - counts)[by_expert]  # position in its expert
    slots = torch.full((capacity,), num_slots, dtype=torch.int32, device=dev)
    slots[(run_end - padded)[by_expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=dev)
    block_expert = torch.searchsorted(run_end, block_start, right=True)  # first e whose run ends after the start
    return slots, torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)


@triton.jit
def _expert_gemm_kernel(
    a_ptr,  # rows [R, K]: x [T, H] (row = slot // ROW_DIV with ROW_DIV = k) or act [T*k, I] (ROW_DIV = 1)
    w_ptr,  # float: [E, N, K], K contiguous; PACKED: qweight int32 [E, KW, N] (packed_experts.py)
    s_ptr, z_ptr, perm_ptr,  # PACKED: scales fp16 / zeros uint8 [E, G, N]; perm int32 [E, K] (when HAS_PERM)
    out_ptr,  # [T*k, N], row = slot
    rw_ptr,  # routing weights [T*k] (read when MUL_WEIGHT)
    slots_ptr, block_expert_ptr,  # align_block_size's int32 [S_pad], [S_pad / BLOCK_M]
    N, K, num_slots, stride_am, stride_om,
    stride_we, stride_wr,  # weight: expert stride; row stride (float: between n; PACKED: between packed rows)
    stride_se, stride_sg, stride_pe,  # PACKED: scales/zeros expert and group strides; perm expert stride
    ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP32_DOT: tl.constexpr, IEEE: tl.constexpr,
    EXACT_BF16: tl.constexpr, PACKED: tl.constexpr, BITS: tl.constexpr, GROUP_K: tl.constexpr, SYM: tl.constexpr,
    HAS_PERM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # program (pid_m, pid_n): sorted slots [pid_m*BM, +BM) of one expert x output columns [pid_n*BN, +BN)
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    slot = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    valid = slot < num_slots  # padding holds num_slots
    row = slot // ROW_DIV
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_n = offs_n < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK] (PACKED: packed rows)
        mask_k = offs_k < K
        if HAS_PERM:
            cols = tl.load(perm_ptr + expert * stride_pe + offs_k, mask=mask_k, other=0)  # [BK] x columns
        else:
            cols = offs_k
        a = tl.load(a_ptr + row[:, None] * stride_am + cols[None, :], mask=valid[:, None] & mask_k[None, :],
                    other=0.0)  # [BM, BK]
        if PACKED:
            w = dequant_tile(w_base, s_ptr + expert * stride_se, z_ptr + expert * stride_se, k0, offs_n, K, N,
                             stride_wr, stride_sg, BITS, GROUP_K, SYM, BLOCK_K)  # [BK, BN] fp32
            w = round_to(w, a_ptr.dtype.element_ty, EXACT_BF16)  # the weight in x's dtype, as qgemm's kernels
        else:
            # w[e, n, k] at w_base + n * stride_wr + k, loaded as the [BK, BN] operand
            w = tl.load(w_base + offs_n[None, :] * stride_wr + offs_k[:, None],
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")  # fp32: no tf32 rounding
        else:
            acc = mma(a, w, acc, FP32_DOT)
    y = round_to(acc, out_ptr.dtype.element_ty, EXACT_BF16)  # rounded like the Linear's output
    if MUL_WEIGHT:
        rw = tl.load(rw_ptr + slot, mask=valid, other=0.0).to(tl.float32)
        y = round_to(y.to(tl.float32) * rw[:, None], out_ptr.dtype.element_ty, EXACT_BF16)
    tl.store(out_ptr + slot[:, None] * stride_om + offs_n[None, :], y, mask=valid[:, None] & mask_n[None, :])


ExpertWeights = Union[torch.Tensor, PackedExperts]  # float [E, N, K] or packed


def weight_shape(w: ExpertWeights) -> tuple[int, int, int]:
    """(E, N, K) of either kind."""
    if isinstance(w, PackedExperts):
        return w.num_experts, w.out_features, w.in_features
    return tuple(w.shape)


def weight_kernel_args(w: ExpertWeights) -> tuple[tuple, dict]:
    """(w, s, z, perm pointers; stride_we, stride_wr, stride_se, stride_sg, stride_pe) and the weight's constexprs."""
    if isinstance(w, PackedExperts):
        perm = w.perm if w.perm is not None else w.qweight
        args = (w.qweight, w.scales, w.zeros, perm, w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0),
                w.scales.stride(1), perm.stride(0))
        return args, dict(PACKED=True, BITS=w.bits, GROUP_K=w.group_k, SYM=w.sym, HAS_PERM=w.perm is not None)
    return (w, w, w, w, w.stride(0), w.stride(1), 0, 0, 0), dict(PACKED=False, BITS=4, GROUP_K=1, SYM=True,
                                                                HAS_PERM=False)


def expert_gemm(a: torch.Tensor, w: ExpertWeights, slots: torch.Tensor, block_expert: torch.Tensor,
                num_slots: int, row_div: int, config: dict, routing: torch.Tensor | None = None) -> torch.Tensor:
    """out [num_slots, N] in a.dtype: row s = a[s // row_div] @ w[e].T for the expert e of slot s's block (times
    routing[s] when given)."""
    _, n, k = weight_shape(w)
    out = torch.empty((num_slots, n), dtype=a.dtype, device=a.device)
    (wp, sp, zp, pp, *weight_strides), weight_meta = weight_kernel_args(w)
    grid = (block_expert.numel(), triton.cdiv(n, config["BLOCK_N"]))
    _expert_gemm_kernel[grid](
        a, wp, sp, zp, pp, out, routing if routing is not None else a, slots, block_expert,
        n, k, num_slots, a.stride(0), out.stride(0), *weight_strides,
        ROW_DIV=row_div, MUL_WEIGHT=routing is not None, FP32_DOT=fp32_dot(a.dtype),
        IEEE=a.dtype == torch.float32, EXACT_BF16=exact_bf16_cast(a.dtype), **weight_meta, **config,
    )
    return out


def check_weights(w: ExpertWeights, x: torch.Tensor, name: str) -> None:
    if isinstance(w, PackedExperts):
        p = 32 // w.bits
        e, n, k = weight_shape(w)
        assert w.qweight.dtype == torch.int32 and w.qweight.shape == (e, triton.cdiv(k, p), n), f"{name} qweight"
        assert w.scales.dtype == torch.float16 and w.zeros.dtype == torch.uint8, f"{name}: scales fp16, zeros uint8"
        assert w.scales.shape == w.zeros.shape and w.scales.stride() == w.zeros.stride(), f"{name} scales/zeros"
        assert w.qweight.stride(2) == w.scales.stride(2) == 1, f"{name}: N contiguous"
        assert w.perm is None or (w.perm.dtype == torch.int32 and w.perm.shape == (e, k)), f"{name} perm [E, K]"
        assert w.device == x.device, "one device"
    else:
        assert w.dtype == x.dtype and w.dim() == 3 and w.stride(2) == 1, f"{name}: [E, N, K] in x.dtype, K contiguous"
        assert w.device == x.device, "one device"


def check_inputs(x, w_gate_up, w_down, weights, experts) -> None:
    t, h = x.shape
    e, two_i, h2 = weight_shape(w_gate_up)
    assert x.dtype in FLOAT_DTYPES and x.stride(1) == 1, f"x must be fp16/bf16/fp32 [T, H], got {x.dtype}"
    check_weights(w_gate_up, x, "w_gate_up")
    check_weights(w_down, x, "w_down")
    assert h2 == h and two_i % 2 == 0, f"w_gate_up {(e, two_i, h2)} must be [E, 2I, {h}]"
    assert weight_shape(w_down) == (e, h, two_i // 2), f"w_down {weight_shape(w_down)} must be [{e}, {h}, {two_i // 2}]"
    assert experts.shape == weights.shape and experts.dim() == 2 and experts.shape[0] == t, "weights/experts [T, k]"
    assert not experts.is_floating_point() and weights.dtype in (torch.float32, x.dtype), "int experts, float weights"
    assert x.device == weights.device == experts.device, "one device"


def fused_moe(x: torch.Tensor, w_gate_up: ExpertWeights, w_down: ExpertWeights, weights: torch.Tensor,
              experts: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [T, H]; w_gate_up [E, 2I, H] (rows [0, I) gate, [I, 2I) up); w_down [E, H, I], each float in x.dtype or
    PackedExperts (W4/W8); weights [T, k] (fp32 or x.dtype) and experts [T, k] from MoE.select -> [T, H] in
    x.dtype. config: BLOCK_M/N/K (+ num_warps, num_stages), else default_config."""
    check_inputs(x, w_gate_up, w_down, weights, experts)
    t, k = experts.shape
    num_experts, _, inter = weight_shape(w_down)
    num_slots = t * k
    if num_slots == 0:
        return torch.zeros_like(x)
    config = config or default_config(num_slots, num_experts)
    slots, block_expert = align_block_size(experts, num_experts, config["BLOCK_M"])
    gate_up = expert_gemm(x, w_gate_up, slots, block_expert, num_slots, k, config)  # [T*k, 2I]
    act = silu_gate(gate_up[:, :inter], gate_up[:, inter:])  # [T*k, I]
    y = expert_gemm(act, w_down, slots, block_expert, num_slots, 1, config,
                    routing=weights.reshape(-1).contiguous())  # [T*k, H], weighted
    return y.view(t, k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


def fused_moe_ref(x, w_gate_up, w_down, weights, experts):
    """Pure torch `fused_moe`: each (token, choice) through its expert's gathered weights (packed ones dequantized
    and rounded to x.dtype, as the kernel does), fp32 products rounded where the kernels round."""
    w_gate_up, w_down = (dequantize_experts_ref(w).to(x.dtype) if isinstance(w, PackedExperts) else w
                         for w in (w_gate_up, w_down))
    inter = w_down.shape[2]
    gate_up = (w_gate_up[experts].float() @ x.float()[:, None, :, None]).squeeze(-1).to(x.dtype)  # [T, k, 2I]
    act = torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]  # [T, k, I]
    y = (w_down[experts].float() @ act.float()[..., None]).squeeze(-1).to(x.dtype)  # [T, k, H]
    y = (y.float() * weights.float()[..., None]).to(x.dtype)
    return y.sum(dim=1, dtype=torch.float32).to(x.dtype)

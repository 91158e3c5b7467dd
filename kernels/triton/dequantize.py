# dequantize - PackedWeight qweight int32 [ceil(K/p), N] -> w [K, N] (input-column order), fp16/bf16/fp32
"""Dequantize once (the large-M path: then one cuBLAS matmul), plus `dequant_tile3` / `dequant_tile`, the tile
decoder every dequant-GEMM kernel shares: each packed int32 word is loaded once (coalesced along N) and unpacked in
registers with p shifts, and a K tile inside one group loads that group's scales (and zeros) once.

W'[k, n] = scales[grp, n] * (code - zeros[grp, n]) with grp = packed row // group_k (repack.py's layout).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import mma
from .repack import PackedWeight


def tile_groups(block_k: int, group_k: int) -> int:
    """The groups a K tile of block_k packed rows spans on dequant_dot's exact-integer path: 1 (the tile lies inside
    one group), 2 (block_k == 2 * group_k), or 0: the tile scales each code and rounds the weight instead."""
    if group_k % block_k == 0:
        return 1
    return 2 if block_k == 2 * group_k else 0


# The dequant-matmul kernels' constexprs that follow from the launch's tiles (triton.heuristics: set after autotuning
# picks them): EVEN_K / EVEN_N, K / N multiples of BLOCK_K / BLOCK_N (no tile needs masks along them), and
# TILE_GROUPS (tile_groups)
TILE_FACTS = {"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
              "EVEN_N": lambda args: args["N"] % args["BLOCK_N"] == 0,
              "TILE_GROUPS": lambda args: tile_groups(args["BLOCK_K"], args["GROUP_K"])}


def min_block_k(bits: int) -> int:
    """The smallest K tile dequant_dot takes: 8 words, whose pairs of code positions make a 16-row operand (tl.dot's
    K >= 16)."""
    return 8 * (32 // bits)


@triton.jit
def tile_words(qw_ptr, k0, offs_n, K, N, stride_qw, BITS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """The words of packed rows [k0, k0 + BLOCK_K) x offs_n -> uint32 [BLOCK_K / P, BLOCK_N]: word (w, n) holds
    packed row k0 + w*P + j at bits [BITS*j, BITS*(j+1)); words past K are 0. Each is loaded once, coalesced along
    N, evict_first (weights are streamed once); unsigned, so the shifts that unpack it are logical. EVEN: the tile
    lies inside K and N, no mask (its compares and selects cost as much as the unpacking)."""
    P: tl.constexpr = 32 // BITS
    # word (w, n) at qw_ptr + w * stride_qw + n
    offs_w = k0 // P + tl.arange(0, BLOCK_K // P)  # [BKW]
    ptrs = qw_ptr + offs_w[:, None] * stride_qw + offs_n[None, :]
    if EVEN:
        words = tl.load(ptrs, eviction_policy="evict_first")
    else:
        words = tl.load(ptrs, mask=(offs_w * P < K)[:, None] & (offs_n < N)[None, :], other=0,
                        eviction_policy="evict_first")
    return words.to(tl.uint32, bitcast=True)


@triton.jit
def group_params(s_ptr, z_ptr, k0, rows, offs_n, K, N, stride_sg, BITS: tl.constexpr, GROUP_K: tl.constexpr,
                 SYM: tl.constexpr, ONE_GROUP: tl.constexpr, EVEN: tl.constexpr):
    """(zero, scale fp32) of packed rows `rows` [R] x offs_n: ONE_GROUP (the rows all lie in group k0 // GROUP_K)
    one [1, BN] row each, else gathered per row, [R, BN] (rows past K: scale 0, as is a group from k0 >= K; EVEN:
    none are, nor columns past N). zero: the constant 2^(BITS-1) when SYM, else the uint8 zeros."""
    mask_n = (offs_n < N) | EVEN
    if ONE_GROUP:
        offs = (k0 // GROUP_K) * stride_sg + offs_n[None, :]  # [1, BN]
        mask = (mask_n & ((k0 + 0 * offs_n < K) | EVEN))[None, :]  # a tensor compare: the interpreter mistypes
        # a vector mask & a scalar one
    else:
        offs = (rows // GROUP_K)[:, None] * stride_sg + offs_n[None, :]  # [R, BN]
        mask = ((rows < K) | EVEN)[:, None] & mask_n[None, :]
    scale = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SYM:
        zero = 1 << (BITS - 1)
    else:
        zero = tl.load(z_ptr + offs, mask=mask, other=0)
    return zero, scale


@triton.jit
def code_floats(codes, zero, SYM: tl.constexpr):
    """codes (uint32, < 2^23) - zero (group_params' zero) in fp32, exact, without an int -> float conversion per code
    (the CUDA guide's throughput table: 16 conversions per SM per clock on sm_80/sm_90, against 64-128 integer or
    fp32 operations; conversions, not weight bytes, set the speed of the first GPU kernels): the float whose bits
    are 0x4B000000 | code is 2^23 + code, and (2^23 + code) - (2^23 + zero) is exact; uint8 zeros are converted once
    per group row, not per code."""
    biased = (codes | 0x4B000000).to(tl.float32, bitcast=True)
    if SYM:
        values = biased - (8388608.0 + zero)
    else:
        values = biased - (zero.to(tl.float32) + 8388608.0)
    return values


@triton.jit
def position_values(words, j: tl.constexpr, zero, DTYPE: tl.constexpr, BITS: tl.constexpr, SYM: tl.constexpr):
    """Code position j of words [BKW, BN] (uint32; tile_words) minus zero (group_params' zero, broadcast against
    the words: [1, BN] or [BKW, BN]; the constant 2^(BITS-1) when SYM), exact, in DTYPE (fp32, fp16 or bf16).
    fp16 (and bf16 for 4-bit codes) by the same trick as code_floats with a 16-bit magic, two positions per shift
    and mask: (words >> BITS*i) & (MAXQ | MAXQ << 16) | MAGIC * 0x10001 is the half pair (BASE + code i,
    BASE + code i + P/2), i = j mod P/2 (fp16 0x6400 = 1024, codes < 1024; bf16 0x4300 = 128, codes < 128); the
    caller's unrolled loop over j computes each pair once. Other dtypes: code_floats, then a cast."""
    P: tl.constexpr = 32 // BITS
    MAXQ: tl.constexpr = (1 << BITS) - 1
    if DTYPE == tl.float16 or (DTYPE == tl.bfloat16 and BITS == 4):
        if DTYPE == tl.float16:
            MAGIC: tl.constexpr = 0x6400
            BASE: tl.constexpr = 1024.0
        else:
            MAGIC: tl.constexpr = 0x4300
            BASE: tl.constexpr = 128.0
        pair = ((words >> (BITS * (j % (P // 2)))) & (MAXQ | (MAXQ << 16))) | (MAGIC * 0x10001)
        if j < P // 2:
            biased = pair.to(tl.uint16).to(DTYPE, bitcast=True)
        else:
            biased = (pair >> 16).to(tl.uint16).to(DTYPE, bitcast=True)
        if SYM:  # `zero` unused: a constexpr keeps the subtraction in biased's dtype
            OFFSET: tl.constexpr = BASE + (1 << (BITS - 1))
            values = biased - OFFSET
        else:
            values = biased - (zero.to(tl.float32) + BASE).to(DTYPE)
    else:
        values = code_floats((words >> (BITS * j)) & MAXQ, zero, SYM).to(DTYPE)
    return values


@triton.jit
def dequant_tile3(
    qw_ptr, s_ptr, z_ptr,  # qweight int32 [KW, N]; scales fp16 [G, N]; zeros uint8 [G, N]
    k0, offs_n, K, N,  # tile start k0 (a multiple of BLOCK_K) and the tile's columns
    stride_qw, stride_sg,  # row strides of qweight and of scales/zeros (columns are contiguous)
    BITS: tl.constexpr, GROUP_K: tl.constexpr, SYM: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """-> W' fp32 [BLOCK_K / P, P, BLOCK_N]: element (w, j, n) is packed row k0 + w*P + j; rows >= K are 0 codes."""
    P: tl.constexpr = 32 // BITS
    MAXQ: tl.constexpr = (1 << BITS) - 1
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    words = tile_words(qw_ptr, k0, offs_n, K, N, stride_qw, BITS, BLOCK_K, False)  # [BKW, BN]
    shifts = tl.arange(0, P).to(tl.uint32) * BITS  # [P]
    codes = (words[:, None, :] >> shifts[None, :, None]) & MAXQ  # [BKW, P, BN]
    rows = k0 + tl.arange(0, BLOCK_K)  # [BK] = (w, j) flattened
    ONE_GROUP: tl.constexpr = GROUP_K % BLOCK_K == 0
    zero, scale = group_params(s_ptr, z_ptr, k0, rows, offs_n, K, N, stride_sg, BITS, GROUP_K, SYM, ONE_GROUP, False)
    G: tl.constexpr = 1 if ONE_GROUP else BLOCK_K // P
    GP: tl.constexpr = 1 if ONE_GROUP else P
    if not SYM:
        zero = tl.reshape(zero, (G, GP, BLOCK_N))
    return code_floats(codes, zero, SYM) * tl.reshape(scale, (G, GP, BLOCK_N))


@triton.jit
def dequant_tile(
    qw_ptr, s_ptr, z_ptr, k0, offs_n, K, N, stride_qw, stride_sg,
    BITS: tl.constexpr, GROUP_K: tl.constexpr, SYM: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dequant_tile3 as a 2D fp32 tile [BLOCK_K, BLOCK_N], row r = packed row k0 + r."""
    w = dequant_tile3(qw_ptr, s_ptr, z_ptr, k0, offs_n, K, N, stride_qw, stride_sg, BITS, GROUP_K, SYM, BLOCK_K)
    return tl.reshape(w, (BLOCK_K, offs_n.shape[0]))


@triton.jit
def interleave_rows(a, b):
    """a, b [R, C] -> [2R, C] with rows a[0], b[0], a[1], b[1], ...: for 16-bit a and b, the pairs one tensor-core
    operand register holds (two consecutive K rows of one column), so the dot takes it without a shuffle."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (2 * a.shape[0], a.shape[1]))


@triton.jit
def weight_mma(x, q, part, TRANSPOSED: tl.constexpr, FP32_DOT: tl.constexpr):
    """part + x [BM, K] @ q [K, BN] (fp32), or TRANSPOSED: part [BN, BM] + q.T @ x.T. With 64 rows sm_90 multiplies
    by warpgroup MMA, whose second operand comes from shared memory: the decoded weight as that operand costs a
    16-bit store per weight, as the first it stays in registers (bench/gpu_sass.py: 8.5 -> 6.6 instructions per
    weight); below 64 rows the plain order is the cheaper."""
    if TRANSPOSED:
        part = mma(tl.trans(q), tl.trans(x), part, FP32_DOT)
    else:
        part = mma(x, q, part, FP32_DOT)
    return part


@triton.jit
def as_rows(part, TRANSPOSED: tl.constexpr):
    """weight_mma's partial sums as [BM, BN]."""
    if TRANSPOSED:
        part = tl.trans(part)
    return part


@triton.jit
def split_pick(x, upper: tl.constexpr):
    """x [..., 2] -> x[..., upper] (tl.split, in registers)."""
    lower_half, upper_half = tl.split(x)
    if upper:
        return upper_half
    return lower_half


@triton.jit
def position_columns(x_tile, i: tl.constexpr):
    """x_tile [BM, BKW, 2, HALF] (HALF 2 or 4) -> x_tile[:, :, :, i] as [BM, 2 BKW], row-major over (word, half):
    the x columns of dequant_dot's operand rows for code positions (i, i + HALF), by splits in registers (a gather
    from memory per position, as the first kernels loaded them, waited out an L2 round trip four times a tile)."""
    BM: tl.constexpr = x_tile.shape[0]
    BKW: tl.constexpr = x_tile.shape[1]
    if x_tile.shape[3] == 4:  # i = 2 * high + low: split off the low bit, then the high one
        x = split_pick(split_pick(tl.reshape(x_tile, (BM, BKW, 2, 2, 2)), i % 2), i // 2)
    else:
        x = split_pick(x_tile, i)
    return tl.reshape(x, (BM, 2 * BKW))


@triton.jit
def dequant_dot(
    x_ptr, offs_m, mask_m, stride_xm,  # x [M, K] fp16/bf16 and the tile's rows offs_m [BM] (mask_m: < M)
    perm_ptr, acc,  # perm int32 [K] (read when HAS_PERM): x column of each packed row; acc [BM, BN] fp32
    qw_ptr, s_ptr, z_ptr, k0, offs_n, K, N, stride_qw, stride_sg,
    BITS: tl.constexpr, GROUP_K: tl.constexpr, SYM: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, TILE_GROUPS: tl.constexpr,
):
    """-> acc + x @ W'[packed rows k0 .. k0 + BLOCK_K, offs_n] on the tensor cores (fp32 accumulate),
    BLOCK_K >= min_block_k(BITS); EVEN_K / EVEN_N: K / N are multiples of the tile (no masks along them);
    TILE_GROUPS: tile_groups(BLOCK_K, GROUP_K).

    One dot per pair of code positions (i, i + P/2) of the tile's [BLOCK_K / P, BN] words: operand row r = 2w + h
    is packed row k0 + w*P + i + h*P/2, against x's matching columns [BM, 2 * BLOCK_K / P] (without HAS_PERM split
    from one contiguous load of x's [BM, BLOCK_K] tile, position_columns; with it gathered). The two positions come
    from one shift and mask (position_values) and sit side by side as the tensor cores read them (interleave_rows),
    so the decoded weight never goes through shared memory (the [BK/P, P, BN] -> [BK, BN] reshape of the first
    kernels did, one 16-bit store per weight). A tile inside one group, or across two (TILE_GROUPS 2: its first half
    of words in one, the second in the next; x's columns of the other half are zeroed for each group's
    dot), multiplies x by the exact integers code - MID (sym's zero 2^(BITS-1); not SYM, (zero - MID) * sum(x) is
    taken off after, the row sums of x in fp32 once per position) and scales each group's [BM, BN] sum by its row
    once (the first kernels summed x by a second dot per position, and Triton 3.6 then left x, used by two dots, out
    of its pipeline: bench/gpu_sass.py; subtracting each zero from the interleaved operand cost 1.1-1.8 instructions
    a weight more, in byte permutes). Any other tile scales each code by its word's group (GROUP_K % P == 0: a word
    never straddles groups) and rounds W' to x's dtype once, as (code - zero) * scale in fp32 would."""
    P: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = P // 2
    BKW: tl.constexpr = BLOCK_K // P
    TWO: tl.constexpr = TILE_GROUPS == 2
    EXACT: tl.constexpr = TILE_GROUPS > 0
    BLOCK_M: tl.constexpr = offs_m.shape[0]
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    TRANSPOSED: tl.constexpr = BLOCK_M >= 64  # weight_mma; the partial sums are [BN, BM] then
    PART_R: tl.constexpr = BLOCK_N if TRANSPOSED else BLOCK_M
    PART_C: tl.constexpr = BLOCK_M if TRANSPOSED else BLOCK_N
    # codes in x's dtype on the GPU; fp32 in the interpreter (its bf16 arithmetic works on the raw bits), and for
    # bf16 off the exact path (the scaled weight is rounded once, from fp32)
    if FP32_DOT or (x_ptr.dtype.element_ty == tl.bfloat16 and not EXACT):
        CODES: tl.constexpr = tl.float32
    else:
        CODES: tl.constexpr = x_ptr.dtype.element_ty
    words = tile_words(qw_ptr, k0, offs_n, K, N, stride_qw, BITS, BLOCK_K, EVEN_K and EVEN_N)  # [BKW, BN]
    offs_w = tl.arange(0, BKW)  # [BKW]
    offs_r = tl.arange(0, 2 * BKW)  # [2 BKW] operand rows: word r // 2, half r % 2
    if EXACT:
        # group rows [1, BN] of the tile's first group (and, TWO, its second); sums [PART_R, PART_C] per group
        zero0, scale0 = group_params(s_ptr, z_ptr, k0, offs_w, offs_n, K, N, stride_sg, BITS, GROUP_K, SYM, True,
                                     EVEN_N)
        part0 = tl.zeros((PART_R, PART_C), dtype=tl.float32)
        x_sum0 = tl.zeros((BLOCK_M,), dtype=tl.float32)  # not SYM: sum(x) of each row over the group's columns
        if TWO:
            zero1, scale1 = group_params(s_ptr, z_ptr, k0 + GROUP_K, offs_w, offs_n, K, N, stride_sg, BITS, GROUP_K,
                                         SYM, True, EVEN_N)
            part1 = tl.zeros((PART_R, PART_C), dtype=tl.float32)
            x_sum1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        in_first = (offs_r // 2 < BKW // 2)[None, :] | (not TWO)  # [1, 2 BKW]: x columns of the first group
        MID: tl.constexpr = 1 << (BITS - 1)  # sym's zero: the operands are code - MID (not SYM: corrected after)
    else:
        zero, scale = group_params(s_ptr, z_ptr, k0, k0 + offs_w * P, offs_n, K, N, stride_sg, BITS, GROUP_K, SYM,
                                   False, EVEN_K and EVEN_N)  # [BKW, BN]: the group of each word
        scale = scale.to(CODES)  # exact (fp16 scales)
        part = tl.zeros((PART_R, PART_C), dtype=tl.float32)
    # x (m, col) at x_ptr + m * stride_xm + col; evict_last: every column tile re-reads x
    if not HAS_PERM:  # the tile's columns in one contiguous load, split into positions in registers
        cols = k0 + tl.arange(0, BLOCK_K)  # [BK] = (w, h, i) flattened: packed row k0 + w*P + h*HALF + i
        x_tile = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                         mask=mask_m[:, None] & ((cols < K) | EVEN_K)[None, :], other=0.0,
                         eviction_policy="evict_last")  # [BM, BK]
        x_tile = tl.reshape(x_tile, (BLOCK_M, BKW, 2, HALF))
    for i in tl.static_range(HALF):
        if HAS_PERM:
            rows = k0 + (offs_r // 2) * P + i + (offs_r % 2) * HALF  # [2 BKW] packed row of each operand row
            mask_k = (rows < K) | EVEN_K
            cols = tl.load(perm_ptr + rows, mask=mask_k, other=0)  # x column of each packed row
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0, eviction_policy="evict_last")  # [BM, 2 BKW]
        else:
            x = position_columns(x_tile, i)
        if EXACT:
            q = interleave_rows(position_values(words, i, MID, CODES, BITS, True),
                                position_values(words, i + HALF, MID, CODES, BITS, True))  # [2 BKW, BN]
            x0 = tl.where(in_first, x, 0.0)
            part0 = weight_mma(x0, q, part0, TRANSPOSED, FP32_DOT)
            if not SYM:
                x_sum0 += tl.sum(x0.to(tl.float32), axis=1)
            if TWO:
                x1 = tl.where(in_first, 0.0, x)
                part1 = weight_mma(x1, q, part1, TRANSPOSED, FP32_DOT)
                if not SYM:
                    x_sum1 += tl.sum(x1.to(tl.float32), axis=1)
        else:
            w = interleave_rows(position_values(words, i, zero, CODES, BITS, SYM) * scale,
                                position_values(words, i + HALF, zero, CODES, BITS, SYM) * scale)
            part = weight_mma(x, w.to(x.dtype), part, TRANSPOSED, FP32_DOT)
    if EXACT:
        part = as_rows(part0, TRANSPOSED)
        if not SYM:
            part -= x_sum0[:, None] * (zero0.to(tl.float32) - MID)
        acc += part * scale0
        if TWO:
            part = as_rows(part1, TRANSPOSED)
            if not SYM:
                part -= x_sum1[:, None] * (zero1.to(tl.float32) - MID)
            acc += part * scale1
    else:
        acc += as_rows(part, TRANSPOSED)
    return acc


@triton.jit
def _dequantize_kernel(
    qw_ptr, s_ptr, z_ptr,
    perm_ptr,  # int32 [K]: packed row k -> input column (read only when HAS_PERM)
    out_ptr,  # [K, N] output dtype, column stride 1
    K, N, stride_qw, stride_sg, stride_ok,
    BITS: tl.constexpr, GROUP_K: tl.constexpr, SYM: tl.constexpr, HAS_PERM: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # program (pid_k, pid_n) decodes packed rows [pid_k*BLOCK_K, +BLOCK_K) x columns [pid_n*BLOCK_N, +BLOCK_N)
    k0 = tl.program_id(0) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = dequant_tile(qw_ptr, s_ptr, z_ptr, k0, offs_n, K, N, stride_qw, stride_sg, BITS, GROUP_K, SYM, BLOCK_K)
    mask_k = offs_k < K
    if HAS_PERM:
        rows = tl.load(perm_ptr + offs_k, mask=mask_k, other=0)  # [BK] scatter packed rows back to input order
    else:
        rows = offs_k
    # out (row, n) at out_ptr + row * stride_ok + n: each row segment of BLOCK_N stays contiguous
    tl.store(out_ptr + rows[:, None] * stride_ok + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=mask_k[:, None] & (offs_n < N)[None, :])


def check_packed(pw: PackedWeight) -> None:
    """The launchers' shared assertions on a PackedWeight."""
    k, n, p = pw.in_features, pw.out_features, pw.pack_factor
    assert pw.qweight.dtype == torch.int32 and tuple(pw.qweight.shape) == (triton.cdiv(k, p), n), "qweight shape"
    assert pw.qweight.stride(1) == 1 and pw.scales.stride(1) == 1 and pw.zeros.stride(1) == 1, "N must be contiguous"
    assert pw.scales.dtype == torch.float16 and pw.zeros.dtype == torch.uint8, "scales fp16, zeros uint8"
    assert pw.scales.shape == pw.zeros.shape and pw.scales.shape[1] == n, "scales/zeros [G, N]"
    assert pw.scales.stride(0) == pw.zeros.stride(0), "scales and zeros share one row stride"
    assert pw.perm is None or (pw.perm.dtype == torch.int32 and tuple(pw.perm.shape) == (k,)), "perm int32 [K]"
    assert pw.group_k % p == 0, f"group of {pw.group_k} packed rows: a word's {p} codes must share one group"


def check_matmul_inputs(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None) -> None:
    """The dequant-GEMM launchers' shared assertions: x [M, K] fp16/bf16 rows, optional bias [N] in x.dtype."""
    check_packed(pw)
    m, k = x.shape
    assert k == pw.in_features, f"x has K={k}, weight has K={pw.in_features}"
    assert x.dtype in (torch.float16, torch.bfloat16) and x.stride(1) == 1, "x fp16/bf16 with column stride 1"
    assert x.device == pw.device, "x and weight on one device"
    n = pw.out_features
    assert bias is None or (bias.dtype == x.dtype and tuple(bias.shape) == (n,) and bias.stride(0) == 1), "bias [N]"


# The dequant-matmul kernels' (dequant_gemm, dequant_gemv) arguments, in this order:
#   x_ptr     [M, K] fp16/bf16, column stride stride_xm between rows, 1 between columns
#   qw_ptr, s_ptr, z_ptr   PackedWeight qweight int32 [KW, N], scales fp16 [G, N], zeros uint8 [G, N] (weight_args)
#   perm_ptr  int32 [K]: x column of packed row k (read only when HAS_PERM)
#   bias_ptr  [N] x.dtype (read only when HAS_BIAS)
#   out_ptr   [M, N] x.dtype, row stride stride_om, column stride 1
#   M, N, K, M_BUCKET (an autotune key only), stride_xm, stride_om, stride_qw, stride_sg (weight strides)
#   BITS, GROUP_K, SYM, HAS_PERM (weight_meta), HAS_BIAS, FP32_DOT (common.fp32_dot), then each kernel's tiles,
#   then EVEN_K, EVEN_N, TILE_GROUPS (TILE_FACTS)
def weight_args(pw: PackedWeight) -> tuple:
    """(qweight, scales, zeros, perm) kernel pointers; a dummy for perm when there is none (HAS_PERM=False)."""
    return pw.qweight, pw.scales, pw.zeros, pw.perm if pw.perm is not None else pw.qweight


def weight_meta(pw: PackedWeight) -> dict:
    """The weight's constexprs: BITS, GROUP_K, SYM, HAS_PERM."""
    return dict(BITS=pw.bits, GROUP_K=pw.group_k, SYM=pw.sym, HAS_PERM=pw.perm is not None)


def dequantize(pw: PackedWeight, dtype: torch.dtype = torch.float16, block_k: int = 64, block_n: int = 128
               ) -> torch.Tensor:
    """-> W' transposed, [K, N] in `dtype`, rows in input-column order (x @ result == x @ W'.T)."""
    check_packed(pw)
    assert dtype in (torch.float16, torch.bfloat16, torch.float32), f"dtype {dtype}"
    k, n = pw.in_features, pw.out_features
    out = torch.empty((k, n), dtype=dtype, device=pw.device)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _dequantize_kernel[grid](
        *weight_args(pw), out, k, n, pw.qweight.stride(0), pw.scales.stride(0), out.stride(0),
        **weight_meta(pw), BLOCK_K=block_k, BLOCK_N=block_n,
    )
    return out


def dequantize_ref(pw: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure-torch `dequantize` from the packed layout: unpack words, apply group scales/zeros, undo perm."""
    k, n, p, bits = pw.in_features, pw.out_features, pw.pack_factor, pw.bits
    shifts = torch.arange(p, device=pw.device, dtype=torch.int64) * bits
    words = pw.qweight.to(torch.int64) & 0xFFFFFFFF  # [KW, N] unsigned
    codes = ((words[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)).reshape(-1, n)[:k]  # [K, N]
    grp = torch.arange(k, device=pw.device) // pw.group_k  # [K] group of each packed row
    zeros = torch.full_like(pw.scales, 1 << (bits - 1), dtype=torch.float32) if pw.sym else pw.zeros.float()
    w = pw.scales.float()[grp] * (codes.float() - zeros[grp])  # [K, N] packed-row order
    if pw.perm is not None:
        w = torch.empty_like(w).index_copy_(0, pw.perm.to(torch.int64), w)  # row perm[k] <- packed row k
    return w.to(dtype)


def dequant_matmul_ref(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch x [M, K] @ W'.T (+ bias) in fp32 from the packed layout, cast to x.dtype: every GEMM's reference."""
    y = x.float() @ dequantize_ref(pw)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)

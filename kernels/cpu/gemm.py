"""AMX GEMMs for CPU serving (C, compiled once by cpu_build): y = x @ W^T with x and y bf16, fp32 accumulation.
One tile loop serves the bf16 weights of PackedLinear and QLinear's W4/W8 codes, dequantized per column block.

Weight layout ("VNNI", what TDPBF16PS takes as its B tile): 16 output columns per block,
  bf16   uint32 [N/16, K/2, 16]   element [b, r, n] = bf16 W[16b + n, 2r] | W[16b + n, 2r + 1] << 16
so one 16 x 32 slice of K is one contiguous 1 KiB tile. Quantized weights (`pack_quantized`):
  codes  4-bit: uint8  [N/16, K/2, 16]  byte = q[n, 2r] | q[n, 2r + 1] << 4
         8-bit: uint16 [N/16, K/2, 16]  q[n, 2r] | q[n, 2r + 1] << 8
  qparams fp32 [N/16, G, 2, 16]         (scale, zero) per column of the block and group
dequantized to the bf16 layout (w = s * (q - z) in fp32, rounded to bf16 exactly as `dequantize(qt, bfloat16)`).
Needs N % 16 == 0 and K % 32 == 0 (and an even group size): the pack functions return None otherwise.

Tiling: a pass computes 32 rows x 32 columns in four fp32 accumulator tiles (two x row tiles times two weight
blocks: four tile loads per four TDPBF16PS; 1.5x oneDNN's bf16 matmul at 64 rows on SmolLM2's shapes). Threads
split the column-block pairs; rows go in chunks of M_CHUNK so a chunk of x stays in L2 while the weights stream
past it. A last partial row tile (M % 16 rows) is read from a zero-padded copy. The quantized GEMM dequantizes a
pair of column blocks into an L2 buffer and runs all rows on it (`qgemm`, decode-sized M); above _FUSED_MAX_M rows
the whole weight is dequantized once into a per-thread scratch and the bf16 GEMM runs on that.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from quantkit.kernels.cpu.build import C_AMX, C_DTYPES, C_SILU, load_library

C_SOURCE = C_DTYPES + C_SILU + C_AMX + r"""
#include <stdlib.h>

#define M_CHUNK 128  /* rows of x per pass over the weight; a multiple of 32 */

/* x's last M % 16 rows, zero-padded to a [16, K] row tile (NULL when M % 16 == 0); the caller frees it */
static uint16_t* pad_tail(const uint16_t* x, int M, int K) {
  const int rows = M % 16;
  if (rows == 0) return NULL;
  uint16_t* pad = aligned_alloc(64, (size_t)16 * K * 2);
  memcpy(pad, x + (int64_t)(M - rows) * K, (size_t)rows * K * 2);
  memset(pad + (int64_t)rows * K, 0, (size_t)(16 - rows) * K * 2);
  return pad;
}

/* y[m_begin:m_end, col:col + 16 nb] (row stride N) = x[m_begin:m_end] @ [b0 | b1]; b0, b1: VNNI blocks [K/2][16]
   of 16 columns each, nb = 1 (b0 only) or 2; m_begin % 32 == 0; row tiles past M / 16 full ones read xpad.
   act (nb = 2): y[:, col:col + 16] = silu(x @ b0) * (x @ b1) instead, each product rounded to bf16 first, as the
   unfused gate/up projections and cpu_fused's silu_mul compute it. */
static void amx_rows(const uint16_t* x, const uint16_t* xpad, int M, int K, int m_begin, int m_end,
                     const uint32_t* b0, const uint32_t* b1, int nb, uint16_t* y, int64_t N, int col, int act) {
  float c[4][256] __attribute__((aligned(64)));
  const int64_t xs = (int64_t)K * 2;
  const int full = M / 16;
  for (int m0 = m_begin; m0 < m_end; m0 += 32) {
    const int two = m0 + 16 < m_end;
    const uint16_t* a0 = m0 / 16 < full ? x + (int64_t)m0 * K : xpad;
    const uint16_t* a1 = m0 / 16 + 1 < full ? x + (int64_t)(m0 + 16) * K : xpad;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int k0 = 0; k0 < K; k0 += 32) {
      const int64_t off = (int64_t)(k0 / 2) * 16;
      _tile_loadd(6, b0 + off, 64);
      if (nb == 2) _tile_loadd(7, b1 + off, 64);
      _tile_loadd(4, a0 + k0, xs);
      _tile_dpbf16ps(0, 4, 6);
      if (nb == 2) _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, a1 + k0, xs);
        _tile_dpbf16ps(2, 5, 6);
        if (nb == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c[0], 64);
    if (nb == 2) _tile_stored(1, c[1], 64);
    if (two) { _tile_stored(2, c[2], 64); if (nb == 2) _tile_stored(3, c[3], 64); }
    for (int h = 0; h <= two; h++) {
      const int r0 = m0 + 16 * h, rows = M - r0 < 16 ? M - r0 : 16;
      for (int i = 0; i < rows; i++) {
        uint16_t* out = y + (int64_t)(r0 + i) * N + col;
        if (act) {
          const float* g = c[2 * h] + i * 16;
          const float* u = c[2 * h + 1] + i * 16;
          float v[16] __attribute__((aligned(64)));
          #pragma omp simd
          for (int j = 0; j < 16; j++)
            v[j] = silu_times(bf16_to_f32(f32_to_bf16(g[j])), bf16_to_f32(f32_to_bf16(u[j])));
          _mm256_storeu_si256((__m256i*)out, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(v)));
        } else if (nb == 2) {
          const __m512 lo = _mm512_load_ps(c[2 * h] + i * 16), hi = _mm512_load_ps(c[2 * h + 1] + i * 16);
          _mm512_storeu_si512((__m512i*)out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        } else {
          _mm256_storeu_si256((__m256i*)out, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c[2 * h] + i * 16)));
        }
      }
    }
  }
}

/* y [M, N] bf16 = x [M, K] bf16 @ W^T, W in the VNNI layout with `ws` uint32 from one block to the next; act: W's
   blocks alternate gate, up and y [M, N / 2] = silu(gate) * up */
void gemm_bf16(const uint16_t* x, int M, int K, const uint32_t* w, int64_t ws, int N, uint16_t* y, int threads,
               int act) {
  const int nblocks = N / 16, pairs = (nblocks + 1) / 2;
  const int64_t yn = act ? N / 2 : N;
  uint16_t* xpad = pad_tail(x, M, K);
  #pragma omp parallel num_threads(threads)
  {
    tiles_on();
    for (int mc = 0; mc < M; mc += M_CHUNK) {
      const int mend = mc + M_CHUNK < M ? mc + M_CHUNK : M;
      #pragma omp for schedule(static) nowait  /* the same pairs each chunk: their weights stay in L2 */
      for (int p = 0; p < pairs; p++) {
        const uint32_t* b0 = w + 2 * p * ws;
        const int nb = 2 * p + 1 < nblocks ? 2 : 1;
        amx_rows(x, xpad, M, K, mc, mend, b0, nb == 2 ? b0 + ws : b0, nb, y, yn, act ? 16 * p : 32 * p, act);
      }
    }
    _tile_release();
  }
  free(xpad);
}

/* one block's codes -> its VNNI block out [K/2][16] (bf16 of k = 2r in the low half, 2r + 1 in the high half) */
static void dequant_block(const void* codes, const float* qp, int K, int gs, int bits, uint32_t* out) {
  const int pairs_per_group = gs / 2;
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 s = _mm512_setzero_ps(), z = s;
  for (int r = 0; r < K / 2; r++) {
    if (r % pairs_per_group == 0) {
      const float* p = qp + (int64_t)(r / pairs_per_group) * 32;
      s = _mm512_loadu_ps(p);
      z = _mm512_loadu_ps(p + 16);
    }
    __m512i v, lo, hi;
    if (bits == 4) {
      v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)((const uint8_t*)codes + (int64_t)r * 16)));
      lo = _mm512_and_si512(v, _mm512_set1_epi32(15));
      hi = _mm512_srli_epi32(v, 4);
    } else {
      v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)codes + (int64_t)r * 16)));
      lo = _mm512_and_si512(v, _mm512_set1_epi32(255));
      hi = _mm512_srli_epi32(v, 8);
    }
    const __m512 wlo = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(lo), z), s);
    const __m512 whi = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(hi), z), s);
    /* bf16 [wlo 0..15 | whi 0..15] -> pairs (wlo n, whi n) */
    const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(whi, wlo);
    _mm512_store_si512((__m512i*)(out + (int64_t)r * 16), _mm512_permutexvar_epi16(interleave, halves));
  }
}

/* the whole quantized weight (cs bytes of codes, qs floats of qparams from one block to the next) -> w in the
   bf16 VNNI layout, contiguous */
void dequant_vnni(const void* codes, int64_t cs, const float* qp, int64_t qs, int N, int K, int gs, int bits,
                  uint32_t* w, int threads) {
  const int64_t block = (int64_t)(K / 2) * 16;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int b = 0; b < N / 16; b++)
    dequant_block((const uint8_t*)codes + b * cs, qp + b * qs, K, gs, bits, w + b * block);
}

/* y = x [M, K] bf16 @ dequantize(W)^T (block strides and act as dequant_vnni and gemm_bf16): each pair of column
   blocks is dequantized into an L2 buffer, then every row of x runs on it */
void qgemm(const uint16_t* x, int M, int K, const void* codes, int64_t cs, const float* qp, int64_t qs, int N, int gs,
           int bits, uint16_t* y, int threads, int act) {
  const int nblocks = N / 16, pairs = (nblocks + 1) / 2;
  const int64_t block = (int64_t)(K / 2) * 16, yn = act ? N / 2 : N;
  uint16_t* xpad = pad_tail(x, M, K);
  #pragma omp parallel num_threads(threads)
  {
    tiles_on();
    uint32_t* buf = aligned_alloc(64, (size_t)block * 2 * 4);
    #pragma omp for schedule(static)
    for (int p = 0; p < pairs; p++) {
      const int nb = 2 * p + 1 < nblocks ? 2 : 1;
      for (int j = 0; j < nb; j++)
        dequant_block((const uint8_t*)codes + (2 * p + j) * cs, qp + (2 * p + j) * qs, K, gs, bits, buf + j * block);
      amx_rows(x, xpad, M, K, 0, M, buf, buf + block, nb, y, yn, act ? 16 * p : 32 * p, act);
    }
    free(buf);
    _tile_release();
  }
  free(xpad);
}
"""

_lib = None
_P, _INT, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SIGNATURES = {"gemm_bf16": [_P, _INT, _INT, _P, _I64, _INT, _P, _INT, _INT],
              "qgemm": [_P, _INT, _INT, _P, _I64, _P, _I64, _INT, _INT, _INT, _P, _INT, _INT],
              "dequant_vnni": [_P, _I64, _P, _I64, _INT, _INT, _INT, _INT, _P, _INT]}
# above this many rows the quantized GEMM dequantizes the whole weight once (per-pair dequantization in qgemm
# keeps the weight in L2 for decode-sized M; at prefill sizes x no longer fits beside it)
_FUSED_MAX_M = 256


def _library():
    """The compiled kernels, or None without AMX (CPU, kernel permission or compiler)."""
    global _lib
    if _lib is None:
        _lib = False
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line.split() for line in f if line.startswith("flags")), [])
        except OSError:
            flags = []
        if "amx_bf16" in flags and "amx_tile" in flags:
            lib = load_library("cpu_gemm_amx", C_SOURCE, SIGNATURES)
            if lib is not None and lib.amx_ready():
                _lib = lib
    return _lib or None


def available() -> bool:
    return _library() is not None


def _column_pairs(t: torch.Tensor) -> torch.Tensor:
    """t [N, K] -> the VNNI order as a view [N/16, K/2, 16, 2]: element [b, r, n, j] = t[16b + n, 2r + j]."""
    n, k = t.shape
    return t.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3)


def pack_bf16(w: torch.Tensor):
    """w [N, K] bf16 -> the VNNI layout int32 [N/16, K/2, 16] (bit patterns), or None when N % 16 or K % 32."""
    n, k = w.shape
    if n % 16 or k % 32:
        return None
    pairs = _column_pairs(w.detach().contiguous().view(torch.int16)).contiguous()  # [N/16, K/2, 16, 2]
    return pairs.view(torch.int32).view(n // 16, k // 2, 16)


def unpack_bf16(packed: torch.Tensor) -> torch.Tensor:
    """The VNNI layout back to bf16 [N, K] (pack_bf16's inverse)."""
    blocks, half, _ = packed.shape
    pairs = packed.view(torch.int16).view(blocks, half, 16, 2).permute(0, 2, 1, 3)
    return pairs.reshape(blocks * 16, half * 2).view(torch.bfloat16)


def _out_columns(n: int, act: bool) -> int:
    if act and n % 32:
        raise ValueError("act needs gate and up blocks in pairs")
    return n // 2 if act else n


def matmul_bf16(x: torch.Tensor, packed: torch.Tensor, act: bool = False) -> torch.Tensor:
    """x [M, K] bf16 (contiguous) -> [M, N] bf16 with a pack_bf16 weight (or a view of whole blocks of one). act:
    the blocks alternate gate and up, and the result is silu(gate) * up [M, N / 2]."""
    m, k = x.shape
    n = packed.shape[0] * 16
    y = torch.empty(m, _out_columns(n, act), dtype=torch.bfloat16)
    _library().gemm_bf16(x.data_ptr(), m, k, packed.data_ptr(), packed.stride(0), n, y.data_ptr(),
                         torch.get_num_threads(), act)
    return y


def pack_quantized(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, gs: int):
    """codes uint8 [N, K] in contiguous groups of gs columns (K for per-channel), scales/zeros [N, G] -> (codes,
    qparams, gs) in the kernel's layout, or None when the shape does not fit (N % 16, K % 32, odd group size)."""
    n, k = codes.shape
    if n % 16 or k % 32 or gs % 2 or k % gs or bits not in (4, 8):
        return None
    pairs = _column_pairs(codes).to(torch.int32)
    if bits == 4:
        packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).contiguous()
    else:
        packed = (pairs[..., 0] | (pairs[..., 1] << 8)).to(torch.int16).contiguous()  # bit pattern of the uint16
    groups = scales.shape[1]
    qparams = torch.stack([scales.float().view(n // 16, 16, groups), zeros.float().view(n // 16, 16, groups)], dim=2)
    return packed, qparams.permute(0, 3, 2, 1).contiguous(), gs  # [N/16, G, 2, 16]


def _strides(packed) -> tuple[int, int]:
    """(bytes between code blocks, floats between qparam blocks) of a packed weight or a view of whole blocks."""
    codes, qparams, _ = packed
    return codes.stride(0) * codes.element_size(), qparams.stride(0)


def matmul_quantized(x: torch.Tensor, packed, bits: int, act: bool = False) -> torch.Tensor:
    """x [M, K] bf16 (contiguous) -> [M, N] bf16 with a pack_quantized weight (act as in matmul_bf16)."""
    codes, qparams, gs = packed
    m, k = x.shape
    if m > _FUSED_MAX_M:
        return matmul_bf16(x, dequantize_vnni(packed, bits), act)
    n = codes.shape[0] * 16
    y = torch.empty(m, _out_columns(n, act), dtype=torch.bfloat16)
    cs, qs = _strides(packed)
    _library().qgemm(x.data_ptr(), m, k, codes.data_ptr(), cs, qparams.data_ptr(), qs, n, gs, bits, y.data_ptr(),
                     torch.get_num_threads(), act)
    return y


def matmul_packed(x: torch.Tensor, perm: torch.Tensor | None, weight, bits: int, act: bool = False) -> torch.Tensor:
    """x [M, K] bf16 -> [M, N] bf16 through a packed weight: pack_bf16's (bits 16) or pack_quantized's (4, 8),
    whose act-order `perm` (or None) first puts x's columns into group order; act as in matmul_bf16."""
    if perm is not None:
        x = x.index_select(1, perm)
    x = x.contiguous()
    return matmul_bf16(x, weight, act) if bits == 16 else matmul_quantized(x, weight, bits, act)


_scratch = threading.local()  # per thread: one buffer reused by every layer's whole-weight dequantization


def dequantize_vnni(packed, bits: int) -> torch.Tensor:
    """The packed weight dequantized into the bf16 VNNI layout (unpack_bf16 of it is bit-identical to
    dequantize(qt, torch.bfloat16) of the packed columns). It lives in a per-thread scratch buffer (fresh pages
    cost more than the dequantization): use it before the next call on this thread."""
    codes, qparams, gs = packed
    blocks, half = codes.shape[0], codes.shape[1]
    size = blocks * half * 16
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < size:
        buf = _scratch.buf = torch.empty(size, dtype=torch.int32)
    w = buf[:size].view(blocks, half, 16)
    cs, qs = _strides(packed)
    _library().dequant_vnni(codes.data_ptr(), cs, qparams.data_ptr(), qs, blocks * 16, half * 2, gs, bits,
                            w.data_ptr(), torch.get_num_threads())
    return w

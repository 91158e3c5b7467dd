"""W4/W8 x bf16 GEMM on CPUs with AMX (C, compiled once by cpu_build): the dequantize-then-matmul of QLinear in
one pass, with the weight streamed at its packed size.

Per block of 16 output columns a thread dequantizes the block's weights (fp32 math, w = s * (q - z), rounded to
bf16 exactly as `dequantize(qt, bfloat16)` does) into an L2-resident buffer in AMX's pair-interleaved (VNNI)
layout, then runs TDPBF16PS over the rows of x, 64 at a time (four 16 x 16 fp32 accumulator tiles). torch's
packed int4 kernel is scalar-per-row (its cost grows linearly with M: ~6x a bf16 matmul at 64 rows); this one
costs one dequantization per call plus AMX matmul time, so it serves the batched rows of prefill and decode.

Packed layout, made once by `pack` from a QTensor with contiguous groups (QLinear permutes act-order columns):
  codes  4-bit: uint8  [N/16, K/2, 16]  byte = q[n, 2r] | q[n, 2r + 1] << 4
         8-bit: uint16 [N/16, K/2, 16]  q[n, 2r] | q[n, 2r + 1] << 8
  qparams fp32 [N/16, G, 2, 16]         (scale, zero) per column of the block and group
Needs N % 16 == 0, K % 32 == 0 and an even group size; `pack` returns None otherwise.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from quantkit.serve.cpu_build import load_library

C_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 when this process may use AMX tiles (asks Linux for the permission once) */
int amx_ready(void) {
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct { uint8_t palette; uint8_t start_row; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

/* the block's weights -> buf [K/2][16] uint32 pairs (bf16 of k = 2r in the low half, 2r + 1 in the high half) */
static void dequant_block(const void* codes, const float* qp, int K, int G, int gs, int bits, uint32_t* buf) {
  const int pairs_per_group = gs / 2;
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
    const __m512i blo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(wlo));
    const __m512i bhi = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(whi)), 16);
    _mm512_store_si512((__m512i*)(buf + (int64_t)r * 16), _mm512_or_si512(blo, bhi));
  }
}

/* fp32 [rows][16] tile -> bf16 y rows (stride N) */
static void store_rows(const float* c, int rows, uint16_t* y, int64_t N) {
  for (int i = 0; i < rows; i++)
    _mm256_storeu_si256((__m256i*)(y + i * N), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + i * 16)));
}

/* the whole weight -> w [N, K] bf16 row-major (for row counts where oneDNN's matmul on it is faster) */
void dequant_bf16(const void* codes, const float* qp, int N, int K, int G, int gs, int bits, uint32_t* w,
                  int threads) {
  const int64_t code_block = (int64_t)(K / 2) * 16 * (bits == 4 ? 1 : 2);
  #pragma omp parallel num_threads(threads)
  {
    uint32_t* buf = aligned_alloc(64, (size_t)K / 2 * 16 * 4);
    #pragma omp for schedule(static)
    for (int b = 0; b < N / 16; b++) {
      dequant_block((const uint8_t*)codes + b * code_block, qp + (int64_t)b * G * 32, K, G, gs, bits, buf);
      for (int n = 0; n < 16; n++) {  /* pair r of column n is the uint32 at w[n][2r] */
        uint32_t* row = w + (int64_t)(b * 16 + n) * (K / 2);
        for (int r = 0; r < K / 2; r++) row[r] = buf[(int64_t)r * 16 + n];
      }
    }
    free(buf);
  }
}

#define TDP(ct) _tile_dpbf16ps(ct, 4, 5)

/* y [M, N] bf16 = x [M, K] bf16 @ W^T; M % 16 == 0 (the caller pads), N % 16 == 0, K % 32 == 0 */
void qgemm_amx(const uint16_t* x, int M, int K, const void* codes, const float* qp, int N, int G, int gs, int bits,
               uint16_t* y, int threads) {
  const int nblocks = N / 16;
  const int64_t code_block = (int64_t)(K / 2) * 16 * (bits == 4 ? 1 : 2);  /* bytes per block of codes */
  #pragma omp parallel num_threads(threads)
  {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    uint32_t* buf = aligned_alloc(64, (size_t)K / 2 * 16 * 4);
    float c[64 * 16] __attribute__((aligned(64)));
    #pragma omp for schedule(static)
    for (int b = 0; b < nblocks; b++) {
      dequant_block((const uint8_t*)codes + b * code_block, qp + (int64_t)b * G * 32, K, G, gs, bits, buf);
      for (int m0 = 0; m0 < M; m0 += 64) {
        const int mt = (M - m0) / 16 < 4 ? (M - m0) / 16 : 4;
        const uint16_t* xa = x + (int64_t)m0 * K;
        const int64_t xs = (int64_t)K * 2;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int k0 = 0; k0 < K; k0 += 32) {
          _tile_loadd(5, buf + (int64_t)(k0 / 2) * 16, 64);
          _tile_loadd(4, xa + k0, xs); TDP(0);
          if (mt > 1) { _tile_loadd(4, xa + 16 * K + k0, xs); TDP(1); }
          if (mt > 2) { _tile_loadd(4, xa + 32 * K + k0, xs); TDP(2); }
          if (mt > 3) { _tile_loadd(4, xa + 48 * K + k0, xs); TDP(3); }
        }
        _tile_stored(0, c, 64);
        if (mt > 1) _tile_stored(1, c + 256, 64);
        if (mt > 2) _tile_stored(2, c + 512, 64);
        if (mt > 3) _tile_stored(3, c + 768, 64);
        store_rows(c, 16 * mt, y + (int64_t)m0 * N + b * 16, N);
      }
    }
    free(buf);
    _tile_release();
  }
}
"""

_lib = None
_P, _INT = ctypes.c_void_p, ctypes.c_int
SIGNATURES = {"qgemm_amx": [_P, _INT, _INT, _P, _P, _INT, _INT, _INT, _INT, _P, _INT],
              "dequant_bf16": [_P, _P, _INT, _INT, _INT, _INT, _INT, _P, _INT]}


def _library():
    """The compiled kernels (qgemm_amx, dequant_bf16), or None without AMX (CPU, kernel permission or compiler)."""
    global _lib
    if _lib is None:
        _lib = False
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line.split() for line in f if line.startswith("flags")), [])
        except OSError:
            flags = []
        if "amx_bf16" in flags and "amx_tile" in flags:
            lib = load_library("qgemm_amx", C_SOURCE, SIGNATURES)
            if lib is not None and lib.amx_ready():
                _lib = lib
    return _lib or None


def available() -> bool:
    return _library() is not None


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, gs: int):
    """codes uint8 [N, K] in contiguous groups of gs columns (K for per-channel), scales/zeros [N, G] -> (codes,
    qparams, gs) in the kernel's layout, or None when the shape does not fit (N % 16, K % 32, odd group size)."""
    n, k = codes.shape
    if n % 16 or k % 32 or gs % 2 or k % gs or bits not in (4, 8):
        return None
    pairs = codes.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).to(torch.int32)  # [N/16, K/2, 16, 2]
    if bits == 4:
        packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).contiguous()
    else:
        packed = (pairs[..., 0] | (pairs[..., 1] << 8)).to(torch.int16).contiguous()  # bit pattern of the uint16
    groups = scales.shape[1]
    qparams = torch.stack([scales.float().view(n // 16, 16, groups), zeros.float().view(n // 16, 16, groups)], dim=2)
    return packed, qparams.permute(0, 3, 2, 1).contiguous(), gs  # [N/16, G, 2, 16]


def matmul(x: torch.Tensor, packed, bits: int) -> torch.Tensor:
    """x [M, K] bf16 (contiguous) -> [M, N] bf16 with the packed weight."""
    codes, qparams, gs = packed
    m, k = x.shape
    n = codes.shape[0] * 16
    rows = -(-m // 16) * 16
    if rows != m:
        x = torch.cat([x, x.new_zeros(rows - m, k)])
    y = torch.empty(rows, n, dtype=torch.bfloat16)
    _library().qgemm_amx(x.data_ptr(), rows, k, codes.data_ptr(), qparams.data_ptr(), n, qparams.shape[1], gs, bits,
                         y.data_ptr(), torch.get_num_threads())
    return y[:m]


_scratch = threading.local()  # per thread: one bf16 buffer reused by every layer's dequantization


def dequantize_bf16(packed, bits: int) -> torch.Tensor:
    """The packed weight as bf16 [N, K], bit-identical to dequantize(qt, torch.bfloat16) of the packed columns.
    The result lives in a per-thread scratch buffer (fresh pages cost more than the dequantization): use it
    before the next call on this thread."""
    codes, qparams, gs = packed
    n, k = codes.shape[0] * 16, codes.shape[1] * 2
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n * k:
        buf = _scratch.buf = torch.empty(n * k, dtype=torch.bfloat16)
    w = buf[: n * k].view(n, k)
    _library().dequant_bf16(codes.data_ptr(), qparams.data_ptr(), n, k, qparams.shape[1], gs, bits, w.data_ptr(),
                            torch.get_num_threads())
    return w

/* AMX GEMMs of kernels/cpu/gemm.py (layouts and tiling in its docstring): y = x @ W^T, x and y bf16, W bf16 in
   the VNNI layout or W4/W8 codes dequantized per pair of column blocks; fp32 accumulation in the tiles. */
#include <omp.h>
#include <stdlib.h>

#include "amx.h"
#include "common.h"
#include "dequant.h"
#include "silu.h"

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

/* rows of y (row stride N) at col from fp32 tiles c0, c1 (row i at c + 16 i): act: silu(c0) * c1, each product
   rounded to bf16 first, as the unfused gate/up projections and fused.c's silu_mul compute it (16 columns); else
   c0 | c1 (nb 2, 32 columns) or c0 (nb 1, 16 columns), rounded to bf16 */
static void store_tiles(const float* c0, const float* c1, int nb, int rows, uint16_t* y, int64_t N, int col,
                        int act) {
  for (int i = 0; i < rows; i++) {
    uint16_t* out = y + (int64_t)i * N + col;
    if (act) {
      const float* g = c0 + i * 16;
      const float* u = c1 + i * 16;
      float v[16] __attribute__((aligned(64)));
      #pragma omp simd
      for (int j = 0; j < 16; j++) v[j] = silu_times_bf16(g[j], u[j]);
      _mm256_storeu_si256((__m256i*)out, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(v)));
    } else if (nb == 2) {
      const __m512 lo = _mm512_load_ps(c0 + i * 16), hi = _mm512_load_ps(c1 + i * 16);
      _mm512_storeu_si512((__m512i*)out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    } else {
      _mm256_storeu_si256((__m256i*)out, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c0 + i * 16)));
    }
  }
}

/* y[m_begin:m_end, col:col + 16 nb] (row stride N) = x[m_begin:m_end] @ [b0 | b1]; b0, b1: VNNI blocks [K/2][16]
   of 16 columns each, nb = 1 (b0 only) or 2; m_begin % 32 == 0; row tiles past M / 16 full ones read xpad.
   act (nb = 2): y[:, col:col + 16] = silu(x @ b0) * (x @ b1) instead (store_tiles). */
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
      const int r0 = m0 + 16 * h;
      store_tiles(c[2 * h], c[2 * h + 1], nb, M - r0 < 16 ? M - r0 : 16, y + (int64_t)r0 * N, N, col, act);
    }
  }
}

/* M <= 16 (one row tile, a: x or its padded copy): y[:, col:] from nb <= 4 consecutive weight blocks (b, ws uint32
   apart) in one pass over K, four weight streams in flight where amx_rows has two (a decode step streams its
   weights from memory). Each element's sum is amx_rows' own (the same TDPBF16PS over k0 in order into a zeroed
   tile), so the two agree bit for bit; act: the blocks alternate gate, up. */
static void amx_row_tile(const uint16_t* a, int M, int K, const uint32_t* b, int64_t ws, int nb, uint16_t* y,
                         int64_t N, int col, int act) {
  float c[4][256] __attribute__((aligned(64)));
  const int64_t as = (int64_t)K * 2;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int k0 = 0; k0 < K; k0 += 32) {
    const int64_t off = (int64_t)(k0 / 2) * 16;
    _tile_loadd(4, a + k0, as);
    _tile_loadd(5, b + off, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (nb > 1) { _tile_loadd(6, b + ws + off, 64); _tile_dpbf16ps(1, 4, 6); }
    if (nb > 2) { _tile_loadd(7, b + 2 * ws + off, 64); _tile_dpbf16ps(2, 4, 7); }
    if (nb > 3) { _tile_loadd(5, b + 3 * ws + off, 64); _tile_dpbf16ps(3, 4, 5); }
  }
  _tile_stored(0, c[0], 64);
  if (nb > 1) _tile_stored(1, c[1], 64);
  if (nb > 2) _tile_stored(2, c[2], 64);
  if (nb > 3) _tile_stored(3, c[3], 64);
  for (int h = 0; 2 * h < nb; h++)
    store_tiles(c[2 * h], c[2 * h + 1], nb - 2 * h > 1 ? 2 : 1, M, y, N, col + (act ? 16 : 32) * h, act);
}

/* y [M, N] bf16 = x [M, K] bf16 @ W^T, W in the VNNI layout with `ws` uint32 from one block to the next; act: W's
   blocks alternate gate, up and y [M, N / 2] = silu(gate) * up */
void gemm_bf16(const uint16_t* x, int M, int K, const uint32_t* w, int64_t ws, int N, uint16_t* y, int threads,
               int act) {
  const int nblocks = N / 16, pairs = (nblocks + 1) / 2;
  const int64_t yn = act ? N / 2 : N;
  if (M == 0) return;
  uint16_t* xpad = pad_tail(x, M, K);
  if (M <= 16) {  /* threads take consecutive pairs, two at a time: four blocks per pass */
    #pragma omp parallel num_threads(threads)
    {
      tiles_on();
      const int t = omp_get_thread_num(), nt = omp_get_num_threads(), end = pairs * (t + 1) / nt;
      for (int p = pairs * t / nt; p < end; p += 2) {
        const int left = nblocks - 2 * p, nb = p + 1 < end ? (left < 4 ? left : 4) : (left < 2 ? left : 2);
        amx_row_tile(xpad ? xpad : x, M, K, w + 2 * p * ws, ws, nb, y, yn, act ? 16 * p : 32 * p, act);
      }
      _tile_release();
    }
    free(xpad);
    return;
  }
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

/* the whole quantized weight (cs bytes of codes, qs fp16 of qparams from one block to the next) -> w in the
   bf16 VNNI layout, contiguous */
void dequant_vnni(const void* codes, int64_t cs, const uint16_t* qp, int64_t qs, int N, int K, int gs, int bits,
                  uint32_t* w, int threads) {
  const int64_t block = (int64_t)(K / 2) * 16;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int b = 0; b < N / 16; b++)
    dequant_block((const uint8_t*)codes + b * cs, qp + b * qs, K, gs, bits, w + b * block);
}

/* y = x [M, K] bf16 @ dequantize(W)^T (block strides and act as dequant_vnni and gemm_bf16): each pair of column
   blocks is dequantized into an L2 buffer, then every row of x runs on it */
void qgemm(const uint16_t* x, int M, int K, const void* codes, int64_t cs, const uint16_t* qp, int64_t qs, int N,
           int gs, int bits, uint16_t* y, int threads, int act) {
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

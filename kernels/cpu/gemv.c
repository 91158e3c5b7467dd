/* W4/W8 GEMV of kernels/cpu/gemv.py (layout and rounding in its docstring): y [M, N] bf16 = x [M, K] bf16 @
   dequantize(W)^T for M <= 4 rows, straight from gemm.py's packed codes (no second copy of the weight). A code q
   becomes the fp32 1 + q / U by bit operations (U = 16 for 4-bit, 256 for 8-bit: q's bits at the top of the
   mantissa of 1.0); fp32 FMAs with x sum them, and the scale and zero apply once per group:
   y = sum_g s * (U * acc_g - (U + z) * sum_g(x)),  acc_g = sum_{k in g} x * (1 + q / U). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"
#include "silu.h"

#define MAX_M 4
#define PREFETCH 2048  /* bytes ahead in each block's codes: streaming from memory, the hardware prefetcher
                          alone left 25-35% of one core's bandwidth unused (4096 x 4096, 48 copies: 7 -> 10 GB/s) */
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512BF16__)
/* y[m][j] (16 columns of block j, fp32) for rows m < M over the NB (1 or 2) blocks c[j] (codes [K/2][16]: per r,
   16 bytes (4-bit, byte n = q[n, 2r] | q[n, 2r + 1] << 4) or 16 words (8-bit, q[n, 2r] | q[n, 2r + 1] << 8)) with
   qparams q[j] ([G][2][16] fp16: scale, zero). xf: x in fp32 [M][K]; xsum [M][G] its sums over each group. Codes
   of even and odd k go to separate accumulators (two FMA chains per row and block). */
INLINE void block_rows(const int M, const int NB, const int bits, const float* xf, const float* xsum, int K, int gs,
                       const uint8_t* c0, const uint8_t* c1, const uint16_t* q0, const uint16_t* q1,
                       __m512 y[MAX_M][2]) {
  const int groups = K / gs, per_group = gs / 2;
  const uint8_t* c[2] = {c0, c1};
  const uint16_t* q[2] = {q0, q1};
  const int row_bytes = bits == 4 ? 16 : 32;  /* codes of one r in a block */
  const float unit = bits == 4 ? 16.f : 256.f;
  const __m512i one = _mm512_set1_epi32(0x3F800000);  /* fp32 1.0 */
  const __m512i mask = _mm512_set1_epi32(bits == 4 ? 0x00780000 : 0x007F8000);  /* mantissa bits 19-22 / 15-22 */
  for (int m = 0; m < M; m++)
    for (int j = 0; j < NB; j++) y[m][j] = _mm512_setzero_ps();
  for (int g = 0; g < groups; g++) {
    __m512 a[2][MAX_M][2];
    for (int h = 0; h < 2; h++)
      for (int m = 0; m < M; m++)
        for (int j = 0; j < NB; j++) a[h][m][j] = _mm512_setzero_ps();
    for (int r = g * per_group; r < (g + 1) * per_group; r++) {
      __m512 w[2][2];  /* [block][k parity]: 1 + q / U of the 16 columns */
      for (int j = 0; j < NB; j++) {
        if ((r * row_bytes) % 64 == 0) _mm_prefetch((const char*)c[j] + (int64_t)r * row_bytes + PREFETCH, _MM_HINT_T0);
        if (bits == 4) {  /* lane n = byte n: q[n, 2r] at bits 0-3 -> 19-22, q[n, 2r + 1] at 4-7 -> 19-22 */
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c[j] + (int64_t)r * 16)));
          w[j][0] = (__m512)_mm512_ternarylogic_epi32(_mm512_slli_epi32(v, 19), mask, one, 0xEA);  /* a & b | c */
          w[j][1] = (__m512)_mm512_ternarylogic_epi32(_mm512_slli_epi32(v, 15), mask, one, 0xEA);
        } else {  /* lane n = word n: q[n, 2r] at bits 0-7 -> 15-22, q[n, 2r + 1] at 8-15 -> 15-22 */
          const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(c[j] + (int64_t)r * 32)));
          w[j][0] = (__m512)_mm512_ternarylogic_epi32(_mm512_slli_epi32(v, 15), mask, one, 0xEA);
          w[j][1] = (__m512)_mm512_ternarylogic_epi32(_mm512_slli_epi32(v, 7), mask, one, 0xEA);
        }
      }
      for (int m = 0; m < M; m++) {
        const float* xr = xf + (int64_t)m * K + 2 * r;
        const __m512 x0 = _mm512_set1_ps(xr[0]), x1 = _mm512_set1_ps(xr[1]);
        for (int j = 0; j < NB; j++) {
          a[0][m][j] = _mm512_fmadd_ps(w[j][0], x0, a[0][m][j]);
          a[1][m][j] = _mm512_fmadd_ps(w[j][1], x1, a[1][m][j]);
        }
      }
    }
    for (int j = 0; j < NB; j++) {
      const uint16_t* qg = q[j] + (int64_t)g * 32;
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)qg));
      const __m512 zu = _mm512_add_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(qg + 16))),
                                      _mm512_set1_ps(unit));
      for (int m = 0; m < M; m++) {
        const __m512 t = _mm512_mul_ps(_mm512_add_ps(a[0][m][j], a[1][m][j]), _mm512_set1_ps(unit));
        const __m512 d = _mm512_fnmadd_ps(zu, _mm512_set1_ps(xsum[m * groups + g]), t);  /* U a - (U + z) X */
        y[m][j] = _mm512_fmadd_ps(s, d, y[m][j]);
      }
    }
  }
}

/* y rows m < M, columns col.. (row stride yn): NB blocks of 16 rounded to bf16, or with act the pair (gate, up)
   -> silu(bf16(gate)) * bf16(up), as gemm.c's epilogue and fused.c's silu_mul round */
INLINE void store_rows(const int M, const int NB, __m512 y[MAX_M][2], uint16_t* out, int64_t yn, int64_t col,
                       int act) {
  for (int m = 0; m < M; m++) {
    uint16_t* o = out + m * yn + col;
    if (act) {
      float g[16] __attribute__((aligned(64))), u[16] __attribute__((aligned(64))), v[16] __attribute__((aligned(64)));
      _mm512_store_ps(g, y[m][0]);
      _mm512_store_ps(u, y[m][1]);
      #pragma omp simd
      for (int i = 0; i < 16; i++) v[i] = silu_times_bf16(g[i], u[i]);
      _mm256_storeu_si256((__m256i*)o, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(v)));
    } else if (NB == 2) {
      _mm512_storeu_si512((__m512i*)o, (__m512i)_mm512_cvtne2ps_pbh(y[m][1], y[m][0]));
    } else {
      _mm256_storeu_si256((__m256i*)o, (__m256i)_mm512_cvtneps_pbh(y[m][0]));
    }
  }
}

/* one pair p of column blocks (2p, 2p + 1; a lone last block when nb is odd) for M rows */
INLINE void pair_rows(const int M, const int bits, const float* xf, const float* xsum, int K, int gs,
                      const uint8_t* codes, int64_t cs, const uint16_t* qp, int64_t qs, int nblocks, int p,
                      uint16_t* y, int64_t yn, int act) {
  __m512 acc[MAX_M][2];
  const int b = 2 * p;
  const uint8_t* c0 = codes + b * cs;
  const uint16_t* q0 = qp + b * qs;
  if (b + 1 < nblocks) {
    block_rows(M, 2, bits, xf, xsum, K, gs, c0, c0 + cs, q0, q0 + qs, acc);
    store_rows(M, 2, acc, y, yn, act ? 16 * p : 32 * p, act);
  } else {
    block_rows(M, 1, bits, xf, xsum, K, gs, c0, c0, q0, q0, acc);
    store_rows(M, 1, acc, y, yn, 32 * p, 0);
  }
}

#else
/* AVX2 + FMA + F16C: the AVX-512 build's arithmetic lane for lane (the same two FMA chains per column, the same
   group step), each 16-column block as two 8-lane halves, so the two builds give the same bits. */

/* fp32 y[m][16] of one 16-column block (codes c, qparams q as block_rows') for rows m < M */
INLINE void block16(const int M, const int bits, const float* xf, const float* xsum, int K, int gs, const uint8_t* c,
                    const uint16_t* q, float y[MAX_M][16]) {
  const int groups = K / gs, per_group = gs / 2;
  const int row_bytes = bits == 4 ? 16 : 32;
  const float unit = bits == 4 ? 16.f : 256.f;
  const __m256i one = _mm256_set1_epi32(0x3F800000);
  const __m256i mask = _mm256_set1_epi32(bits == 4 ? 0x00780000 : 0x007F8000);
  __m256 acc[MAX_M][2];
  for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int g = 0; g < groups; g++) {
    __m256 a[2][MAX_M][2];  /* [k parity][row][half] */
    for (int h = 0; h < 2; h++)
      for (int m = 0; m < M; m++) a[h][m][0] = a[h][m][1] = _mm256_setzero_ps();
    for (int r = g * per_group; r < (g + 1) * per_group; r++) {
      __m256 w[2][2];  /* [half][k parity]: 1 + q / U of 8 columns */
      if ((r * row_bytes) % 64 == 0) _mm_prefetch((const char*)c + (int64_t)r * row_bytes + PREFETCH, _MM_HINT_T0);
      if (bits == 4) {
        const __m128i bytes = _mm_loadu_si128((const __m128i*)(c + (int64_t)r * 16));
        const __m256i v[2] = {_mm256_cvtepu8_epi32(bytes), _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))};
        for (int h = 0; h < 2; h++) {
          w[h][0] = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(v[h], 19), mask), one));
          w[h][1] = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(v[h], 15), mask), one));
        }
      } else {
        const __m256i words = _mm256_loadu_si256((const __m256i*)(c + (int64_t)r * 32));
        const __m256i v[2] = {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(words)),
                              _mm256_cvtepu16_epi32(_mm256_extracti128_si256(words, 1))};
        for (int h = 0; h < 2; h++) {
          w[h][0] = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(v[h], 15), mask), one));
          w[h][1] = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(v[h], 7), mask), one));
        }
      }
      for (int m = 0; m < M; m++) {
        const float* xr = xf + (int64_t)m * K + 2 * r;
        const __m256 x0 = _mm256_broadcast_ss(xr), x1 = _mm256_broadcast_ss(xr + 1);
        for (int h = 0; h < 2; h++) {
          a[0][m][h] = _mm256_fmadd_ps(w[h][0], x0, a[0][m][h]);
          a[1][m][h] = _mm256_fmadd_ps(w[h][1], x1, a[1][m][h]);
        }
      }
    }
    const uint16_t* qg = q + (int64_t)g * 32;
    for (int h = 0; h < 2; h++) {
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(qg + 8 * h)));
      const __m256 zu = _mm256_add_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(qg + 16 + 8 * h))),
                                      _mm256_set1_ps(unit));
      for (int m = 0; m < M; m++) {
        const __m256 t = _mm256_mul_ps(_mm256_add_ps(a[0][m][h], a[1][m][h]), _mm256_set1_ps(unit));
        const __m256 d = _mm256_fnmadd_ps(zu, _mm256_set1_ps(xsum[m * groups + g]), t);
        acc[m][h] = _mm256_fmadd_ps(s, d, acc[m][h]);
      }
    }
  }
  for (int m = 0; m < M; m++) {
    _mm256_storeu_ps(y[m], acc[m][0]);
    _mm256_storeu_ps(y[m] + 8, acc[m][1]);
  }
}

/* one pair p of column blocks, as the AVX-512 pair_rows (the rounding in common.h's f32_to_bf16, nearest even) */
INLINE void pair_rows(const int M, const int bits, const float* xf, const float* xsum, int K, int gs,
                      const uint8_t* codes, int64_t cs, const uint16_t* qp, int64_t qs, int nblocks, int p,
                      uint16_t* y, int64_t yn, int act) {
  float v[2][MAX_M][16];
  const int b = 2 * p, nb = b + 1 < nblocks ? 2 : 1;
  for (int j = 0; j < nb; j++)
    block16(M, bits, xf, xsum, K, gs, codes + (b + j) * cs, qp + (b + j) * qs, v[j]);
  for (int m = 0; m < M; m++) {
    uint16_t* o = y + m * yn + (act ? 16 * p : 32 * p);
    if (act) {
      for (int c = 0; c < 16; c++)
        o[c] = f32_to_bf16(silu_times_bf16(v[0][m][c], v[1][m][c]));
      continue;
    }
    for (int j = 0; j < nb; j++)
      for (int c = 0; c < 16; c++) o[16 * j + c] = f32_to_bf16(v[j][m][c]);
  }
}
#endif

#define PAIR_CASE(MM, BITS) \
  case MM: pair_rows(MM, BITS, xf, xsum, K, gs, codes, cs, qp, qs, nblocks, p, y, yn, act); break;

/* y [M, N] bf16 (M <= 4) = x [M, K] bf16 @ dequantize(W)^T; W: N / 16 blocks, codes [K/2][16] (uint8 4-bit, uint16
   8-bit) cs bytes apart, qparams [K/gs][2][16] fp16 qs halves apart (gemm.py's pack_quantized, or a view of whole
   blocks of it). act: the blocks alternate gate, up and y [M, N / 2] = silu(gate) * up. Threads split the block
   pairs statically; the group sums of x are computed once, before. */
void qgemv(const uint16_t* x, int M, int K, const uint8_t* codes, int64_t cs, const uint16_t* qp, int64_t qs, int N,
           int gs, int bits, uint16_t* y, int threads, int act) {
  const int nblocks = N / 16, pairs = (nblocks + 1) / 2, groups = K / gs;
  const int64_t yn = act ? N / 2 : N;
  float* xf = malloc(sizeof(float) * ((size_t)M * K + (size_t)M * groups));  /* x [M][K], then xsum [M][G] */
  float* xsum = xf + (int64_t)M * K;
  for (int m = 0; m < M; m++)
    for (int g = 0; g < groups; g++) {
      float* xg = xf + (int64_t)m * K + (int64_t)g * gs;
      const uint16_t* src = x + (int64_t)m * K + (int64_t)g * gs;
      float sum = 0.f;
      #pragma omp simd reduction(+ : sum)
      for (int k = 0; k < gs; k++) {
        xg[k] = bf16_to_f32(src[k]);
        sum += xg[k];
      }
      xsum[m * groups + g] = sum;
    }
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int p = 0; p < pairs; p++) {
    if (bits == 4) {
      switch (M) { PAIR_CASE(1, 4) PAIR_CASE(2, 4) PAIR_CASE(3, 4) PAIR_CASE(4, 4) }
    } else {
      switch (M) { PAIR_CASE(1, 8) PAIR_CASE(2, 8) PAIR_CASE(3, 8) PAIR_CASE(4, 8) }
    }
  }
  free(xf);
}

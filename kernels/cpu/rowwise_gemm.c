/* Row-invariant bf16 GEMM of kernels/cpu/rowwise_gemm.py: y [M, N] bf16 = x [M, K] bf16 @ W^T (+ bias), W in
   gemm.py's VNNI layout (blocks of 16 columns [K/2][16], element [r][n] = W[n, 2r] | W[n, 2r + 1] << 16).

   Invariant: every y[m, n] is one fp32 chain that starts at 0 and takes the K/2 pairs r = 0, 1, ... in order
   (AVX-512 BF16: acc = dpbf16(acc, x[m, 2r..2r+1], W[n, 2r..2r+1]); AVX2 + FMA: two fused multiply-adds per pair,
   k = 2r then 2r + 1; elsewhere two rounded multiply-adds per pair),
   then adds bias[n] in fp32 and rounds to bf16 once (nearest even). Nothing in that chain depends on M, on which
   rows or columns share a register block, or on the thread: register blocks of MR rows x NR column blocks only
   decide which chains run side by side, threads split (column panel, row chunk) items, and K is never split. */
#include <stdlib.h>

#include "common.h"
#include "silu.h"

#define MR 4       /* rows per register block */
#define NR 4       /* 16-column blocks per register block (a panel): MR x NR accumulators */
#define M_CHUNK 64 /* rows per work item: a thread runs consecutive chunks of one panel, its weights in L2 */

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* 16 bf16 -> fp32 */
static inline __m512 bias16(const uint16_t* b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)b)), 16));
}

/* rows [m0, m0 + mr) x blocks [j0, j0 + nr) of the output. x32: x as K/2 uint32 pairs per row; wb: the panel's
   weight, its block j at wb + j * ws; act: blocks alternate gate, up (nr even) and y gets silu(bf16(gate)) *
   bf16(up) per pair. */
static inline __attribute__((always_inline)) void block(
    const int mr, const int nr, const uint32_t* x32, int K2, int m0, const uint32_t* wb, int64_t ws, int j0,
    const uint16_t* bias, uint16_t* y, int64_t yn, int act) {
  __m512 acc[MR][NR];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
  const uint32_t* xr = x32 + (int64_t)m0 * K2;
  for (int r = 0; r < K2; r++) {
    __m512bh wv[NR];
    for (int j = 0; j < nr; j++) wv[j] = (__m512bh)_mm512_loadu_si512(wb + j * ws + (int64_t)r * 16);
    for (int i = 0; i < mr; i++) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xr[(int64_t)i * K2 + r]);
      for (int j = 0; j < nr; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, wv[j]);
    }
  }
  for (int i = 0; i < mr; i++) {
    uint16_t* out = y + (int64_t)(m0 + i) * yn;
    if (act) {
      for (int j = 0; j < nr; j += 2) {
        float g[16] __attribute__((aligned(64))), u[16] __attribute__((aligned(64)));
        float v[16] __attribute__((aligned(64)));
        _mm512_store_ps(g, acc[i][j]);
        _mm512_store_ps(u, acc[i][j + 1]);
        #pragma omp simd
        for (int c = 0; c < 16; c++) v[c] = silu_times_bf16(g[c], u[c]);
        _mm256_storeu_si256((__m256i*)(out + 8 * (j0 + j)), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(v)));
      }
      continue;
    }
    for (int j = 0; j < nr; j++) {
      const int col = 16 * (j0 + j);
      const __m512 v = bias ? _mm512_add_ps(acc[i][j], bias16(bias + col)) : acc[i][j];
      _mm256_storeu_si256((__m256i*)(out + col), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

#define BLOCK_CASE(R, C) \
  case (R) * 8 + (C): block(R, C, x32, K2, m0, wb, ws, j0, bias, y, yn, act); break;

/* every (mr, nr) shape as its own constant-size instance: the accumulators stay in registers */
static void run_block(int mr, int nr, const uint32_t* x32, int K2, int m0, const uint32_t* wb, int64_t ws, int j0,
                      const uint16_t* bias, uint16_t* y, int64_t yn, int act) {
  switch (mr * 8 + nr) {
    BLOCK_CASE(4, 4) BLOCK_CASE(4, 3) BLOCK_CASE(4, 2) BLOCK_CASE(4, 1)
    BLOCK_CASE(3, 4) BLOCK_CASE(3, 3) BLOCK_CASE(3, 2) BLOCK_CASE(3, 1)
    BLOCK_CASE(2, 4) BLOCK_CASE(2, 3) BLOCK_CASE(2, 2) BLOCK_CASE(2, 1)
    BLOCK_CASE(1, 4) BLOCK_CASE(1, 3) BLOCK_CASE(1, 2) BLOCK_CASE(1, 1)
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "avx2.h"

/* acc[i][h] (columns 8h.. of the 16-column block wb) for rows i < mr of xf (fp32 [mr][K]) */
static inline __attribute__((always_inline)) void block16(const int mr, const float* xf, int K, const uint32_t* wb,
                                                          __m256 out[MR][2]) {
  __m256 acc[MR][2];  /* local, so the compiler keeps it in registers (an out-parameter was stored every pair) */
  for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int r = 0; r < K / 2; r++) {
    const __m256i v0 = _mm256_loadu_si256((const __m256i*)(wb + (int64_t)r * 16));
    const __m256i v1 = _mm256_loadu_si256((const __m256i*)(wb + (int64_t)r * 16 + 8));
    const __m256 e0 = even8(v0), o0 = odd8(v0), e1 = even8(v1), o1 = odd8(v1);
    for (int i = 0; i < mr; i++) {
      const __m256 x0 = _mm256_broadcast_ss(xf + (int64_t)i * K + 2 * r);
      const __m256 x1 = _mm256_broadcast_ss(xf + (int64_t)i * K + 2 * r + 1);
      acc[i][0] = _mm256_fmadd_ps(x1, o0, _mm256_fmadd_ps(x0, e0, acc[i][0]));
      acc[i][1] = _mm256_fmadd_ps(x1, o1, _mm256_fmadd_ps(x0, e1, acc[i][1]));
    }
  }
  for (int i = 0; i < mr; i++) out[i][0] = acc[i][0], out[i][1] = acc[i][1];
}

/* this thread's fp32 copy of up to MR rows of x: grown on demand, kept for the thread's life (MR * K floats) */
static _Thread_local float* row_scratch;
static _Thread_local int row_scratch_k;

static inline __attribute__((always_inline)) void block_avx2(
    const int mr, const int nr, const uint32_t* x32, int K2, int m0, const uint32_t* wb, int64_t ws, int j0,
    const uint16_t* bias, uint16_t* y, int64_t yn, int act) {
  const int K = 2 * K2;
  if (row_scratch_k < K) {
    free(row_scratch);
    row_scratch = aligned_alloc(32, sizeof(float) * MR * (size_t)K);
    row_scratch_k = K;
  }
  float* xf = row_scratch;
  const uint16_t* x = (const uint16_t*)(x32 + (int64_t)m0 * K2);
  for (int64_t e = 0; e < (int64_t)mr * K; e++) xf[e] = bf16_to_f32(x[e]);
  __m256 acc[MR][2], up[MR][2];
  for (int j = 0; j < nr; j += act ? 2 : 1) {
    block16(mr, xf, K, wb + (int64_t)j * ws, acc);
    if (act) block16(mr, xf, K, wb + (int64_t)(j + 1) * ws, up);
    for (int i = 0; i < mr; i++) {
      uint16_t* out = y + (int64_t)(m0 + i) * yn;
      if (act) {
        float g[16] __attribute__((aligned(32))), u[16] __attribute__((aligned(32)));
        _mm256_store_ps(g, acc[i][0]);
        _mm256_store_ps(g + 8, acc[i][1]);
        _mm256_store_ps(u, up[i][0]);
        _mm256_store_ps(u + 8, up[i][1]);
        for (int c = 0; c < 16; c++)
          out[8 * (j0 + j) + c] = f32_to_bf16(silu_times_bf16(g[c], u[c]));
        continue;
      }
      for (int h = 0; h < 2; h++) {
        const int col = 16 * (j0 + j) + 8 * h;
        __m256 v = acc[i][h];
        if (bias) v = _mm256_add_ps(v, even8(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(bias + col)))));
        _mm_storeu_si128((__m128i*)(out + col), bf16x8(v));
      }
    }
  }
}

#define BLOCK_CASE(R) \
  case R: block_avx2(R, nr, x32, K2, m0, wb, ws, j0, bias, y, yn, act); break;

/* every row count as its own constant-size instance: the accumulators stay in registers */
static void run_block(int mr, int nr, const uint32_t* x32, int K2, int m0, const uint32_t* wb, int64_t ws, int j0,
                      const uint16_t* bias, uint16_t* y, int64_t yn, int act) {
  switch (mr) { BLOCK_CASE(4) BLOCK_CASE(3) BLOCK_CASE(2) BLOCK_CASE(1) }
}
#else
/* portable: the same chain per element in plain C (gcc -std=c11 does not contract a * b + c, so each pair is two
   rounded multiply-adds in this order); vectorised over the 16 columns of a block, never over K */
static void run_block(int mr, int nr, const uint32_t* x32, int K2, int m0, const uint32_t* wb0, int64_t ws, int j0,
                      const uint16_t* bias, uint16_t* y, int64_t yn, int act) {
  for (int i = 0; i < mr; i++) {
    const uint32_t* xr = x32 + (int64_t)(m0 + i) * K2;
    uint16_t* out = y + (int64_t)(m0 + i) * yn;
    float acc[NR][16];
    for (int j = 0; j < nr; j++) {
      const uint32_t* wb = wb0 + (int64_t)j * ws;
      for (int c = 0; c < 16; c++) acc[j][c] = 0.f;
      for (int r = 0; r < K2; r++) {
        const float x0 = bf16_to_f32((uint16_t)xr[r]), x1 = bf16_to_f32((uint16_t)(xr[r] >> 16));
        #pragma omp simd
        for (int c = 0; c < 16; c++) {
          const uint32_t p = wb[(int64_t)r * 16 + c];
          acc[j][c] = acc[j][c] + x0 * bf16_to_f32((uint16_t)p);
          acc[j][c] = acc[j][c] + x1 * bf16_to_f32((uint16_t)(p >> 16));
        }
      }
    }
    for (int j = 0; j < nr; j += act ? 2 : 1)
      for (int c = 0; c < 16; c++) {
        if (act) {
          out[8 * (j0 + j) + c] = f32_to_bf16(silu_times_bf16(acc[j][c], acc[j + 1][c]));
        } else {
          const int col = 16 * (j0 + j) + c;
          out[col] = f32_to_bf16(bias ? acc[j][c] + bf16_to_f32(bias[col]) : acc[j][c]);
        }
      }
  }
}
#endif

/* which chain this build runs: 2 the AVX-512 BF16 kernel, 1 the AVX2 + FMA one, 0 the portable C one */
int rowwise_gemm_isa(void) {
#if defined(__AVX512BF16__)
  return 2;
#elif defined(__AVX2__) && defined(__FMA__)
  return 1;
#else
  return 0;
#endif
}

/* y [M, N] bf16 (act: [M, N / 2]) = x [M, K] bf16 @ W^T + bias; W: N / 16 VNNI blocks `ws` uint32 apart; bias bf16
   [N] or NULL (not with act); act: the blocks alternate gate, up (N / 16 even) and y = silu(gate) * up. */
void rowwise_gemm(const uint16_t* x, int M, int K, const uint32_t* w, int64_t ws, int N, const uint16_t* bias,
                  uint16_t* y, int threads, int act) {
  const int nblocks = N / 16, panels = (nblocks + NR - 1) / NR, chunks = (M + M_CHUNK - 1) / M_CHUNK;
  const int K2 = K / 2;
  const int64_t yn = act ? N / 2 : N;
  const uint32_t* x32 = (const uint32_t*)x;
  /* item = (panel, chunk), chunks of one panel consecutive: a static schedule keeps a thread on one panel */
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int item = 0; item < panels * chunks; item++) {
    const int p = item / chunks, c = item % chunks;
    const int j0 = p * NR, nr = nblocks - j0 < NR ? nblocks - j0 : NR;
    const int mend = (c + 1) * M_CHUNK < M ? (c + 1) * M_CHUNK : M;
    for (int m0 = c * M_CHUNK; m0 < mend; m0 += MR)
      run_block(mend - m0 < MR ? mend - m0 : MR, nr, x32, K2, m0, w + (int64_t)j0 * ws, ws, j0, bias, y, yn, act);
  }
}

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include "dequant.h"

/* y [M, N] bf16 (act: [M, N / 2]) = x [M, K] bf16 @ dequantize(W)^T, W in gemm.py's W4/W8 packing (N / 16 blocks,
   codes cs bytes and qparams qs fp16 apart): each panel of NR blocks is dequantized to bf16 once into a thread's
   buffer (L2), then every row runs on it through the chains above, so y is rowwise_gemm of the dequantized weight
   bit for bit, and row-invariant as it is. Threads split the panels. */
void rowwise_qgemm(const uint16_t* x, int M, int K, const void* codes, int64_t cs, const uint16_t* qp, int64_t qs,
                   int N, int gs, int bits, uint16_t* y, int threads, int act) {
  const int nblocks = N / 16, panels = (nblocks + NR - 1) / NR, K2 = K / 2;
  const int64_t block = (int64_t)K2 * 16, yn = act ? N / 2 : N;
  const uint32_t* x32 = (const uint32_t*)x;
  #pragma omp parallel num_threads(threads)
  {
    uint32_t* buf = aligned_alloc(64, (size_t)block * NR * 4);
    #pragma omp for schedule(static)
    for (int p = 0; p < panels; p++) {
      const int j0 = p * NR, nr = nblocks - j0 < NR ? nblocks - j0 : NR;
      for (int j = 0; j < nr; j++)
        dequant_block((const uint8_t*)codes + (j0 + j) * cs, qp + (j0 + j) * qs, K, gs, bits, buf + j * block);
      for (int m0 = 0; m0 < M; m0 += MR)
        run_block(M - m0 < MR ? M - m0 : MR, nr, x32, K2, m0, buf, block, j0, NULL, y, yn, act);
    }
    free(buf);
  }
}
#endif

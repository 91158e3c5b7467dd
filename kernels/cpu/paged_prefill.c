/* Paged prefill attention of kernels/cpu/paged_prefill.py (the scheme in its docstring): AMX tiles for Q K^T and
   P V, the softmax of each query block's whole score rows in fp32. */
#include <math.h>
#include <stdlib.h>

#include "amx.h"
#include "common.h"
#include "exp.h"

static inline int64_t cache_row(const int32_t* table, int t, int BS, int Hkv, int h, int D) {
  return (((int64_t)table[t / BS] * BS + t % BS) * Hkv + h) * D;
}

/* kt[(kb * D/2 + r) * 16 + n] = the bf16 pair K[16kb + n][2r, 2r + 1] (0 past L), for keys [0, Lp) */
static void pack_k(const uint16_t* kc, const int32_t* table, int L, int Lp, int h, int Hkv, int D, int BS,
                   uint32_t* kt) {
  for (int t = 0; t < Lp; t++) {
    uint32_t* dst = kt + (int64_t)(t / 16) * (D / 2) * 16 + t % 16;
    if (t < L) {
      const uint32_t* row = (const uint32_t*)(kc + cache_row(table, t, BS, Hkv, h, D));
      for (int r = 0; r < D / 2; r++) dst[r * 16] = row[r];
    } else {
      for (int r = 0; r < D / 2; r++) dst[r * 16] = 0;
    }
  }
}

/* vv[((kb * D/16 + c) * 16 + r) * 16 + n] = V[32kb + 2r][16c + n] | V[32kb + 2r + 1][16c + n] << 16 (0 past L) */
static void pack_v(const uint16_t* vc, const int32_t* table, int L, int Lp, int h, int Hkv, int D, int BS,
                   uint32_t* vv) {
  for (int t = 0; t < Lp; t += 2) {
    const uint16_t* a = t < L ? vc + cache_row(table, t, BS, Hkv, h, D) : NULL;
    const uint16_t* b = t + 1 < L ? vc + cache_row(table, t + 1, BS, Hkv, h, D) : NULL;
    const int kb = t / 32, r = (t % 32) / 2;
    for (int c = 0; c < D / 16; c++) {
      const __m512i zero = _mm512_setzero_si512();
      const __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + 16 * c))) : zero;
      const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(b + 16 * c))) : zero;
      _mm512_store_si512((__m512i*)(vv + (((int64_t)kb * (D / 16) + c) * 16 + r) * 16),
                         _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

/* S[:, 16kb : 16kb + 16] (row stride ls floats) = Q K^T for key blocks [0, nkb); Q's d chunks are in tiles 4.. */
#define QK_BLOCKS(NC)                                                                                  \
  for (int kb = 0; kb < nkb; kb++) {                                                                   \
    const uint32_t* kblk = kt + (int64_t)kb * (D / 2) * 16;                                            \
    _tile_zero(0);                                                                                      \
    _tile_loadd(1, kblk, 64); _tile_dpbf16ps(0, 4, 1);                                                  \
    _tile_loadd(1, kblk + 256, 64); _tile_dpbf16ps(0, 5, 1);                                            \
    if (NC == 4) {                                                                                      \
      _tile_loadd(1, kblk + 512, 64); _tile_dpbf16ps(0, 6, 1);                                          \
      _tile_loadd(1, kblk + 768, 64); _tile_dpbf16ps(0, 7, 1);                                          \
    }                                                                                                   \
    _tile_stored(0, S + 16 * kb, ls * 4);                                                               \
  }

/* one (sequence, kv head): queries [q0, q0 + ql) of the step (rows of q / out, stride qs / os elements), keys
   [0, L); query i sits at position L - ql + i */
static void item(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc, const int32_t* table,
                 int q0, int ql, int L, uint16_t* out, int64_t os, int h, int G, int Hkv, int D, int BS, float scale,
                 uint32_t* kt, uint32_t* vv, float* S, uint16_t* P, uint16_t* qpad, float* O) {
  const int Lp = (L + 31) / 32 * 32, ls = Lp, past = L - ql;
  pack_k(kc, table, L, Lp, h, Hkv, D, BS, kt);
  pack_v(vc, table, L, Lp, h, Hkv, D, BS, vv);
  for (int g = 0; g < G; g++) {
    const int head = h * G + g;
    for (int b0 = 0; b0 < ql; b0 += 16) {
      const int rows = ql - b0 < 16 ? ql - b0 : 16;
      const uint16_t* qa = q + (int64_t)(q0 + b0) * qs + (int64_t)head * D;
      int64_t qstride = qs * 2;
      if (rows < 16) {  /* a zero-padded copy: the rows past the chunk belong to other tokens or to nothing */
        memset(qpad, 0, (size_t)16 * D * 2);
        for (int i = 0; i < rows; i++) memcpy(qpad + i * D, qa + (int64_t)i * qs, (size_t)D * 2);
        qa = qpad; qstride = (int64_t)D * 2;
      }
      const int keys = past + b0 + rows;            /* the last query of the block sees keys [0, keys) */
      const int nkb = (keys + 15) / 16, ncol = (keys + 31) / 32 * 32;
      _tile_loadd(4, qa, qstride);
      _tile_loadd(5, qa + 32, qstride);
      if (D == 128) { _tile_loadd(6, qa + 64, qstride); _tile_loadd(7, qa + 96, qstride); QK_BLOCKS(4) }
      else { QK_BLOCKS(2) }
      float inv[16];
      for (int i = 0; i < 16; i++) {
        const int lim = i < rows ? past + b0 + i + 1 : 0;  /* keys row i sees; padded rows get P = 0 */
        const float* srow = S + (int64_t)i * ls;
        uint16_t* prow = P + (int64_t)i * ls;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < lim; j += 16) {
          const __mmask16 live = lim - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (lim - j)) - 1u);
          mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, live, srow + j));
        }
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale), sc = _mm512_set1_ps(scale);
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < ncol; j += 16) {
          const int live_n = lim - j;
          const __mmask16 live = live_n >= 16 ? (__mmask16)0xFFFF : live_n <= 0 ? 0 : (__mmask16)((1u << live_n) - 1u);
          const __m512 s = _mm512_maskz_loadu_ps(live, srow + j);
          const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_fmsub_ps(s, sc, m)));
          sum = _mm512_add_ps(sum, p);
          _mm256_storeu_si256((__m256i*)(prow + j), (__m256i)_mm512_cvtneps_pbh(p));
        }
        const float total = _mm512_reduce_add_ps(sum);
        inv[i] = total > 0.f ? 1.f / total : 0.f;
      }
      for (int d0 = 0; d0 < D; d0 += 64) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int kb = 0; kb < ncol / 32; kb++) {
          const uint32_t* vblk = vv + ((int64_t)kb * (D / 16) + d0 / 16) * 256;
          _tile_loadd(4, P + 32 * kb, ls * 2);
          _tile_loadd(5, vblk, 64); _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(5, vblk + 256, 64); _tile_dpbf16ps(1, 4, 5);
          _tile_loadd(5, vblk + 512, 64); _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(5, vblk + 768, 64); _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, O + d0, D * 4); _tile_stored(1, O + d0 + 16, D * 4);
        _tile_stored(2, O + d0 + 32, D * 4); _tile_stored(3, O + d0 + 48, D * 4);
      }
      for (int i = 0; i < rows; i++) {
        uint16_t* orow = out + (int64_t)(q0 + b0 + i) * os + (int64_t)head * D;
        const __m512 w = _mm512_set1_ps(inv[i]);
        for (int d = 0; d < D; d += 16)
          _mm256_storeu_si256((__m256i*)(orow + d),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(O + i * D + d), w)));
      }
    }
  }
}

/* q [T, Hq, D] bf16 (token stride qs elements); k/v cache [NB, BS, Hkv, D]; tables int32 [S, MB]; qsl int32
   [S + 1]: sequence s's queries are rows [qsl[s], qsl[s + 1]); seq_lens int32 [S]: its keys after this step;
   out like q (token stride os). D = 64 or 128, Hq % Hkv == 0. */
void paged_prefill(const uint16_t* q, int64_t qs, const uint16_t* kc, const uint16_t* vc, const int32_t* tables,
                   int MB, const int32_t* qsl, const int32_t* seq_lens, uint16_t* out, int64_t os, int S, int Hq,
                   int Hkv, int D, int BS, float scale, int threads) {
  int max_lp = 32;
  for (int s = 0; s < S; s++) max_lp = seq_lens[s] + 31 > max_lp ? (seq_lens[s] + 31) / 32 * 32 : max_lp;
  const int G = Hq / Hkv;
  #pragma omp parallel num_threads(threads)
  {
    tiles_on();
    uint32_t* kt = aligned_alloc(64, (size_t)max_lp * D * 2);
    uint32_t* vv = aligned_alloc(64, (size_t)max_lp * D * 2);
    float* Sb = aligned_alloc(64, (size_t)16 * max_lp * 4);
    uint16_t* Pb = aligned_alloc(64, (size_t)16 * max_lp * 2);
    uint16_t* qpad = aligned_alloc(64, (size_t)16 * D * 2);
    float* O = aligned_alloc(64, (size_t)16 * D * 4);
    #pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < S * Hkv; it++) {
      const int s = it / Hkv, h = it % Hkv;
      item(q, qs, kc, vc, tables + (int64_t)s * MB, qsl[s], qsl[s + 1] - qsl[s], seq_lens[s], out, os, h, G, Hkv,
           D, BS, scale, kt, vv, Sb, Pb, qpad, O);
    }
    free(kt); free(vv); free(Sb); free(Pb); free(qpad); free(O);
    _tile_release();
  }
}

"""Paged decode attention on CPU in C (compiled once with the system C compiler, cached, loaded with ctypes).

One query token per sequence reads its K/V straight from the paged cache through the block table: no gather
copy, no padding. Work item = (sequence, kv head): the G query heads sharing that kv head stream the context in
tiles of 16 tokens with an online softmax in fp32; items are spread over torch's OpenMP threads (the .so links the
same libgomp torch loaded). Falls back to None (the torch path) when no compiler works.
"""

from __future__ import annotations

import ctypes

import torch

from quantkit.serve.cpu_build import C_DTYPES, DTYPE_CODES, load_library

MAX_HEAD_DIM, MAX_GROUP = 256, 16

C_SOURCE = C_DTYPES + r"""
#include <math.h>

#define TILE 16
#define MAXD 256
#define MAXG 16

static void load_row(const void* base, int64_t off, int d, int dtype, float* dst) {
  if (dtype == F32) { memcpy(dst, (const float*)base + off, (size_t)d * 4); return; }
  if (dtype == BF16) { const uint16_t* s = (const uint16_t*)base + off; for (int i = 0; i < d; i++) dst[i] = bf16_to_f32(s[i]); return; }
  const _Float16* s = (const _Float16*)base + off; for (int i = 0; i < d; i++) dst[i] = (float)s[i];
}

static void store_row(void* base, int64_t off, int d, int dtype, const float* src) {
  if (dtype == F32) { memcpy((float*)base + off, src, (size_t)d * 4); return; }
  if (dtype == BF16) { uint16_t* o = (uint16_t*)base + off; for (int i = 0; i < d; i++) o[i] = f32_to_bf16(src[i]); return; }
  _Float16* o = (_Float16*)base + off; for (int i = 0; i < d; i++) o[i] = (_Float16)src[i];
}

/* One work item = (sequence s, kv head h): the G query heads of h over tokens [0, len) of s, in tiles of 16.
   Token t of s lives at row ((table[t / BS] * BS + t % BS) * Hkv + h) * D of a cache. */
#define ITEM_PROLOGUE                                                                               \
  float qf[MAXG][MAXD] __attribute__((aligned(64))), acc[MAXG][MAXD] __attribute__((aligned(64)));  \
  float kt[TILE][MAXD] __attribute__((aligned(64))), vt[TILE][MAXD] __attribute__((aligned(64)));   \
  float m[MAXG], l[MAXG];                                                                           \
  for (int g = 0; g < G; g++) {                                                                     \
    load_row(q, ((int64_t)s * Hq + h * G + g) * D, D, dtype, qf[g]);                                \
    for (int d = 0; d < D; d++) { qf[g][d] *= scale; acc[g][d] = 0.f; }                             \
    m[g] = -INFINITY; l[g] = 0.f;                                                                   \
  }

#define LOAD_TILE                                                                                   \
  const int n = len - t0 < TILE ? len - t0 : TILE;                                                 \
  for (int j = 0; j < n; j++) {                                                                     \
    const int t = t0 + j;                                                                           \
    const int64_t row = (((int64_t)table[t / BS] * BS + t % BS) * Hkv + h) * D;                      \
    load_row(kc, row, D, dtype, kt[j]);                                                             \
    load_row(vc, row, D, dtype, vt[j]);                                                             \
  }

#define ITEM_EPILOGUE                                                                               \
  for (int g = 0; g < G; g++) {                                                                     \
    const float inv = 1.f / l[g];                                                                   \
    for (int d = 0; d < D; d++) acc[g][d] *= inv;                                                   \
    store_row(out, ((int64_t)s * Hq + h * G + g) * D, D, dtype, acc[g]);                            \
  }

static void item_generic(const void* q, const void* kc, const void* vc, const int32_t* table, int len, void* out,
                         int s, int h, int G, int Hq, int Hkv, int D, int BS, float scale, int dtype) {
  ITEM_PROLOGUE
  float p[TILE];
  for (int t0 = 0; t0 < len; t0 += TILE) {
    LOAD_TILE
    for (int g = 0; g < G; g++) {
      float mx = m[g];
      for (int j = 0; j < n; j++) {
        float sc = 0.f;
        #pragma omp simd reduction(+:sc)
        for (int d = 0; d < D; d++) sc += qf[g][d] * kt[j][d];
        p[j] = sc;
        mx = sc > mx ? sc : mx;
      }
      const float corr = expf(m[g] - mx);  /* 0 on the first tile (m = -inf) */
      float sum = 0.f;
      for (int j = 0; j < n; j++) { p[j] = expf(p[j] - mx); sum += p[j]; }
      l[g] = l[g] * corr + sum;
      m[g] = mx;
      for (int d = 0; d < D; d++) acc[g][d] *= corr;
      for (int j = 0; j < n; j++) {
        const float w = p[j];
        #pragma omp simd
        for (int d = 0; d < D; d++) acc[g][d] += w * vt[j][d];
      }
    }
  }
  ITEM_EPILOGUE
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* e^x for 16 lanes, x <= 0 (clamped at -87), relative error ~2e-7 */
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, fi);
}

/* NV = D / 16 is a compile-time constant at each call: q, scores and the accumulator stay in registers */
static inline __attribute__((always_inline)) void item_avx512(
    const void* q, const void* kc, const void* vc, const int32_t* table, int len, void* out,
    int s, int h, int G, int Hq, int Hkv, int BS, float scale, int dtype, const int NV) {
  const int D = NV * 16;
  ITEM_PROLOGUE
  float sc[TILE] __attribute__((aligned(64)));
  for (int t0 = 0; t0 < len; t0 += TILE) {
    LOAD_TILE
    const __mmask16 live = n == TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
    for (int g = 0; g < G; g++) {
      __m512 qv[MAXD / 16], av[MAXD / 16];
      for (int v = 0; v < NV; v++) qv[v] = _mm512_load_ps(qf[g] + 16 * v);
      for (int j = 0; j < n; j++) {
        __m512 a = _mm512_mul_ps(qv[0], _mm512_load_ps(kt[j]));
        for (int v = 1; v < NV; v++) a = _mm512_fmadd_ps(qv[v], _mm512_load_ps(kt[j] + 16 * v), a);
        sc[j] = _mm512_reduce_add_ps(a);
      }
      const __m512 x = _mm512_mask_load_ps(_mm512_set1_ps(-INFINITY), live, sc);
      const float tile_max = _mm512_reduce_max_ps(x);
      const float mx = tile_max > m[g] ? tile_max : m[g];
      const float corr = expf(m[g] - mx);  /* 0 on the first tile (m = -inf) */
      const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, _mm512_set1_ps(mx))));
      l[g] = l[g] * corr + _mm512_reduce_add_ps(p);
      m[g] = mx;
      _mm512_store_ps(sc, p);
      const __m512 c = _mm512_set1_ps(corr);
      for (int v = 0; v < NV; v++) av[v] = _mm512_mul_ps(_mm512_load_ps(acc[g] + 16 * v), c);
      for (int j = 0; j < n; j++) {
        const __m512 w = _mm512_set1_ps(sc[j]);
        for (int v = 0; v < NV; v++) av[v] = _mm512_fmadd_ps(w, _mm512_load_ps(vt[j] + 16 * v), av[v]);
      }
      for (int v = 0; v < NV; v++) _mm512_store_ps(acc[g] + 16 * v, av[v]);
    }
  }
  ITEM_EPILOGUE
}
#endif

/* q [S, Hq, D]; k/v cache [NB, BS, Hkv, D]; block_tables int32 [S, MB]; seq_lens int32 [S]; out [S, Hq, D] */
void paged_decode(const void* q, const void* kc, const void* vc, const int32_t* block_tables,
                  const int32_t* seq_lens, void* out, int S, int Hq, int Hkv, int D, int BS, int MB,
                  float scale, int dtype, int threads) {
  const int G = Hq / Hkv;
  #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int item = 0; item < S * Hkv; item++) {
    const int s = item / Hkv, h = item % Hkv;
    const int32_t* table = block_tables + (int64_t)s * MB;
#if defined(__AVX512F__)
    if (D == 64) { item_avx512(q, kc, vc, table, seq_lens[s], out, s, h, G, Hq, Hkv, BS, scale, dtype, 4); continue; }
    if (D == 128) { item_avx512(q, kc, vc, table, seq_lens[s], out, s, h, G, Hq, Hkv, BS, scale, dtype, 8); continue; }
#endif
    item_generic(q, kc, vc, table, seq_lens[s], out, s, h, G, Hq, Hkv, D, BS, scale, dtype);
  }
}
"""

_kernel = None


def load_decode_kernel():
    """The compiled paged_decode function, or None when it cannot be built here."""
    global _kernel
    if _kernel is None:
        lib = load_library("paged_decode", C_SOURCE)
        _kernel = False if lib is None else lib.paged_decode
        if lib is not None:
            _kernel.restype = None
            _kernel.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return _kernel or None


def paged_decode(fn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """out [S, Hq, D] = attention of q [S, Hq, D] over tokens [0, seq_lens[s]) of each sequence's cache."""
    num_seqs, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    assert q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype and q.dtype in DTYPE_CODES
    assert d <= MAX_HEAD_DIM and hq % hkv == 0 and hq // hkv <= MAX_GROUP
    assert block_tables.dtype == torch.int32 and block_tables.is_contiguous() and block_tables.shape[0] == num_seqs
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() and seq_lens.shape == (num_seqs,)
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
       out.data_ptr(), num_seqs, hq, hkv, d, block_size, block_tables.shape[1], scale, DTYPE_CODES[q.dtype],
       torch.get_num_threads())

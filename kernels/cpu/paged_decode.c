/* Paged decode attention of kernels/cpu/paged_decode.py: one query token per sequence (paged_decode), or per
   query row with its own sequence and length (paged_rows), against the paged K/V cache, online softmax in fp32 over
   tiles of 16 tokens: from the first token the row sees (0 without a sliding window), or on AVX2 at multiples of 16.
   Builds: AVX-512 BF16 (bf16 dot products), AVX-512 (fp32), AVX2 + FMA + F16C (several rows per item), plain C. */
#include <math.h>

#include "common.h"
#include "exp.h"

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

/* One work item = (sequence s, kv head h): the G query heads of h over tokens [lo, len) of s, in tiles of 16 from
   lo (0, or len - window for a sliding-window layer); cap > 0: scores soft-capped, cap * tanh(score / cap).
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

/* sc [n] = cap * tanh(sc / cap) (scalar libm: the soft-capped layers only) */
static void soft_cap(float* sc, int n, float cap) {
  for (int j = 0; j < n; j++) sc[j] = cap * tanhf(sc[j] / cap);
}

/* the first position a row of length len sees: len - window for a sliding-window layer (window > 0) once that is
   positive, else 0 */
static inline int window_start(int len, int window) { return window > 0 && len > window ? len - window : 0; }

static void item_generic(const void* q, const void* kc, const void* vc, const int32_t* table, int lo, int len,
                         void* out, int s, int h, int G, int Hq, int Hkv, int D, int BS, float scale, float cap,
                         int dtype) {
  ITEM_PROLOGUE
  float p[TILE];
  for (int t0 = lo; t0 < len; t0 += TILE) {
    LOAD_TILE
    for (int g = 0; g < G; g++) {
      float mx = m[g];
      for (int j = 0; j < n; j++) {
        float sc = 0.f;
        #pragma omp simd reduction(+:sc)
        for (int d = 0; d < D; d++) sc += qf[g][d] * kt[j][d];
        p[j] = sc;
      }
      if (cap > 0.f) soft_cap(p, n, cap);
      for (int j = 0; j < n; j++) mx = p[j] > mx ? p[j] : mx;
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

/* One tile of the online softmax for one query head: x [16] scores (dead lanes -inf), n live tokens whose fp32 V
   rows are vt; updates the running max m, normaliser l and accumulator acc [D]. NV = D / 16. */
static inline __attribute__((always_inline)) void softmax_pv(
    __m512 x, __mmask16 live, int n, float* m, float* l, float* acc, float vt[][MAXD], const int NV) {
  float sc[TILE] __attribute__((aligned(64)));
  __m512 av[MAXD / 16];
  const float tile_max = _mm512_reduce_max_ps(x);
  const float mx = tile_max > *m ? tile_max : *m;
  const float corr = expf(*m - mx);  /* 0 on the first tile (m = -inf) */
  const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, _mm512_set1_ps(mx))));
  *l = *l * corr + _mm512_reduce_add_ps(p);
  *m = mx;
  _mm512_store_ps(sc, p);
  const __m512 c = _mm512_set1_ps(corr);
  for (int v = 0; v < NV; v++) av[v] = _mm512_mul_ps(_mm512_load_ps(acc + 16 * v), c);
  for (int j = 0; j < n; j++) {
    const __m512 w = _mm512_set1_ps(sc[j]);
    for (int v = 0; v < NV; v++) av[v] = _mm512_fmadd_ps(w, _mm512_load_ps(vt[j] + 16 * v), av[v]);
  }
  for (int v = 0; v < NV; v++) _mm512_store_ps(acc + 16 * v, av[v]);
}

/* NV = D / 16 is a compile-time constant at each call: q, scores and the accumulator stay in registers */
static inline __attribute__((always_inline)) void item_avx512(
    const void* q, const void* kc, const void* vc, const int32_t* table, int lo, int len, void* out,
    int s, int h, int G, int Hq, int Hkv, int BS, float scale, float cap, int dtype, const int NV) {
  const int D = NV * 16;
  ITEM_PROLOGUE
  float sc[TILE] __attribute__((aligned(64)));
  for (int t0 = lo; t0 < len; t0 += TILE) {
    LOAD_TILE
    const __mmask16 live = n == TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
    for (int g = 0; g < G; g++) {
      __m512 qv[MAXD / 16];
      for (int v = 0; v < NV; v++) qv[v] = _mm512_load_ps(qf[g] + 16 * v);
      for (int j = 0; j < n; j++) {
        __m512 a = _mm512_mul_ps(qv[0], _mm512_load_ps(kt[j]));
        for (int v = 1; v < NV; v++) a = _mm512_fmadd_ps(qv[v], _mm512_load_ps(kt[j] + 16 * v), a);
        sc[j] = _mm512_reduce_add_ps(a);
      }
      if (cap > 0.f) soft_cap(sc, n, cap);
      softmax_pv(_mm512_mask_load_ps(_mm512_set1_ps(-INFINITY), live, sc), live, n, &m[g], &l[g], acc[g], vt, NV);
    }
  }
  ITEM_EPILOGUE
}

#if defined(__AVX512BF16__)
/* lane j of the result = the sum of v[j]'s 16 lanes: a 4-level fold tree (45 shuffles/adds for 16 sums, instead
   of 16 horizontal reductions) and one permute back to token order */
static inline __m512 sum16(const __m512* v) {
  __m512 t[8], w[4], y[2];
  for (int i = 0; i < 8; i++)  /* [v2i folded to 8 | v2i+1 folded to 8] */
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; i++)  /* quarters: v4i, v4i+1, v4i+2, v4i+3, 4 partials each */
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; i++) {  /* quarter q: [v(8i+q) x2 | v(8i+4+q) x2]; pd unpacks move float pairs */
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  /* lane 4q + i holds the sum of v(q + 4i) */
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

/* bf16 caches: q . k with the bf16 dot-product instruction straight from the cache rows (no fp32 copy of K),
   16 scores per tile summed by sum16; V and the softmax as item_avx512. NV = D / 16. */
static inline __attribute__((always_inline)) void item_bf16(
    const uint16_t* q, const uint16_t* kc, const void* vc, const int32_t* table, int lo, int len, void* out,
    int s, int h, int G, int Hq, int Hkv, int BS, float scale, float cap, const int NV) {
  const int D = NV * 16, NB = NV / 2;  /* NB zmm of 32 bf16 per row */
  float acc[MAXG][MAXD] __attribute__((aligned(64))), vt[TILE][MAXD] __attribute__((aligned(64)));
  float m[MAXG], l[MAXG];
  __m512bh qb[MAXG][MAXD / 32];
  for (int g = 0; g < G; g++) {
    for (int b = 0; b < NB; b++)
      qb[g][b] = (__m512bh)_mm512_loadu_si512(q + ((int64_t)s * Hq + h * G + g) * D + 32 * b);
    for (int d = 0; d < D; d++) acc[g][d] = 0.f;
    m[g] = -INFINITY; l[g] = 0.f;
  }
  __m512 part[MAXG][TILE];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int t0 = lo; t0 < len; t0 += TILE) {
    const int n = len - t0 < TILE ? len - t0 : TILE;
    /* the next tile usually sits in another block: ask for its rows now, while this tile computes */
    for (int t = t0 + TILE; t < t0 + 2 * TILE && t < len; t++) {
      const int64_t row = (((int64_t)table[t / BS] * BS + t % BS) * Hkv + h) * D;
      for (int off = 0; off < D; off += 32) {
        _mm_prefetch((const char*)(kc + row + off), _MM_HINT_T0);
        _mm_prefetch((const char*)((const uint16_t*)vc + row + off), _MM_HINT_T0);
      }
    }
    for (int j = 0; j < TILE; j++) {
      if (j >= n) { for (int g = 0; g < G; g++) part[g][j] = _mm512_setzero_ps(); continue; }
      const int t = t0 + j;
      const int64_t row = (((int64_t)table[t / BS] * BS + t % BS) * Hkv + h) * D;
      __m512bh kb[MAXD / 32];
      for (int b = 0; b < NB; b++) kb[b] = (__m512bh)_mm512_loadu_si512(kc + row + 32 * b);
      for (int g = 0; g < G; g++) {
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], kb[0]);
        for (int b = 1; b < NB; b++) a = _mm512_dpbf16_ps(a, qb[g][b], kb[b]);
        part[g][j] = a;
      }
      load_row(vc, row, D, BF16, vt[j]);
    }
    const __mmask16 live = n == TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
    for (int g = 0; g < G; g++) {
      __m512 x = _mm512_mul_ps(sum16(part[g]), vscale);
      if (cap > 0.f) {
        float sc[TILE] __attribute__((aligned(64)));
        _mm512_store_ps(sc, x);
        soft_cap(sc, n, cap);
        x = _mm512_load_ps(sc);
      }
      x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, x);
      softmax_pv(x, live, n, &m[g], &l[g], acc[g], vt, NV);
    }
  }
  const int dtype = BF16;
  ITEM_EPILOGUE
}
#endif
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "avx2.h"

/* AVX2: an item is up to ROWS consecutive query rows of one sequence (a prefill chunk's), so each K/V tile is
   converted to fp32 once for all of them. Tiles sit at multiples of 16 positions (a windowed row's first tile is
   partial), so the rows of a chunk share them with or without a window; each row's arithmetic is the one-row
   item's, in the same order, whatever rows share the item. */
#define ROWS 8
#define ROW_FLOATS 8192 /* fp32 of an item's queries, and of its accumulators: rows * G * D at most */
#define ROWWISE_ITEMS 1

/* NV * 8 fp32 from the cache row at off */
static inline __attribute__((always_inline)) void load_row8(const void* base, int64_t off, int dtype, float* dst,
                                                            const int NV) {
  for (int v = 0; v < NV; v++) {
    const __m128i* src = (const __m128i*)((const uint16_t*)base + off + 8 * v);
    const __m256 x = dtype == F32 ? _mm256_loadu_ps((const float*)base + off + 8 * v)
                     : dtype == BF16 ? even8(_mm256_cvtepu16_epi32(_mm_loadu_si128(src)))
                                     : _mm256_cvtph_ps(_mm_loadu_si128(src));
    _mm256_store_ps(dst + 8 * v, x);
  }
}

/* lane i of tokens j0 .. j0 + 7 all ones where the token j0 + i is live (a <= j0 + i < n), else zero */
static inline __m256 live8(int j0, int a, int n) {
  const __m256i j = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(j0));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), j),
                                              _mm256_cmpgt_epi32(j, _mm256_set1_epi32(a - 1))));
}

/* One tile of one query row and head: qf [D] (scaled), live tokens [a, n) of the fp32 tile kt / vt; updates the
   running max m, normaliser l and accumulator acc [D]. Score j = the 8-lane partial products of q . k_j summed by
   sum8. */
static inline __attribute__((always_inline)) void tile_avx2(
    const float* qf, float* acc, float* m, float* l, float kt[][MAXD], float vt[][MAXD], int a, int n, float cap,
    const int NV) {
  float sc[TILE] __attribute__((aligned(32)));
  __m256 x[2];
  for (int half = 0; half < 2; half++) {
    __m256 part[8];
    for (int i = 0; i < 8; i++) {
      const int j = 8 * half + i;
      if (j < a || j >= n) { part[i] = _mm256_setzero_ps(); continue; }
      __m256 dot = _mm256_mul_ps(_mm256_load_ps(qf), _mm256_load_ps(kt[j]));
      for (int v = 1; v < NV; v++)
        dot = _mm256_fmadd_ps(_mm256_load_ps(qf + 8 * v), _mm256_load_ps(kt[j] + 8 * v), dot);
      part[i] = dot;
    }
    x[half] = sum8(part);
  }
  if (cap > 0.f) {
    _mm256_store_ps(sc, x[0]); _mm256_store_ps(sc + 8, x[1]);
    soft_cap(sc + a, n - a, cap);
    x[0] = _mm256_load_ps(sc); x[1] = _mm256_load_ps(sc + 8);
  }
  const __m256 live0 = live8(0, a, n), live1 = live8(8, a, n), ninf = _mm256_set1_ps(-INFINITY);
  x[0] = _mm256_blendv_ps(ninf, x[0], live0);
  x[1] = _mm256_blendv_ps(ninf, x[1], live1);
  const float tile_max = hmax8(_mm256_max_ps(x[0], x[1]));
  const float mx = tile_max > *m ? tile_max : *m;
  const float corr = expf(*m - mx);  /* 0 on the first tile (m = -inf) */
  const __m256 vmx = _mm256_set1_ps(mx);
  const __m256 p0 = _mm256_and_ps(exp8(_mm256_sub_ps(x[0], vmx)), live0);
  const __m256 p1 = _mm256_and_ps(exp8(_mm256_sub_ps(x[1], vmx)), live1);
  *l = *l * corr + hsum8(_mm256_add_ps(p0, p1));
  *m = mx;
  _mm256_store_ps(sc, p0); _mm256_store_ps(sc + 8, p1);
  __m256 av[MAXD / 8];
  const __m256 c = _mm256_set1_ps(corr);
  for (int v = 0; v < NV; v++) av[v] = _mm256_mul_ps(_mm256_load_ps(acc + 8 * v), c);
  for (int j = a; j < n; j++) {
    const __m256 w = _mm256_set1_ps(sc[j]);
    for (int v = 0; v < NV; v++) av[v] = _mm256_fmadd_ps(w, _mm256_load_ps(vt[j] + 8 * v), av[v]);
  }
  for (int v = 0; v < NV; v++) _mm256_store_ps(acc + 8 * v, av[v]);
}

/* rows [r0, r0 + nr) of one sequence (block table `table`), row r over positions [lens[r] - window (window > 0,
   floored at 0), lens[r]), kv head h; NV = D / 8 (a compile-time constant at the D = 64 and 128 calls) */
static inline __attribute__((always_inline)) void item_avx2(
    const void* q, const void* kc, const void* vc, const int32_t* table, const int32_t* lens, int r0, int nr,
    int window, void* out, int h, int G, int Hq, int Hkv, int BS, float scale, float cap, int dtype, const int NV) {
  const int D = NV * 8;
  float qf[ROW_FLOATS] __attribute__((aligned(32))), acc[ROW_FLOATS] __attribute__((aligned(32)));
  float kt[TILE][MAXD] __attribute__((aligned(32))), vt[TILE][MAXD] __attribute__((aligned(32)));
  float m[ROWS * MAXG], l[ROWS * MAXG];
  int start[ROWS], lo = INT32_MAX, end = 0;  /* each row's first position; the item's span [lo, end) */
  for (int r = 0; r < nr; r++) {
    const int len = lens[r0 + r];
    start[r] = window_start(len, window);
    lo = start[r] < lo ? start[r] : lo;
    end = len > end ? len : end;
    for (int g = 0; g < G; g++) {
      float* qg = qf + (r * G + g) * D;
      load_row(q, ((int64_t)(r0 + r) * Hq + h * G + g) * D, D, dtype, qg);
      for (int d = 0; d < D; d++) { qg[d] *= scale; acc[(r * G + g) * D + d] = 0.f; }
      m[r * G + g] = -INFINITY; l[r * G + g] = 0.f;
    }
  }
  for (int t0 = lo / TILE * TILE; t0 < end; t0 += TILE) {
    const int n = end - t0 < TILE ? end - t0 : TILE;
    for (int j = lo > t0 ? lo - t0 : 0; j < n; j++) {
      const int t = t0 + j;
      const int64_t row = (((int64_t)table[t / BS] * BS + t % BS) * Hkv + h) * D;
      load_row8(kc, row, dtype, kt[j], NV);
      load_row8(vc, row, dtype, vt[j], NV);
    }
    for (int r = 0; r < nr; r++) {
      const int a = start[r] > t0 ? start[r] - t0 : 0, live = lens[r0 + r] - t0;
      if (live <= 0 || a >= TILE) continue;
      for (int g = 0; g < G; g++) {
        const int i = r * G + g;
        tile_avx2(qf + i * D, acc + i * D, &m[i], &l[i], kt, vt, a, live < TILE ? live : TILE, cap, NV);
      }
    }
  }
  for (int i = 0; i < nr * G; i++) {
    const float inv = 1.f / l[i];
    for (int d = 0; d < D; d++) acc[i * D + d] *= inv;
    store_row(out, ((int64_t)(r0 + i / G) * Hq + h * G + i % G) * D, D, dtype, acc + i * D);
  }
}
#endif

/* The rows one item may take: ROWS (at most ROW_FLOATS of queries) on the AVX2 build for rows of a shared sequence,
   else 1 */
static int rows_per_item(int G, int D, const int32_t* seqs) {
#if defined(ROWWISE_ITEMS)
  if (seqs != NULL && D % 8 == 0) {
    const int fit = ROW_FLOATS / (G * D);
    return fit < ROWS ? fit : ROWS;
  }
#endif
  (void)G; (void)D; (void)seqs;
  return 1;
}

/* items (rows [first[b], first[b + 1]), kv head h): row r attends tokens [lo, lens[r]) of the sequence whose block
   table is row seqs[r] of block_tables (seqs NULL: row r's own), lo = lens[r] - window when window > 0 and that
   is positive, else 0; cap > 0 soft-caps the scores. The rows of an item are consecutive rows of one sequence
   (rows_per_item of them at most). Each row's arithmetic depends only on its query, its length and the cache,
   never on R, on the other rows, on the item or on the thread. */
static void run_items(const void* q, const void* kc, const void* vc, const int32_t* block_tables,
                      const int32_t* seqs, const int32_t* lens, void* out, int R, int Hq, int Hkv, int D, int BS,
                      int MB, float scale, int window, float cap, int dtype, int threads) {
  const int G = Hq / Hkv, per = rows_per_item(G, D, seqs);
  int first[R + 1], B = 0;  /* the items' first rows (B items), then R */
  for (int r = 0; r < R; r++)
    if (r == 0 || r - first[B - 1] == per || seqs == NULL || seqs[r] != seqs[first[B - 1]]) first[B++] = r;
  first[B] = R;
  /* a thread takes all kv heads of an item in a row: the heads' rows interleave in each block, so the second
     and third heads read lines the first pulled into L2 (1.6x faster than heads spread over threads) */
  const int chunk = B >= 2 * threads ? Hkv : 1;
  #pragma omp parallel for num_threads(threads) schedule(dynamic, chunk)
  for (int item = 0; item < B * Hkv; item++) {
    const int b = item / Hkv, h = item % Hkv, s = first[b];
    const int32_t* table = block_tables + (int64_t)(seqs ? seqs[s] : s) * MB;
    const int len = lens[s], lo = window_start(len, window);
#if defined(ROWWISE_ITEMS)
    const int nr = first[b + 1] - s;
#define AVX2_ITEM(NV) item_avx2(q, kc, vc, table, lens, s, nr, window, out, h, G, Hq, Hkv, BS, scale, cap, dtype, NV)
    if (D == 64) { AVX2_ITEM(8); continue; }
    if (D == 128) { AVX2_ITEM(16); continue; }
    if (D % 8 == 0) { AVX2_ITEM(D / 8); continue; }
#undef AVX2_ITEM
#endif
#if defined(__AVX512BF16__)
    if (dtype == BF16 && D == 64) { item_bf16(q, kc, vc, table, lo, len, out, s, h, G, Hq, Hkv, BS, scale, cap, 4); continue; }
    if (dtype == BF16 && D == 128) { item_bf16(q, kc, vc, table, lo, len, out, s, h, G, Hq, Hkv, BS, scale, cap, 8); continue; }
#endif
#if defined(__AVX512F__)
    if (D == 64) { item_avx512(q, kc, vc, table, lo, len, out, s, h, G, Hq, Hkv, BS, scale, cap, dtype, 4); continue; }
    if (D == 128) { item_avx512(q, kc, vc, table, lo, len, out, s, h, G, Hq, Hkv, BS, scale, cap, dtype, 8); continue; }
#endif
    item_generic(q, kc, vc, table, lo, len, out, s, h, G, Hq, Hkv, D, BS, scale, cap, dtype);
  }
}

/* q [S, Hq, D]; k/v cache [NB, BS, Hkv, D]; block_tables int32 [S, MB]; seq_lens int32 [S]; out [S, Hq, D] */
void paged_decode(const void* q, const void* kc, const void* vc, const int32_t* block_tables,
                  const int32_t* seq_lens, void* out, int S, int Hq, int Hkv, int D, int BS, int MB,
                  float scale, int dtype, int threads) {
  run_items(q, kc, vc, block_tables, NULL, seq_lens, out, S, Hq, Hkv, D, BS, MB, scale, 0, 0.f, dtype, threads);
}

/* Every query row as its own decode item (batch-invariant serving: decode, prefill-chunk and verify rows alike).
   q [R, Hq, D]; block_tables int32 [S, MB]; row_seqs int32 [R] (each row's sequence); row_lens int32 [R] (its
   position + 1: causal); window: the layer's sliding window (0: none); cap: its logit soft-cap (0: none);
   out [R, Hq, D] */
void paged_rows(const void* q, const void* kc, const void* vc, const int32_t* block_tables, const int32_t* row_seqs,
                const int32_t* row_lens, void* out, int R, int Hq, int Hkv, int D, int BS, int MB, float scale,
                int window, float cap, int dtype, int threads) {
  run_items(q, kc, vc, block_tables, row_seqs, row_lens, out, R, Hq, Hkv, D, BS, MB, scale, window, cap, dtype,
            threads);
}

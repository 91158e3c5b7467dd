/* Paged decode attention of kernels/cpu/paged_decode.py: one query token per sequence (paged_decode), or per
   query row with its own sequence and length (paged_rows), against the paged K/V cache, online softmax in fp32 over
   tiles of 16 tokens at multiples of 16 positions. An item takes up to 8 consecutive rows of one sequence (a prefill
   chunk's), which share each K/V tile. Builds: AVX-512 BF16 (bf16 dot products), AVX-512 (fp32), AVX2 + FMA + F16C,
   plain C. */
#include <math.h>

#include "common.h"
#include "exp.h"

#define TILE 16
#define MAXD 256
#define MAXG 16
#define ROWS 8          /* query rows per item */
#define ROW_FLOATS 8192 /* fp32 of an item's queries, and of its accumulators: rows * G * D at most */

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

/* sc [n] = cap * tanh(sc / cap) (scalar libm: the soft-capped layers only) */
static void soft_cap(float* sc, int n, float cap) {
  for (int j = 0; j < n; j++) sc[j] = cap * tanhf(sc[j] / cap);
}

/* the first position a row of length len sees: len - window for a sliding-window layer (window > 0) once that is
   positive, else 0 */
static inline int window_start(int len, int window) { return window > 0 && len > window ? len - window : 0; }

/* One work item: rows [r0, r0 + nr) of one sequence (its block table `table`: a prefill chunk's consecutive rows,
   or one decode row), kv head h. Row r attends positions [window_start(lens[r0 + r]), lens[r0 + r]); its query
   head g (of the G sharing h) sits at index i = r * G + g of the item's arrays. Tiles sit at multiples of 16
   positions (a windowed row's first one is partial), so the rows share each K/V tile; a row's arithmetic is the
   same, in the same order, whatever rows share its item. Position t of the sequence lives at row
   ((table[t / BS] * BS + t % BS) * Hkv + h) * D of a cache. */
typedef struct {
  const void *q, *kc, *vc;  /* q [R, Hq, D]; caches [NB, BS, Hkv, D] */
  const int32_t *table, *lens;
  void* out;  /* [R, Hq, D] */
  int r0, nr, window, h, G, Hq, Hkv, BS, dtype;
  float scale, cap;  /* cap > 0: scores soft-capped, cap * tanh(score / cap) */
} Item;

static inline int64_t cache_row(const Item* it, int t, int D) {
  return (((int64_t)it->table[t / it->BS] * it->BS + t % it->BS) * it->Hkv + it->h) * D;
}

static inline int64_t query_row(const Item* it, int i, int D) {
  return ((int64_t)(it->r0 + i / it->G) * it->Hq + it->h * it->G + i % it->G) * D;
}

/* start [nr]: each row's first position; [*lo, *end): the positions any row of the item sees */
static void item_span(const Item* it, int* start, int* lo, int* end) {
  *lo = INT32_MAX; *end = 0;
  for (int r = 0; r < it->nr; r++) {
    const int len = it->lens[it->r0 + r];
    start[r] = window_start(len, it->window);
    *lo = start[r] < *lo ? start[r] : *lo;
    *end = len > *end ? len : *end;
  }
}

/* row r's live tokens [*a, *n) of the tile at t0: false when it has none */
static inline int row_in_tile(const Item* it, const int* start, int r, int t0, int* a, int* n) {
  const int live = it->lens[it->r0 + r] - t0;
  *a = start[r] > t0 ? start[r] - t0 : 0;
  *n = live < TILE ? live : TILE;
  return live > 0 && *a < TILE;
}

/* acc [nr * G, D] = 0, m = -inf, l = 0 */
static void clear_state(const Item* it, int D, float* acc, float* m, float* l) {
  for (int i = 0; i < it->nr * it->G; i++) {
    for (int d = 0; d < D; d++) acc[i * D + d] = 0.f;
    m[i] = -INFINITY; l[i] = 0.f;
  }
}

/* the item's output rows = acc / l */
static void store_outputs(const Item* it, int D, float* acc, const float* l) {
  for (int i = 0; i < it->nr * it->G; i++) {
    const float inv = 1.f / l[i];
    for (int d = 0; d < D; d++) acc[i * D + d] *= inv;
    store_row(it->out, query_row(it, i, D), D, it->dtype, acc + i * D);
  }
}

/* x . y over D in 8 partial sums (lane d % 8), added in one fixed order: the same bits on every call (an omp simd
   reduction's order may change with the call's context) */
static inline float dot8(const float* x, const float* y, int D) {
  float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int d = 0;
  for (; d + 8 <= D; d += 8)
    for (int i = 0; i < 8; i++) s[i] += x[d + i] * y[d + i];
  for (int i = 0; d < D; d++, i++) s[i] += x[d] * y[d];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* One tile of one query row and head in plain C: qf [D] (scaled), live tokens [a, n) of the fp32 tile kt / vt;
   updates the running max m, normaliser l and accumulator acc [D] */
static void tile_generic(const float* qf, float* acc, float* m, float* l, float kt[][MAXD], float vt[][MAXD], int a,
                         int n, float cap, int D) {
  float p[TILE];
  for (int j = a; j < n; j++) p[j] = dot8(qf, kt[j], D);
  if (cap > 0.f) soft_cap(p + a, n - a, cap);
  float mx = *m;
  for (int j = a; j < n; j++) mx = p[j] > mx ? p[j] : mx;
  const float corr = expf(*m - mx);  /* 0 on the first tile (m = -inf) */
  float sum = 0.f;
  for (int j = a; j < n; j++) { p[j] = expf(p[j] - mx); sum += p[j]; }
  *l = *l * corr + sum;
  *m = mx;
  for (int d = 0; d < D; d++) acc[d] *= corr;
  for (int j = a; j < n; j++) {
    const float w = p[j];
    #pragma omp simd
    for (int d = 0; d < D; d++) acc[d] += w * vt[j][d];
  }
}

#if defined(__AVX512F__)
#include <immintrin.h>

#define SIMD_LANES 16

/* lanes [a, n) */
static inline __mmask16 live16(int a, int n) { return (__mmask16)(((1u << n) - 1u) & ~((1u << a) - 1u)); }

/* The online softmax of one tile for one query head: x [16] scores (dead lanes -inf), live tokens [a, n) whose
   fp32 V rows are vt; updates the running max m, normaliser l and accumulator acc [D]. NV = D / 16. */
static inline __attribute__((always_inline)) void softmax_pv(
    __m512 x, int a, int n, float* m, float* l, float* acc, float vt[][MAXD], const int NV) {
  float sc[TILE] __attribute__((aligned(64)));
  __m512 av[MAXD / 16];
  const float tile_max = _mm512_reduce_max_ps(x);
  const float mx = tile_max > *m ? tile_max : *m;
  const float corr = expf(*m - mx);  /* 0 on the first tile (m = -inf) */
  const __m512 p = _mm512_maskz_mov_ps(live16(a, n), exp16(_mm512_sub_ps(x, _mm512_set1_ps(mx))));
  *l = *l * corr + _mm512_reduce_add_ps(p);
  *m = mx;
  _mm512_store_ps(sc, p);
  const __m512 c = _mm512_set1_ps(corr);
  for (int v = 0; v < NV; v++) av[v] = _mm512_mul_ps(_mm512_load_ps(acc + 16 * v), c);
  for (int j = a; j < n; j++) {
    const __m512 w = _mm512_set1_ps(sc[j]);
    for (int v = 0; v < NV; v++) av[v] = _mm512_fmadd_ps(w, _mm512_load_ps(vt[j] + 16 * v), av[v]);
  }
  for (int v = 0; v < NV; v++) _mm512_store_ps(acc + 16 * v, av[v]);
}

/* D fp32 of a cache row */
static inline void load_simd(const void* base, int64_t off, int dtype, float* dst, int D) {
  load_row(base, off, D, dtype, dst);
}

/* tile_generic's contract on 16 lanes: score j = one horizontal sum of q . k_j's 16-lane partial products */
static inline __attribute__((always_inline)) void tile_simd(
    const float* qf, float* acc, float* m, float* l, float kt[][MAXD], float vt[][MAXD], int a, int n, float cap,
    const int D) {
  const int NV = D / 16;
  float sc[TILE] __attribute__((aligned(64)));
  __m512 qv[MAXD / 16];
  for (int v = 0; v < NV; v++) qv[v] = _mm512_load_ps(qf + 16 * v);
  for (int j = a; j < n; j++) {
    __m512 dot = _mm512_mul_ps(qv[0], _mm512_load_ps(kt[j]));
    for (int v = 1; v < NV; v++) dot = _mm512_fmadd_ps(qv[v], _mm512_load_ps(kt[j] + 16 * v), dot);
    sc[j] = _mm512_reduce_add_ps(dot);
  }
  if (cap > 0.f) soft_cap(sc + a, n - a, cap);
  softmax_pv(_mm512_mask_load_ps(_mm512_set1_ps(-INFINITY), live16(a, n), sc), a, n, m, l, acc, vt, NV);
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

/* bf16 caches: q . k with the bf16 dot-product instruction straight from the bf16 query and the cache rows (no fp32
   copy of K; the rows' second and later reads of a tile hit L1), 16 scores per tile summed by sum16 then scaled;
   each V tile converted to fp32 once for the item's rows; the softmax as tile_simd's. NV = D / 16. */
static inline __attribute__((always_inline)) void item_bf16(const Item* it, const int NV) {
  const int D = NV * 16, NB = NV / 2, G = it->G;  /* NB zmm of 32 bf16 per row */
  const uint16_t *q = (const uint16_t*)it->q, *kc = (const uint16_t*)it->kc;
  float acc[ROW_FLOATS] __attribute__((aligned(64))), vt[TILE][MAXD] __attribute__((aligned(64)));
  float m[ROWS * MAXG], l[ROWS * MAXG];
  int64_t krow[TILE];
  int start[ROWS], lo, end;
  item_span(it, start, &lo, &end);
  clear_state(it, D, acc, m, l);
  const __m512 vscale = _mm512_set1_ps(it->scale);
  for (int t0 = lo / TILE * TILE; t0 < end; t0 += TILE) {
    const int n = end - t0 < TILE ? end - t0 : TILE, j0 = lo > t0 ? lo - t0 : 0;
    /* the next tile usually sits in another block: ask for its rows now, while this tile computes */
    for (int t = t0 + TILE; t < t0 + 2 * TILE && t < end; t++) {
      const int64_t row = cache_row(it, t, D);
      for (int off = 0; off < D; off += 32) {
        _mm_prefetch((const char*)(kc + row + off), _MM_HINT_T0);
        _mm_prefetch((const char*)((const uint16_t*)it->vc + row + off), _MM_HINT_T0);
      }
    }
    for (int j = j0; j < n; j++) {
      krow[j] = cache_row(it, t0 + j, D);
      load_row(it->vc, krow[j], D, BF16, vt[j]);
    }
    for (int r = 0; r < it->nr; r++) {
      int a, nl;
      if (!row_in_tile(it, start, r, t0, &a, &nl)) continue;
      __m512bh qb[MAXG][MAXD / 32];
      for (int g = 0; g < G; g++)
        for (int b = 0; b < NB; b++) qb[g][b] = (__m512bh)_mm512_loadu_si512(q + query_row(it, r * G + g, D) + 32 * b);
      __m512 part[MAXG][TILE];
      for (int j = 0; j < TILE; j++) {
        if (j < a || j >= nl) { for (int g = 0; g < G; g++) part[g][j] = _mm512_setzero_ps(); continue; }
        __m512bh kb[MAXD / 32];
        for (int b = 0; b < NB; b++) kb[b] = (__m512bh)_mm512_loadu_si512(kc + krow[j] + 32 * b);
        for (int g = 0; g < G; g++) {
          __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], kb[0]);
          for (int b = 1; b < NB; b++) dot = _mm512_dpbf16_ps(dot, qb[g][b], kb[b]);
          part[g][j] = dot;
        }
      }
      for (int g = 0; g < G; g++) {
        const int i = r * G + g;
        __m512 x = _mm512_mul_ps(sum16(part[g]), vscale);
        if (it->cap > 0.f) {
          float sc[TILE] __attribute__((aligned(64)));
          _mm512_store_ps(sc, x);
          soft_cap(sc + a, nl - a, it->cap);
          x = _mm512_load_ps(sc);
        }
        x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live16(a, nl), x);
        softmax_pv(x, a, nl, &m[i], &l[i], acc + i * D, vt, NV);
      }
    }
  }
  store_outputs(it, D, acc, l);
}
#endif

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "avx2.h"

#define SIMD_LANES 8

/* D fp32 of a cache row, 8 lanes at a time */
static inline __attribute__((always_inline)) void load_simd(const void* base, int64_t off, int dtype, float* dst,
                                                            const int D) {
  for (int v = 0; v < D / 8; v++) {
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

/* tile_generic's contract on 8 lanes: score j = the 8-lane partial products of q . k_j summed by sum8 */
static inline __attribute__((always_inline)) void tile_simd(
    const float* qf, float* acc, float* m, float* l, float kt[][MAXD], float vt[][MAXD], int a, int n, float cap,
    const int D) {
  const int NV = D / 8;
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
#endif

/* An item on fp32 tiles: each K/V tile converted once for the item's rows, then each row and head's tile_simd
   (simd: D a multiple of SIMD_LANES, a compile-time constant at the D = 64 and 128 calls) or tile_generic */
static inline __attribute__((always_inline)) void item_fp32(const Item* it, const int D, const int simd) {
  float qf[ROW_FLOATS] __attribute__((aligned(64))), acc[ROW_FLOATS] __attribute__((aligned(64)));
  float kt[TILE][MAXD] __attribute__((aligned(64))), vt[TILE][MAXD] __attribute__((aligned(64)));
  float m[ROWS * MAXG], l[ROWS * MAXG];
  int start[ROWS], lo, end;
  item_span(it, start, &lo, &end);
  clear_state(it, D, acc, m, l);
  for (int i = 0; i < it->nr * it->G; i++) {
    load_row(it->q, query_row(it, i, D), D, it->dtype, qf + i * D);
    for (int d = 0; d < D; d++) qf[i * D + d] *= it->scale;
  }
  for (int t0 = lo / TILE * TILE; t0 < end; t0 += TILE) {
    const int n = end - t0 < TILE ? end - t0 : TILE;
    for (int j = lo > t0 ? lo - t0 : 0; j < n; j++) {
      const int64_t row = cache_row(it, t0 + j, D);
#if defined(SIMD_LANES)
      if (simd) { load_simd(it->kc, row, it->dtype, kt[j], D); load_simd(it->vc, row, it->dtype, vt[j], D); continue; }
#endif
      load_row(it->kc, row, D, it->dtype, kt[j]);
      load_row(it->vc, row, D, it->dtype, vt[j]);
    }
    for (int r = 0; r < it->nr; r++) {
      int a, nl;
      if (!row_in_tile(it, start, r, t0, &a, &nl)) continue;
      for (int i = r * it->G; i < (r + 1) * it->G; i++) {
#if defined(SIMD_LANES)
        if (simd) { tile_simd(qf + i * D, acc + i * D, &m[i], &l[i], kt, vt, a, nl, it->cap, D); continue; }
#endif
        tile_generic(qf + i * D, acc + i * D, &m[i], &l[i], kt, vt, a, nl, it->cap, D);
      }
    }
  }
  store_outputs(it, D, acc, l);
}

/* The rows one item may take: ROWS (at most ROW_FLOATS of queries) for rows of a shared sequence, else 1 */
static int rows_per_item(int G, int D, const int32_t* seqs) {
  if (seqs == NULL) return 1;
  const int fit = ROW_FLOATS / (G * D);
  return fit < ROWS ? fit : ROWS;
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
    const int b = item / Hkv, s = first[b];
    const Item it = {q, kc, vc, block_tables + (int64_t)(seqs ? seqs[s] : s) * MB, lens, out, s, first[b + 1] - s,
                     window, item % Hkv, G, Hq, Hkv, BS, dtype, scale, cap};
#if defined(__AVX512BF16__)
    if (dtype == BF16 && D == 64) { item_bf16(&it, 4); continue; }
    if (dtype == BF16 && D == 128) { item_bf16(&it, 8); continue; }
    if (dtype == BF16 && D % 32 == 0) { item_bf16(&it, D / 16); continue; }
#endif
#if defined(SIMD_LANES)
    if (D == 64) { item_fp32(&it, 64, 1); continue; }
    if (D == 128) { item_fp32(&it, 128, 1); continue; }
    if (D % SIMD_LANES == 0) { item_fp32(&it, D, 1); continue; }
#endif
    item_fp32(&it, D, 0);
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

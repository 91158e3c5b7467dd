/* The fused per-token kernels of kernels/cpu/fused.py (add + RMSNorm or LayerNorm, RoPE, SiLU- and GELU-and-multiply,
   relu^2 and GELU, KV store), OpenMP over rows, fp32 math. */
#include <math.h>

#include "common.h"
#include "silu.h"

/* Each kernel is written once as a macro over the element type and its load/store, then instantiated for the
   three dtypes, so every inner loop is branch-free and vectorises. */
#define LD_F32(p, i) ((p)[i])
#define ST_F32(p, i, v) ((p)[i] = (v))
#define RND_F32(v) (v)
#define LD_BF16(p, i) bf16_to_f32((p)[i])
#define ST_BF16(p, i, v) ((p)[i] = f32_to_bf16(v))
#define LD_F16(p, i) ((float)(p)[i])
#define ST_F16(p, i, v) ((p)[i] = (_Float16)(v))
#define RND_F16(v) ((float)(_Float16)(v))

/* x [T, H] (row stride xs), residual [T, H] contiguous or NULL, weight [H], bias [H] or NULL -> out, sum [T, H]
   contiguous. `kind` says how the normed row is scaled: LLAMA_NORM rounds it to the dtype, then multiplies by weight
   (Hugging Face's LlamaRMSNorm); FP32_NORM multiplies it by offset + weight in fp32, adds the bias and rounds once
   (OLMo 2's, Gemma's (offset 1)); CENTERED_NORM does so after subtracting the row's mean (LayerNorm: Cohere's without
   bias, StarCoder2's and Nemotron's (offset 1) with) */
enum { LLAMA_NORM, FP32_NORM, CENTERED_NORM };
#define ADD_NORM(SUF, T, LD, ST, RND)                                                                              \
static void add_norm_##SUF(const T* x, int64_t xs, const T* res, T* sum, const T* w, const T* b, T* out, int n,\
                           int h, float eps, float offset, int kind, int threads) {                            \
  _Pragma("omp parallel for num_threads(threads) schedule(static)")                                            \
  for (int t = 0; t < n; t++) {                                                                                \
    const T* xr = x + (int64_t)t * xs;                                                                         \
    T* o = out + (int64_t)t * h;                                                                               \
    float ss = 0.f, total = 0.f;                                                                               \
    if (res) {                                                                                                 \
      const T* r = res + (int64_t)t * h;                                                                       \
      T* sr = sum + (int64_t)t * h;                                                                            \
      _Pragma("omp simd reduction(+:ss, total)")                                                               \
      for (int i = 0; i < h; i++) { const float v = RND(LD(r, i) + LD(xr, i)); ST(sr, i, v);                  \
                                    ss += v * v; total += v; }                                                 \
      xr = sr;                                                                                                 \
    } else {                                                                                                   \
      _Pragma("omp simd reduction(+:ss, total)")                                                               \
      for (int i = 0; i < h; i++) { const float v = LD(xr, i); ss += v * v; total += v; }                      \
    }                                                                                                          \
    const float mean = kind == CENTERED_NORM ? total / h : 0.f;                                                \
    if (kind == CENTERED_NORM) {                                                                               \
      ss = 0.f;                                                                                                \
      _Pragma("omp simd reduction(+:ss)")                                                                      \
      for (int i = 0; i < h; i++) { const float v = LD(xr, i) - mean; ss += v * v; }                           \
    }                                                                                                          \
    const float inv = 1.f / sqrtf(ss / h + eps);                                                               \
    if (kind == LLAMA_NORM) {                                                                                  \
      _Pragma("omp simd")                                                                                      \
      for (int i = 0; i < h; i++) ST(o, i, LD(w, i) * RND(LD(xr, i) * inv));                                   \
    } else if (b) {                                                                                            \
      _Pragma("omp simd")                                                                                      \
      for (int i = 0; i < h; i++) ST(o, i, ((LD(xr, i) - mean) * inv) * (offset + LD(w, i)) + LD(b, i));       \
    } else {                                                                                                   \
      _Pragma("omp simd")                                                                                      \
      for (int i = 0; i < h; i++) ST(o, i, ((LD(xr, i) - mean) * inv) * (offset + LD(w, i)));                  \
    }                                                                                                          \
  }                                                                                                            \
}

/* q [T, Hq, D] (token stride qs), k [T, Hk, D] (token stride ks), heads contiguous; table [P, R] fp32: the first
   R <= D dims of each head rotate (pairs i, i + R/2), the rest pass through (partial rotary) */
#define ROPE(SUF, T, LD, ST)                                                                                  \
static void rope_##SUF(T* q, int64_t qs, int hq, T* k, int64_t ks, int hk, const int64_t* pos,                \
                       const float* table, int n, int d, int r, int threads) {                                \
  const int half = r / 2;                                                                                      \
  _Pragma("omp parallel for num_threads(threads) schedule(static)")                                            \
  for (int t = 0; t < n; t++) {                                                                                \
    const float* c = table + pos[t] * r;                                                                       \
    const float* s = c + half;                                                                                 \
    for (int hh = 0; hh < hq + hk; hh++) {                                                                     \
      T* x = hh < hq ? q + (int64_t)t * qs + (int64_t)hh * d : k + (int64_t)t * ks + (int64_t)(hh - hq) * d;  \
      _Pragma("omp simd")                                                                                      \
      for (int i = 0; i < half; i++) {                                                                         \
        const float a = LD(x, i), b = LD(x, i + half);                                                         \
        ST(x, i, a * c[i] - b * s[i]);                                                                         \
        ST(x, i + half, b * c[i] + a * s[i]);                                                                  \
      }                                                                                                        \
    }                                                                                                          \
  }                                                                                                            \
}

/* gate, up [T, I] (row strides gs, us) -> out [T, I] contiguous: ACT(gate, up) (silu.h's silu_times or
   gelu_tanh_times), in fp32, rounded once */
#define GATED(NAME, ACT, SUF, T, LD, ST)                                                                      \
static void NAME##_##SUF(const T* g, int64_t gs, const T* u, int64_t us, T* out, int n, int m, int threads) {  \
  _Pragma("omp parallel for num_threads(threads) schedule(static)")                                            \
  for (int t = 0; t < n; t++) {                                                                                \
    const T* gr = g + (int64_t)t * gs; const T* ur = u + (int64_t)t * us; T* o = out + (int64_t)t * m;        \
    _Pragma("omp simd")                                                                                        \
    for (int i = 0; i < m; i++) ST(o, i, ACT(LD(gr, i), LD(ur, i)));                                         \
  }                                                                                                            \
}

ADD_NORM(f32, float, LD_F32, ST_F32, RND_F32)
ADD_NORM(bf16, uint16_t, LD_BF16, ST_BF16, round_bf16)
ADD_NORM(f16, _Float16, LD_F16, ST_F16, RND_F16)
ROPE(f32, float, LD_F32, ST_F32)
ROPE(bf16, uint16_t, LD_BF16, ST_BF16)
ROPE(f16, _Float16, LD_F16, ST_F16)
/* x [T, I] (row stride xs) -> out [T, I] contiguous: ACT(x) in fp32, rounded once (the MLPs without a gate) */
#define UNARY(NAME, ACT, SUF, T, LD, ST)                                                                      \
static void NAME##_##SUF(const T* x, int64_t xs, T* out, int n, int m, int threads) {                          \
  _Pragma("omp parallel for num_threads(threads) schedule(static)")                                            \
  for (int t = 0; t < n; t++) {                                                                                \
    const T* xr = x + (int64_t)t * xs; T* o = out + (int64_t)t * m;                                            \
    _Pragma("omp simd")                                                                                        \
    for (int i = 0; i < m; i++) ST(o, i, ACT(LD(xr, i)));                                                      \
  }                                                                                                            \
}
#define UNARY_ALL(NAME, ACT)                                                                                  \
  UNARY(NAME, ACT, f32, float, LD_F32, ST_F32)                                                                 \
  UNARY(NAME, ACT, bf16, uint16_t, LD_BF16, ST_BF16)                                                           \
  UNARY(NAME, ACT, f16, _Float16, LD_F16, ST_F16)                                                              \
  void NAME(const void* x, int64_t xs, void* out, int n, int m, int dtype, int threads) {                      \
    if (dtype == F32) NAME##_f32(x, xs, out, n, m, threads);                                                   \
    else if (dtype == BF16) NAME##_bf16(x, xs, out, n, m, threads);                                            \
    else NAME##_f16(x, xs, out, n, m, threads);                                                                \
  }
static inline float relu2(float a) { const float r = a > 0.f ? a : 0.f; return r * r; }
static inline float gelu_tanh(float a) { return gelu_tanh_times(a, 1.f); }
UNARY_ALL(relu2_rows, relu2)
UNARY_ALL(gelu_tanh_rows, gelu_tanh)

/* the three dtypes' kernels of one activation and their entry point NAME(..., dtype, threads) */
#define GATED_ALL(NAME, ACT)                                                                                  \
  GATED(NAME, ACT, f32, float, LD_F32, ST_F32)                                                                 \
  GATED(NAME, ACT, bf16, uint16_t, LD_BF16, ST_BF16)                                                           \
  GATED(NAME, ACT, f16, _Float16, LD_F16, ST_F16)                                                              \
  void NAME(const void* g, int64_t gs, const void* u, int64_t us, void* out, int n, int m, int dtype,         \
            int threads) {                                                                                     \
    if (dtype == F32) NAME##_f32(g, gs, u, us, out, n, m, threads);                                            \
    else if (dtype == BF16) NAME##_bf16(g, gs, u, us, out, n, m, threads);                                     \
    else NAME##_f16(g, gs, u, us, out, n, m, threads);                                                         \
  }
GATED_ALL(silu_mul, silu_times)
GATED_ALL(gelu_tanh_mul, gelu_tanh_times)

static void add_norm(const void* x, int64_t xs, const void* res, void* sum, const void* w, const void* b, void* out,
                     int n, int h, float eps, float offset, int kind, int dtype, int threads) {
  if (dtype == F32) add_norm_f32(x, xs, res, sum, w, b, out, n, h, eps, offset, kind, threads);
  else if (dtype == BF16) add_norm_bf16(x, xs, res, sum, w, b, out, n, h, eps, offset, kind, threads);
  else add_norm_f16(x, xs, res, sum, w, b, out, n, h, eps, offset, kind, threads);
}

void add_rms_norm(const void* x, int64_t xs, const void* res, void* sum, const void* w, void* out, int n, int h,
                  float eps, int dtype, int threads) {
  add_norm(x, xs, res, sum, w, NULL, out, n, h, eps, 0.f, LLAMA_NORM, dtype, threads);
}

/* add_rms_norm with the normed row times offset + weight in fp32, plus the bias b (NULL: none), rounded once;
   centered: LayerNorm's mean first */
void add_fp32_norm(const void* x, int64_t xs, const void* res, void* sum, const void* w, void* out, int n, int h,
                   float eps, float offset, int centered, const void* b, int dtype, int threads) {
  add_norm(x, xs, res, sum, w, b, out, n, h, eps, offset, centered ? CENTERED_NORM : FP32_NORM, dtype, threads);
}

void rope(void* q, int64_t qs, int hq, void* k, int64_t ks, int hk, const int64_t* pos, const float* table,
          int n, int d, int r, int dtype, int threads) {
  if (dtype == F32) rope_f32(q, qs, hq, k, ks, hk, pos, table, n, d, r, threads);
  else if (dtype == BF16) rope_bf16(q, qs, hq, k, ks, hk, pos, table, n, d, r, threads);
  else rope_f16(q, qs, hq, k, ks, hk, pos, table, n, d, r, threads);
}

/* k, v [T, row_bytes] (token strides ks, vs bytes) -> caches viewed as [slots, row_bytes] */
void kv_store(const char* k, int64_t ks, const char* v, int64_t vs, char* kc, char* vc, const int64_t* slots,
              int n, int64_t row_bytes, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static) if (n > 64)
  for (int t = 0; t < n; t++) {
    memcpy(kc + slots[t] * row_bytes, k + t * ks, row_bytes);
    memcpy(vc + slots[t] * row_bytes, v + t * vs, row_bytes);
  }
}

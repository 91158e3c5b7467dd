/* e^x in fp32, relative error ~2e-7: e^x = 2^t (t = x log2 e) = 2^floor(t) * 2^f with f in [0, 1), 2^f a degree-6
   polynomial in Horner form. Its coefficients are written once (EXP2_POLY); exp_approx evaluates it in scalar
   arithmetic, exp16 on 16 AVX-512 lanes with FMAs, exp8 on 8 AVX2 lanes with FMAs. */
#pragma once
#include <stdint.h>
#include <string.h>

#define EXP_LOG2E 1.4426950408889634f
#define EXP2_TOP 1.535336188319500e-4f /* the f^6 coefficient, where Horner starts */
/* the f^5 .. f^0 coefficients, each as STEP(c): one Horner step p = p * f + c */
#define EXP2_POLY(STEP)                                                                              \
  STEP(1.339887440266574e-3f) STEP(9.618437357674640e-3f) STEP(5.550332471162809e-2f)                \
  STEP(2.402264791363012e-1f) STEP(6.931472028550421e-1f) STEP(1.0f)

/* x <= 80 (clamped there and at -87), in plain arithmetic the compiler vectorises (libm's expf is a scalar call) */
static inline float exp_approx(float x) {
  x = x < -87.f ? -87.f : x;
  x = x > 80.f ? 80.f : x;  /* e^80 < 2^116 keeps silu.h's recip() in range */
  const float t = x * EXP_LOG2E;
  const int32_t it = (int32_t)t - (t < 0.f);  /* floor (an exact negative integer gives f = 1: still exact) */
  const float f = t - (float)it;
  float p = EXP2_TOP;
#define EXP_STEP(c) p = p * f + (c);
  EXP2_POLY(EXP_STEP)
#undef EXP_STEP
  const int32_t bits = (it + 127) << 23;
  float scale; memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 lanes, x <= 0 (clamped at -87) */
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(EXP2_TOP);
#define EXP16_STEP(c) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  EXP2_POLY(EXP16_STEP)
#undef EXP16_STEP
  return _mm512_scalef_ps(p, fi);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 8 lanes, x <= 0 (clamped at -87: 2^floor(t) stays a normal float) */
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E));
  const __m256 fi = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, fi);
  __m256 p = _mm256_set1_ps(EXP2_TOP);
#define EXP8_STEP(c) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
  EXP2_POLY(EXP8_STEP)
#undef EXP8_STEP
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

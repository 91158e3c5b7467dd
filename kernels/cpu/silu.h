/* silu(a) * u in fp32, shared by fused.c's silu_mul and the gate/up epilogues of gemm.c, gemv.c and rowwise_gemm.c
   so all round alike, and gelu(a) * u (fused.c's gelu_tanh_mul). With -std=c11 gcc does not contract a * b + c
   into an FMA, so the vectorised and scalar forms give the same bits. */
#pragma once
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "exp.h"

/* 1/x for x in [1, 2^126): a bit-trick guess refined by three Newton steps (~1e-7); vector division is ~7x
   slower than this on the project's CPU */
static inline float recip(float x) {
  int32_t b; memcpy(&b, &x, 4); b = 0x7EF311C7 - b;
  float r; memcpy(&r, &b, 4);
  r = r * (2.f - x * r); r = r * (2.f - x * r); r = r * (2.f - x * r);
  return r;
}

static inline float silu_times(float a, float u) { return a * u * recip(1.f + exp_approx(-a)); }

/* gelu(a) (its tanh approximation, Gemma's GeGLU) * u: 0.5 a (1 + tanh(y)) is a * sigmoid(2y), with
   y = sqrt(2/pi) (a + 0.044715 a^3) */
static inline float gelu_tanh_times(float a, float u) {
  const float two_y = 1.5957691216057308f * (a + 0.044715f * a * a * a);
  return a * u * recip(1.f + exp_approx(-two_y));
}

/* the gate/up epilogue of the GEMMs and the GEMV: both fp32 products rounded to bf16 first (as the unfused
   projections' bf16 outputs are), then silu(gate) * up */
static inline float silu_times_bf16(float g, float u) { return silu_times(round_bf16(g), round_bf16(u)); }

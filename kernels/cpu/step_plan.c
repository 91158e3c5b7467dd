/* A decode step as one call (kernels/cpu/step_plan.py): a list of kernel calls recorded once per batch size, over
   persistent buffers, replayed by run_plan. Each op is OP_WORDS int64: its kind, the function to call (a kernel of
   another library of this folder, by address; 0 for the three kernels below) and its arguments in that function's
   order, pointers and integers as int64, a float as its 32 bits. The thread count is the replay's, not the
   recording's: every kernel gets the count torch has when the step runs. */
#include <stdint.h>
#include <string.h>

#include "common.h"

#define OP_WORDS 20
enum { OP_ADD_RMS_NORM, OP_ROPE, OP_SILU_MUL, OP_KV_STORE, OP_QGEMV, OP_ROWWISE_GEMM, OP_PAGED_DECODE, OP_PAGED_ROWS,
       OP_COPY_ROWS, OP_ADD_ROWS, OP_ROWWISE_QGEMM, OP_GEMM_BF16, OP_QGEMM, OP_SCALE_ROWS, OP_ADD_FP32_NORM,
       OP_GELU_TANH_MUL, OP_SCALE_ROWS_AT, OP_ACTIVATION };

/* the other libraries' kernels (fused.c, gemv.c, rowwise_gemm.c, gemm.c, paged_decode.c), as declared there;
   silu_mul_fn is fused.c's gelu_tanh_mul too, activation_fn its relu2_rows and gelu_tanh_rows */
typedef void (*add_rms_norm_fn)(const void*, int64_t, const void*, void*, const void*, void*, int, int, float, int,
                                int);
typedef void (*add_fp32_norm_fn)(const void*, int64_t, const void*, void*, const void*, void*, int, int, float, float,
                                 int, const void*, int, int);
typedef void (*activation_fn)(const void*, int64_t, void*, int, int, int, int);
typedef void (*rope_fn)(void*, int64_t, int, void*, int64_t, int, const int64_t*, const float*, int, int, int, int,
                        int);
typedef void (*silu_mul_fn)(const void*, int64_t, const void*, int64_t, void*, int, int, int, int);
typedef void (*kv_store_fn)(const char*, int64_t, const char*, int64_t, char*, char*, const int64_t*, int, int64_t,
                            int);
/* gemv.c's qgemv, rowwise_gemm.c's rowwise_qgemm and gemm.c's qgemm (the AMX one): one argument list */
typedef void (*qgemv_fn)(const uint16_t*, int, int, const uint8_t*, int64_t, const uint16_t*, int64_t, int, int, int,
                         uint16_t*, int, int);
typedef void (*rowwise_gemm_fn)(const uint16_t*, int, int, const uint32_t*, int64_t, int, const uint16_t*, uint16_t*,
                                int, int);
typedef void (*gemm_bf16_fn)(const uint16_t*, int, int, const uint32_t*, int64_t, int, uint16_t*, int, int);
typedef void (*paged_decode_fn)(const void*, const void*, const void*, const int32_t*, const int32_t*, void*, int, int,
                                int, int, int, int, float, int, int);
typedef void (*paged_rows_fn)(const void*, const void*, const void*, const int32_t*, const int32_t*, const int32_t*,
                              void*, int, int, int, int, int, int, float, int, float, int, int);

/* dst row t = src row index[t] (index NULL: row t); rows of row_bytes, strides in bytes (the embedding gather, and a
   strided q made contiguous for the attention kernels) */
void copy_rows(const char* src, int64_t ss, const int64_t* index, char* dst, int64_t ds, int n, int64_t row_bytes) {
  for (int t = 0; t < n; t++) memcpy(dst + t * ds, src + (index ? index[t] : t) * ss, row_bytes);
}

/* y [n, h] bf16 (row stride ys) += b [n, h] bf16 (row stride bs; 0: one row for all, a bias), each sum rounded to
   bf16 once, as torch's bf16 add rounds */
void add_rows(uint16_t* y, int64_t ys, const uint16_t* b, int64_t bs, int n, int h) {
  for (int t = 0; t < n; t++) {
    uint16_t* yr = y + t * ys;
    const uint16_t* br = b + t * bs;
    #pragma omp simd
    for (int i = 0; i < h; i++) yr[i] = f32_to_bf16(bf16_to_f32(yr[i]) + bf16_to_f32(br[i]));
  }
}

/* y [n, h] bf16 (row stride ys) *= s, each product rounded to bf16 once, as torch rounds a bf16 tensor times a Python
   float (the float in fp32: Granite's multipliers) */
void scale_rows(uint16_t* y, int64_t ys, float s, int n, int h) {
  for (int t = 0; t < n; t++) {
    uint16_t* yr = y + t * ys;
    #pragma omp simd
    for (int i = 0; i < h; i++) yr[i] = f32_to_bf16(bf16_to_f32(yr[i]) * s);
  }
}

/* y [n, h] bf16 (row stride ys): row t times table[index[t]] (bf16), each product rounded to bf16 once, as torch
   rounds a bf16 tensor times a bf16 one (Ministral 3's query scale by position) */
void scale_rows_at(uint16_t* y, int64_t ys, const int64_t* index, const uint16_t* table, int n, int h) {
  for (int t = 0; t < n; t++) {
    uint16_t* yr = y + t * ys;
    const float s = bf16_to_f32(table[index[t]]);
    #pragma omp simd
    for (int i = 0; i < h; i++) yr[i] = f32_to_bf16(bf16_to_f32(yr[i]) * s);
  }
}

static inline float bits_f32(int64_t v) { const uint32_t u = (uint32_t)v; float f; memcpy(&f, &u, 4); return f; }

#define P(i) ((void*)a[i])
#define I(i) ((int)a[i])
void run_plan(const int64_t* ops, int n, int threads) {
  for (int i = 0; i < n; i++) {
    const int64_t* op = ops + (int64_t)i * OP_WORDS;
    const void* fn = (const void*)op[1];
    const int64_t* a = op + 2;
    switch (op[0]) {
      case OP_ADD_RMS_NORM:
        ((add_rms_norm_fn)fn)(P(0), a[1], P(2), P(3), P(4), P(5), I(6), I(7), bits_f32(a[8]), I(9), threads);
        break;
      case OP_ROPE:
        ((rope_fn)fn)(P(0), a[1], I(2), P(3), a[4], I(5), P(6), P(7), I(8), I(9), I(10), I(11), threads);
        break;
      case OP_ADD_FP32_NORM:
        ((add_fp32_norm_fn)fn)(P(0), a[1], P(2), P(3), P(4), P(5), I(6), I(7), bits_f32(a[8]), bits_f32(a[9]), I(10),
                               P(11), I(12), threads);
        break;
      case OP_SILU_MUL:
      case OP_GELU_TANH_MUL: ((silu_mul_fn)fn)(P(0), a[1], P(2), a[3], P(4), I(5), I(6), I(7), threads); break;
      case OP_KV_STORE: ((kv_store_fn)fn)(P(0), a[1], P(2), a[3], P(4), P(5), P(6), I(7), a[8], threads); break;
      case OP_QGEMV:
      case OP_ROWWISE_QGEMM:
      case OP_QGEMM:
        ((qgemv_fn)fn)(P(0), I(1), I(2), P(3), a[4], P(5), a[6], I(7), I(8), I(9), P(10), threads, I(11));
        break;
      case OP_ROWWISE_GEMM: ((rowwise_gemm_fn)fn)(P(0), I(1), I(2), P(3), a[4], I(5), P(6), P(7), threads, I(8)); break;
      case OP_GEMM_BF16: ((gemm_bf16_fn)fn)(P(0), I(1), I(2), P(3), a[4], I(5), P(6), threads, I(7)); break;
      case OP_PAGED_DECODE:
        ((paged_decode_fn)fn)(P(0), P(1), P(2), P(3), P(4), P(5), I(6), I(7), I(8), I(9), I(10), I(11),
                              bits_f32(a[12]), I(13), threads);
        break;
      case OP_PAGED_ROWS:
        ((paged_rows_fn)fn)(P(0), P(1), P(2), P(3), P(4), P(5), P(6), I(7), I(8), I(9), I(10), I(11), I(12),
                            bits_f32(a[13]), I(14), bits_f32(a[15]), I(16), threads);
        break;
      case OP_COPY_ROWS: copy_rows(P(0), a[1], P(2), P(3), a[4], I(5), a[6]); break;
      case OP_ADD_ROWS: add_rows(P(0), a[1], P(2), a[3], I(4), I(5)); break;
      case OP_SCALE_ROWS: scale_rows(P(0), a[1], bits_f32(a[2]), I(3), I(4)); break;
      case OP_SCALE_ROWS_AT: scale_rows_at(P(0), a[1], P(2), P(3), I(4), I(5)); break;
      case OP_ACTIVATION: ((activation_fn)fn)(P(0), a[1], P(2), I(3), I(4), I(5), threads); break;
    }
  }
}

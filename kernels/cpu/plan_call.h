/* One recorded call of step_plan.c's plans (kernels/cpu/step_plan.py), for every library that replays one (step_plan.c,
   moe.c): OP_WORDS int64, its kind, the function to call (a kernel of another library of this folder, by address; 0
   for step_plan.c's own kernels) and its arguments in that function's order, pointers and integers as int64, a float
   as its 32 bits. */
#pragma once
#include <stdint.h>
#include <string.h>

#define OP_WORDS 20
enum { OP_ADD_RMS_NORM, OP_ROPE, OP_SILU_MUL, OP_KV_STORE, OP_QGEMV, OP_ROWWISE_GEMM, OP_PAGED_DECODE, OP_PAGED_ROWS,
       OP_COPY_ROWS, OP_ADD_ROWS, OP_ROWWISE_QGEMM, OP_GEMM_BF16, OP_QGEMM, OP_SCALE_ROWS, OP_ADD_FP32_NORM,
       OP_GELU_TANH_MUL, OP_SCALE_ROWS_AT, OP_ACTIVATION, OP_MOE, OP_SIGMOID_GATED_ADD };

/* the other libraries' kernels (fused.c, gemv.c, rowwise_gemm.c, gemm.c, paged_decode.c, moe.c), as declared there;
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
typedef void (*moe_fn)(const void*, const uint16_t*, int, int, const int64_t*, const int64_t*, uint16_t*, uint16_t*,
                       uint16_t*, float*, float*, int32_t*, float*, int32_t*, uint16_t*, int);
typedef void (*gated_add_fn)(uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, int, int, int);
typedef void (*paged_rows_fn)(const void*, const void*, const void*, const int32_t*, const int32_t*, const int32_t*,
                              void*, int, int, int, int, int, int, float, int, float, int, int);

static inline float bits_f32(int64_t v) { const uint32_t u = (uint32_t)v; float f; memcpy(&f, &u, 4); return f; }

/* where a GEMM call (OP_QGEMV, OP_ROWWISE_QGEMM, OP_QGEMM, OP_ROWWISE_GEMM, OP_GEMM_BF16) holds its output pointer,
   among its arguments (x is argument 0, the row count argument 1 in all five); -1 for other kinds */
static inline int gemm_output_arg(int64_t kind) {
  switch (kind) {
    case OP_QGEMV: case OP_ROWWISE_QGEMM: case OP_QGEMM: return 10;
    case OP_ROWWISE_GEMM: return 7;
    case OP_GEMM_BF16: return 6;
    default: return -1;
  }
}

#define P(i) ((void*)a[i])
#define I(i) ((int)a[i])
/* run `op` if it calls another library's kernel (on `threads` threads); 0 if it is one of step_plan.c's own */
static int call_kernel(const int64_t* op, int threads) {
  const void* fn = (const void*)op[1];
  const int64_t* a = op + 2;
  switch (op[0]) {
    case OP_ADD_RMS_NORM:
      ((add_rms_norm_fn)fn)(P(0), a[1], P(2), P(3), P(4), P(5), I(6), I(7), bits_f32(a[8]), I(9), threads);
      return 1;
    case OP_ROPE:
      ((rope_fn)fn)(P(0), a[1], I(2), P(3), a[4], I(5), P(6), P(7), I(8), I(9), I(10), I(11), threads);
      return 1;
    case OP_ADD_FP32_NORM:
      ((add_fp32_norm_fn)fn)(P(0), a[1], P(2), P(3), P(4), P(5), I(6), I(7), bits_f32(a[8]), bits_f32(a[9]), I(10),
                             P(11), I(12), threads);
      return 1;
    case OP_SILU_MUL:
    case OP_GELU_TANH_MUL: ((silu_mul_fn)fn)(P(0), a[1], P(2), a[3], P(4), I(5), I(6), I(7), threads); return 1;
    case OP_KV_STORE: ((kv_store_fn)fn)(P(0), a[1], P(2), a[3], P(4), P(5), P(6), I(7), a[8], threads); return 1;
    case OP_QGEMV:
    case OP_ROWWISE_QGEMM:
    case OP_QGEMM:
      ((qgemv_fn)fn)(P(0), I(1), I(2), P(3), a[4], P(5), a[6], I(7), I(8), I(9), P(10), threads, I(11));
      return 1;
    case OP_ROWWISE_GEMM:
      ((rowwise_gemm_fn)fn)(P(0), I(1), I(2), P(3), a[4], I(5), P(6), P(7), threads, I(8));
      return 1;
    case OP_GEMM_BF16: ((gemm_bf16_fn)fn)(P(0), I(1), I(2), P(3), a[4], I(5), P(6), threads, I(7)); return 1;
    case OP_PAGED_DECODE:
      ((paged_decode_fn)fn)(P(0), P(1), P(2), P(3), P(4), P(5), I(6), I(7), I(8), I(9), I(10), I(11),
                            bits_f32(a[12]), I(13), threads);
      return 1;
    case OP_PAGED_ROWS:
      ((paged_rows_fn)fn)(P(0), P(1), P(2), P(3), P(4), P(5), P(6), I(7), I(8), I(9), I(10), I(11), I(12),
                          bits_f32(a[13]), I(14), bits_f32(a[15]), I(16), threads);
      return 1;
    case OP_ACTIVATION: ((activation_fn)fn)(P(0), a[1], P(2), I(3), I(4), I(5), threads); return 1;
    case OP_MOE:
      ((moe_fn)fn)(P(0), P(1), I(2), I(3), P(4), P(5), P(6), P(7), P(8), P(9), P(10), P(11), P(12), P(13), P(14),
                   threads);
      return 1;
    case OP_SIGMOID_GATED_ADD: ((gated_add_fn)fn)(P(0), P(1), P(2), P(3), I(4), I(5), threads); return 1;
    default: return 0;
  }
}

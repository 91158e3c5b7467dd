/* A decode step as one call (kernels/cpu/step_plan.py): a list of kernel calls recorded once per batch size, over
   persistent buffers, replayed by run_plan. Each op is one plan_call.h call (the kernels below are its own, the
   others called by address). The thread count is the replay's, not the recording's: every kernel gets the count
   torch has when the step runs. */
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "plan_call.h"

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

void run_plan(const int64_t* ops, int n, int threads) {
  for (int i = 0; i < n; i++) {
    const int64_t* op = ops + (int64_t)i * OP_WORDS;
    const int64_t* a = op + 2;
    if (call_kernel(op, threads)) continue;
    switch (op[0]) {
      case OP_COPY_ROWS: copy_rows(P(0), a[1], P(2), P(3), a[4], I(5), a[6]); break;
      case OP_ADD_ROWS: add_rows(P(0), a[1], P(2), a[3], I(4), I(5)); break;
      case OP_SCALE_ROWS: scale_rows(P(0), a[1], bits_f32(a[2]), I(3), I(4)); break;
      case OP_SCALE_ROWS_AT: scale_rows_at(P(0), a[1], P(2), P(3), I(4), I(5)); break;
    }
  }
}

/* The logits rows of a CPU decode step (kernels/cpu/logits.py): bf16 -> fp32, and each row's first maximum.
   OpenMP over rows. */
#include <math.h>

#include "common.h"

/* out [n, v] fp32 (row stride os) = x [n, v] bf16 (row stride xs), exactly */
void bf16_rows_to_f32(const uint16_t* x, int64_t xs, float* out, int64_t os, int n, int v, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < n; r++) {
    const uint16_t* xr = x + (int64_t)r * xs;
    float* o = out + (int64_t)r * os;
    #pragma omp simd
    for (int i = 0; i < v; i++) o[i] = bf16_to_f32(xr[i]);
  }
}

/* idx[r] = the first index of row r's maximum of x [n, v] fp32 (row stride xs); a row holding NaN gives its
   first NaN (torch.max's rule: NaN propagates) */
void argmax_rows(const float* x, int64_t xs, int n, int v, int64_t* idx, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < n; r++) {
    const float* xr = x + (int64_t)r * xs;
    float best = -INFINITY;
    int nan = 0;
    #pragma omp simd reduction(max:best) reduction(|:nan)
    for (int i = 0; i < v; i++) { best = xr[i] > best ? xr[i] : best; nan |= xr[i] != xr[i]; }
    int64_t at = 0;
    for (int i = 0; i < v; i++)
      if (nan ? xr[i] != xr[i] : xr[i] == best) { at = i; break; }
    idx[r] = at;
  }
}

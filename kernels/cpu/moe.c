/* A sparse MoE block's routing and routed experts as one call (kernels/cpu/moe.py): what models/moe.py's MoE.forward
   computes, without a Python call per expert. Eager serving and the decode step plans both call it, so their
   outputs are one computation's.

   route: logits = x @ router^T [n, E] (fp32 sums rounded to bf16, as a bf16 nn.Linear's) -> each token's k experts (chosen, int32 [n, k], in rank order) and weights (fp32
   [n, k]): softmax in fp32, the k largest logits (ties to the lower expert), their probabilities, renormalised to
   sum 1 with `normalize`, rounded to bf16 unless fp32_weights (Mixtral's weights stay fp32 in the product).
   experts: the n * k choices sorted by expert (a counting sort: tokens ascending within an expert); expert e's m
   tokens gathered into xg [m, H], act = gate_up(xg) [m, I] (the GEMM's silu(gate) * up epilogue), y = down(act)
   [m, H]; out[t] += bf16(y * weight) in expert order, each sum rounded to bf16 (torch's index_add of the products).
   Each expert linear is a recorded plan_call.h GEMM call (calls [E, 2, CALL_WORDS]: gate_up, down) with its x, row
   count and y replaced: words [0, OP_WORDS) the call on its kernel for small row counts, then that kernel's row
   limit (0: any), then the address of the kernel for more rows (same arguments). */
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "exp.h"
#include "plan_call.h"

#define CALL_WORDS (OP_WORDS + 2)

static void call_linear(const int64_t* call, const void* x, int m, void* y, int threads) {
  int64_t op[OP_WORDS];
  memcpy(op, call, sizeof op);
  if (call[OP_WORDS] && m > call[OP_WORDS]) op[1] = call[OP_WORDS + 1];
  op[2] = (int64_t)(intptr_t)x;
  op[3] = m;
  op[2 + gemm_output_arg(op[0])] = (int64_t)(intptr_t)y;
  call_kernel(op, threads);
}

/* whether logit v of expert j ranks after (u, i): lower, or equal from a higher expert */
static inline int ranks_after(float v, int j, float u, int i) { return v < u || (v == u && j > i); }

/* logits [n, E] = x [n, H] @ router [E, H]^T, each an fp32 sum over H rounded to bf16 */
static void router_logits(const uint16_t* x, const uint16_t* router, int n, int E, int H, uint16_t* logits,
                          int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t te = 0; te < (int64_t)n * E; te++) {
    const uint16_t* xr = x + (te / E) * H;
    const uint16_t* wr = router + (te % E) * H;
    float sum = 0.f;
    #pragma omp simd reduction(+ : sum)
    for (int h = 0; h < H; h++) sum += bf16_to_f32(xr[h]) * bf16_to_f32(wr[h]);
    logits[te] = f32_to_bf16(sum);
  }
}

static void route(const uint16_t* logits, int n, int E, int k, int normalize, int fp32_weights, int32_t* chosen,
                  float* weights) {
  for (int t = 0; t < n; t++) {
    const uint16_t* l = logits + (int64_t)t * E;
    int32_t* c = chosen + (int64_t)t * k;
    float* w = weights + (int64_t)t * k;
    float top = bf16_to_f32(l[0]);
    for (int j = 1; j < E; j++) top = bf16_to_f32(l[j]) > top ? bf16_to_f32(l[j]) : top;
    float sum = 0.f;
    for (int j = 0; j < E; j++) sum += exp_approx(bf16_to_f32(l[j]) - top);
    float chosen_sum = 0.f;
    for (int r = 0; r < k; r++) {  /* the best expert ranking after the previous pick */
      int best = -1;
      float bv = 0.f;
      for (int j = 0; j < E; j++) {
        const float v = bf16_to_f32(l[j]);
        if (r && !ranks_after(v, j, bf16_to_f32(l[c[r - 1]]), c[r - 1])) continue;
        if (best < 0 || ranks_after(bv, best, v, j)) { best = j; bv = v; }
      }
      c[r] = best;
      w[r] = exp_approx(bv - top) / sum;
      chosen_sum += w[r];
    }
    for (int r = 0; r < k; r++) {
      if (normalize) w[r] /= chosen_sum;
      if (!fp32_weights) w[r] = round_bf16(w[r]);
    }
  }
}

/* x [n, H] bf16 contiguous, router [E, H] bf16 -> out [n, H] bf16; scratch: xg [n, H], act [n, I], y [n, H], logits
   [n, E] bf16, chosen int32 [n, k], weights fp32 [n, k], order int32 [E + 1 + n * k] */
void moe_forward(const uint16_t* router, int E, const uint16_t* x, int n, int H, int k, int normalize, int fp32_weights,
                 const int64_t* calls, uint16_t* xg, uint16_t* act, uint16_t* y, uint16_t* logits, int32_t* chosen,
                 float* weights, int32_t* order, uint16_t* out, int threads) {
  router_logits(x, router, n, E, H, logits, threads);
  route(logits, n, E, k, normalize, fp32_weights, chosen, weights);
  int32_t* ends = order;  /* ends[e]: where expert e's slots end in `slots` (its start: ends[e - 1], or 0) */
  int32_t* slots = order + E + 1;
  memset(ends, 0, sizeof(int32_t) * (E + 1));
  for (int s = 0; s < n * k; s++) ends[chosen[s] + 1]++;
  for (int e = 0; e < E; e++) ends[e + 1] += ends[e];  /* now the starts, shifted: ends[e] = start of e */
  for (int s = 0; s < n * k; s++) slots[ends[chosen[s]]++] = s;  /* ends[e] = end of e */
  memset(out, 0, sizeof(uint16_t) * (int64_t)n * H);
  for (int e = 0; e < E; e++) {
    const int start = e ? ends[e - 1] : 0, m = ends[e] - start;
    if (!m) continue;
    for (int i = 0; i < m; i++)
      memcpy(xg + (int64_t)i * H, x + (int64_t)(slots[start + i] / k) * H, sizeof(uint16_t) * H);
    const int64_t* call = calls + (int64_t)e * 2 * CALL_WORDS;
    call_linear(call, xg, m, act, threads);
    call_linear(call + CALL_WORDS, act, m, y, threads);
    for (int i = 0; i < m; i++) {
      const int s = slots[start + i];
      const float w = weights[s];
      uint16_t* o = out + (int64_t)(s / k) * H;
      const uint16_t* yr = y + (int64_t)i * H;
      #pragma omp simd
      for (int h = 0; h < H; h++) o[h] = f32_to_bf16(bf16_to_f32(o[h]) + round_bf16(bf16_to_f32(yr[h]) * w));
    }
  }
}

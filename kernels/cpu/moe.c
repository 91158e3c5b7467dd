/* A sparse MoE block's routing and routed experts as one call (kernels/cpu/moe.py): what models/moe.py's MoE.routed
   computes, without a Python call per expert. Eager serving and the decode step plans both call it, so their
   outputs are one computation's.

   logits = x @ router^T [n, E], fp32 sums over H (a bf16 router's rounded to bf16, as a bf16 nn.Linear's; an fp32
   router's, BiasedRouter's, kept). routing (int64 [ROUTE_WORDS]) says how they choose each token's k experts
   (chosen, int32 [n, k], in rank order) and weights (fp32 [n, k]), as models/moe.py's select() methods:
     ROUTE_SOFTMAX            values = softmax(logits); key = values; w = values, / their sum with `normalize`
     ROUTE_CORRECTED_SOFTMAX  values = softmax(logits); key = values + bias; w / max(their sum, param) (ERNIE 4.5)
     ROUTE_GROUPED_SIGMOID    values = sigmoid(logits); key = values + bias, only in the topk_groups groups of the
                              best two-key sums; w / (their sum + 1e-20) with `normalize`, times param (GLM-4.5)
   the k largest keys (ties to the lower expert), the weights rounded to bf16 unless fp32_weights. exp is exp.h's.
   experts: the n * k choices sorted by expert (a counting sort: tokens ascending within an expert); expert e's m
   tokens gathered into xg [m, H], act = gate_up(xg) [m, I] (the GEMM's silu(gate) * up epilogue), y = down(act)
   [m, H]; out[t] += bf16(y * weight) in expert order, each sum rounded to bf16 (torch's index_add of the products).
   Each expert linear is a recorded plan_call.h GEMM call (calls [E, 2, CALL_WORDS]: gate_up, down) with its x, row
   count and y replaced: words [0, OP_WORDS) the call on its kernel for small row counts, then that kernel's row
   limit (0: any), then the address of the kernel for more rows (same arguments).
   sigmoid_gated_add: Qwen2-MoE's shared expert, added after the routed ones. */
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

enum { ROUTE_SOFTMAX, ROUTE_CORRECTED_SOFTMAX, ROUTE_GROUPED_SIGMOID };
/* routing's words, in order */
enum { R_MODE, R_EXPERTS, R_TOP_K, R_NORMALIZE, R_FP32_WEIGHTS, R_FP32_ROUTER, R_BIAS, R_GROUPS, R_TOPK_GROUPS, R_PARAM,
       ROUTE_WORDS };

/* logits [n, E] fp32 = x [n, H] @ router [E, H]^T (router bf16, the sums rounded to bf16; or fp32, kept) */
static void router_logits(const uint16_t* x, const void* router, int fp32_router, int n, int E, int H, float* logits,
                          int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t te = 0; te < (int64_t)n * E; te++) {
    const uint16_t* xr = x + (te / E) * H;
    float sum = 0.f;
    if (fp32_router) {
      const float* wr = (const float*)router + (te % E) * H;
      #pragma omp simd reduction(+ : sum)
      for (int h = 0; h < H; h++) sum += bf16_to_f32(xr[h]) * wr[h];
    } else {
      const uint16_t* wr = (const uint16_t*)router + (te % E) * H;
      #pragma omp simd reduction(+ : sum)
      for (int h = 0; h < H; h++) sum += bf16_to_f32(xr[h]) * bf16_to_f32(wr[h]);
    }
    logits[te] = fp32_router ? sum : round_bf16(sum);
  }
}

/* whether key v of index j ranks after (u, i): lower, or equal from a higher index */
static inline int ranks_after(float v, int j, float u, int i) { return v < u || (v == u && j > i); }

/* out[0..k): the indices of the k largest of key[0..E) (ties to the lower index), in rank order; k <= E, no NaN */
static void top_k(const float* key, int E, int k, int32_t* out) {
  for (int r = 0; r < k; r++) {  /* the best entry ranking after the previous pick */
    int best = -1;
    for (int j = 0; j < E; j++) {
      if (r && !ranks_after(key[j], j, key[out[r - 1]], out[r - 1])) continue;
      if (best < 0 || ranks_after(key[best], best, key[j], j)) best = j;
    }
    out[r] = best;
  }
}

/* GLM-4.5's group limit: key [E] of `groups` groups; keys outside the topk_groups groups of the largest two-key sums
   become -inf (E / groups >= 2) */
static void limit_groups(float* key, int E, int groups, int topk_groups) {
  const int per = E / groups;
  float rank[groups];
  int32_t best[groups];
  for (int g = 0; g < groups; g++) {
    int32_t two[2];
    top_k(key + g * per, per, 2, two);
    rank[g] = key[g * per + two[0]] + key[g * per + two[1]];
  }
  top_k(rank, groups, topk_groups, best);
  for (int g = 0; g < groups; g++) {
    int eligible = 0;
    for (int i = 0; i < topk_groups; i++) eligible |= best[i] == g;
    if (!eligible)
      for (int j = 0; j < per; j++) key[g * per + j] = -__builtin_inff();
  }
}

/* logits [n, E] -> chosen [n, k], weights [n, k] as `routing` says; logits become the keys, values [n, E] scratch */
static void route(const int64_t* routing, int n, float* logits, float* values, int32_t* chosen, float* weights) {
  const int mode = (int)routing[R_MODE], E = (int)routing[R_EXPERTS], k = (int)routing[R_TOP_K];
  const float* bias = (const float*)(intptr_t)routing[R_BIAS];
  const float param = bits_f32(routing[R_PARAM]);
  for (int t = 0; t < n; t++) {
    float* key = logits + (int64_t)t * E;
    float* v = values + (int64_t)t * E;
    int32_t* c = chosen + (int64_t)t * k;
    float* w = weights + (int64_t)t * k;
    if (mode == ROUTE_GROUPED_SIGMOID) {
      for (int j = 0; j < E; j++) v[j] = 1.f / (1.f + exp_approx(-key[j]));
    } else {
      float top = key[0], sum = 0.f;
      for (int j = 1; j < E; j++) top = key[j] > top ? key[j] : top;
      for (int j = 0; j < E; j++) sum += v[j] = exp_approx(key[j] - top);
      for (int j = 0; j < E; j++) v[j] /= sum;
    }
    for (int j = 0; j < E; j++) {
      key[j] = v[j] + (mode == ROUTE_SOFTMAX ? 0.f : bias[j]);
      key[j] = key[j] == key[j] ? key[j] : -__builtin_inff();  /* NaN ranks last: every key compares */
    }
    if (mode == ROUTE_GROUPED_SIGMOID) limit_groups(key, E, (int)routing[R_GROUPS], (int)routing[R_TOPK_GROUPS]);
    top_k(key, E, k, c);
    float sum = 0.f;
    for (int r = 0; r < k; r++) sum += w[r] = v[c[r]];
    float divisor = 1.f;
    if (mode == ROUTE_CORRECTED_SOFTMAX) divisor = sum > param ? sum : param;
    else if (routing[R_NORMALIZE]) divisor = mode == ROUTE_GROUPED_SIGMOID ? sum + 1e-20f : sum;
    for (int r = 0; r < k; r++) {
      w[r] /= divisor;
      if (mode == ROUTE_GROUPED_SIGMOID) w[r] *= param;
      if (!routing[R_FP32_WEIGHTS]) w[r] = round_bf16(w[r]);
    }
  }
}

/* x [n, H] bf16 contiguous, router [E, H] (bf16 or fp32: routing) -> out [n, H] bf16; scratch: xg [n, H], act
   [n, I], y [n, H] bf16, logits and values fp32 [n, E], chosen int32 [n, k], weights fp32 [n, k], order int32
   [E + 1 + n * k] */
void moe_forward(const void* router, const uint16_t* x, int n, int H, const int64_t* routing, const int64_t* calls,
                 uint16_t* xg, uint16_t* act, uint16_t* y, float* logits, float* values, int32_t* chosen,
                 float* weights, int32_t* order, uint16_t* out, int threads) {
  const int E = (int)routing[R_EXPERTS], k = (int)routing[R_TOP_K];
  router_logits(x, router, (int)routing[R_FP32_ROUTER], n, E, H, logits, threads);
  route(routing, n, logits, values, chosen, weights);
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

/* out [n, H] bf16 += bf16(shared * s_t), s_t = bf16(sigmoid(bf16(x_t . gate))) (x, shared [n, H], gate [H] bf16;
   the dot an fp32 sum): Qwen2-MoE's gated shared expert, each step rounded to bf16 as torch's bf16 ops round it */
void sigmoid_gated_add(uint16_t* out, const uint16_t* shared, const uint16_t* x, const uint16_t* gate, int n, int H,
                       int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int t = 0; t < n; t++) {
    const uint16_t* xr = x + (int64_t)t * H;
    float dot = 0.f;
    #pragma omp simd reduction(+ : dot)
    for (int h = 0; h < H; h++) dot += bf16_to_f32(xr[h]) * bf16_to_f32(gate[h]);
    const float s = round_bf16(1.f / (1.f + exp_approx(-round_bf16(dot))));
    uint16_t* o = out + (int64_t)t * H;
    const uint16_t* sh = shared + (int64_t)t * H;
    #pragma omp simd
    for (int h = 0; h < H; h++) o[h] = f32_to_bf16(bf16_to_f32(o[h]) + round_bf16(bf16_to_f32(sh[h]) * s));
  }
}

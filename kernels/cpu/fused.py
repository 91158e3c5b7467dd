"""Fused CPU kernels for the per-token work between the matmuls (C, OpenMP over rows, fp32 math):

  add_rms_norm   sum = residual + x (rounded to the dtype), out = weight * rms_norm(sum): one pass instead of
                 the eight ops of the torch path
  rope           rotate-half RoPE of q and k in place, cos/sin from a fp32 table [positions, D] (cos | sin)
  silu_mul       out = silu(gate) * up
  kv_store       copy each token's K and V rows into the paged cache at its slot (replaces index_copy_)

Rounding follows the model's torch path (quantkit/models/llama.py): the normalised value is rounded to the
dtype before the weight multiplies it, as in Hugging Face's LlamaRMSNorm; products are otherwise rounded once
(the torch path rounds after every op), so bf16 results differ from it by at most a rounding step.
CpuFusedOps is the model's `ops` (see TorchOps in llama.py for the contract) when the library builds.
"""

from __future__ import annotations

import ctypes

import torch

from quantkit.models.llama import TorchOps
from quantkit.kernels.cpu.build import C_DTYPES, C_SILU, DTYPE_CODES, load_library

C_SOURCE = C_DTYPES + C_SILU + r"""
#include <math.h>

/* Each kernel is written once as a macro over the element type and its load/store, then instantiated for the
   three dtypes, so every inner loop is branch-free and vectorises. */
#define LD_F32(p, i) ((p)[i])
#define ST_F32(p, i, v) ((p)[i] = (v))
#define RND_F32(v) (v)
#define LD_BF16(p, i) bf16_to_f32((p)[i])
#define ST_BF16(p, i, v) ((p)[i] = f32_to_bf16(v))
#define RND_BF16(v) bf16_to_f32(f32_to_bf16(v))
#define LD_F16(p, i) ((float)(p)[i])
#define ST_F16(p, i, v) ((p)[i] = (_Float16)(v))
#define RND_F16(v) ((float)(_Float16)(v))

/* x [T, H] (row stride xs), residual [T, H] contiguous or NULL, weight [H] -> out, sum [T, H] contiguous */
#define ADD_RMS_NORM(SUF, T, LD, ST, RND)                                                                          \
static void add_rms_norm_##SUF(const T* x, int64_t xs, const T* res, T* sum, const T* w, T* out, int n, int h, \
                               float eps, int threads) {                                                       \
  _Pragma("omp parallel for num_threads(threads) schedule(static)")                                            \
  for (int t = 0; t < n; t++) {                                                                                \
    const T* xr = x + (int64_t)t * xs;                                                                         \
    T* o = out + (int64_t)t * h;                                                                               \
    float ss = 0.f;                                                                                            \
    if (res) {                                                                                                 \
      const T* r = res + (int64_t)t * h;                                                                       \
      T* sr = sum + (int64_t)t * h;                                                                            \
      _Pragma("omp simd reduction(+:ss)")                                                                      \
      for (int i = 0; i < h; i++) { const float v = RND(LD(r, i) + LD(xr, i)); ST(sr, i, v);     \
                                    ss += v * v; }                                                             \
      xr = sr;                                                                                                 \
    } else {                                                                                                   \
      _Pragma("omp simd reduction(+:ss)")                                                                      \
      for (int i = 0; i < h; i++) { const float v = LD(xr, i); ss += v * v; }                                   \
    }                                                                                                          \
    const float inv = 1.f / sqrtf(ss / h + eps);                                                               \
    _Pragma("omp simd")                                                                                        \
    for (int i = 0; i < h; i++) ST(o, i, LD(w, i) * RND(LD(xr, i) * inv));                        \
  }                                                                                                            \
}

/* q [T, Hq, D] (token stride qs), k [T, Hk, D] (token stride ks), heads contiguous; table [P, D] fp32 */
#define ROPE(SUF, T, LD, ST)                                                                                  \
static void rope_##SUF(T* q, int64_t qs, int hq, T* k, int64_t ks, int hk, const int64_t* pos,                \
                       const float* table, int n, int d, int threads) {                                       \
  const int half = d / 2;                                                                                      \
  _Pragma("omp parallel for num_threads(threads) schedule(static)")                                            \
  for (int t = 0; t < n; t++) {                                                                                \
    const float* c = table + pos[t] * d;                                                                       \
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

/* gate, up [T, I] (row strides gs, us) -> out [T, I] contiguous */
#define SILU_MUL(SUF, T, LD, ST)                                                                              \
static void silu_mul_##SUF(const T* g, int64_t gs, const T* u, int64_t us, T* out, int n, int m, int threads) { \
  _Pragma("omp parallel for num_threads(threads) schedule(static)")                                            \
  for (int t = 0; t < n; t++) {                                                                                \
    const T* gr = g + (int64_t)t * gs; const T* ur = u + (int64_t)t * us; T* o = out + (int64_t)t * m;        \
    _Pragma("omp simd")                                                                                        \
    for (int i = 0; i < m; i++) ST(o, i, silu_times(LD(gr, i), LD(ur, i)));                                  \
  }                                                                                                            \
}

ADD_RMS_NORM(f32, float, LD_F32, ST_F32, RND_F32)
ADD_RMS_NORM(bf16, uint16_t, LD_BF16, ST_BF16, RND_BF16)
ADD_RMS_NORM(f16, _Float16, LD_F16, ST_F16, RND_F16)
ROPE(f32, float, LD_F32, ST_F32)
ROPE(bf16, uint16_t, LD_BF16, ST_BF16)
ROPE(f16, _Float16, LD_F16, ST_F16)
SILU_MUL(f32, float, LD_F32, ST_F32)
SILU_MUL(bf16, uint16_t, LD_BF16, ST_BF16)
SILU_MUL(f16, _Float16, LD_F16, ST_F16)

void add_rms_norm(const void* x, int64_t xs, const void* res, void* sum, const void* w, void* out, int n, int h,
                  float eps, int dtype, int threads) {
  if (dtype == F32) add_rms_norm_f32(x, xs, res, sum, w, out, n, h, eps, threads);
  else if (dtype == BF16) add_rms_norm_bf16(x, xs, res, sum, w, out, n, h, eps, threads);
  else add_rms_norm_f16(x, xs, res, sum, w, out, n, h, eps, threads);
}

void rope(void* q, int64_t qs, int hq, void* k, int64_t ks, int hk, const int64_t* pos, const float* table,
          int n, int d, int dtype, int threads) {
  if (dtype == F32) rope_f32(q, qs, hq, k, ks, hk, pos, table, n, d, threads);
  else if (dtype == BF16) rope_bf16(q, qs, hq, k, ks, hk, pos, table, n, d, threads);
  else rope_f16(q, qs, hq, k, ks, hk, pos, table, n, d, threads);
}

void silu_mul(const void* g, int64_t gs, const void* u, int64_t us, void* out, int n, int m, int dtype,
              int threads) {
  if (dtype == F32) silu_mul_f32(g, gs, u, us, out, n, m, threads);
  else if (dtype == BF16) silu_mul_bf16(g, gs, u, us, out, n, m, threads);
  else silu_mul_f16(g, gs, u, us, out, n, m, threads);
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
"""

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "add_rms_norm": [_P, _I64, _P, _P, _P, _P, _INT, _INT, _F, _INT, _INT],
    "rope": [_P, _I64, _INT, _P, _I64, _INT, _P, _P, _INT, _INT, _INT, _INT],
    "silu_mul": [_P, _I64, _P, _I64, _P, _INT, _INT, _INT, _INT],
    "kv_store": [_P, _I64, _P, _I64, _P, _P, _P, _INT, _I64, _INT],
}


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """t [T, ...]: (T, token stride in elements); the trailing dims must be contiguous (checked once per call: on
    the decode path these checks cost as much as the kernels, so the contiguous case goes first)."""
    if not t.is_contiguous():
        assert t.stride(-1) == 1 and all(t.stride(i) == t.stride(i + 1) * t.shape[i + 1] for i in range(1, t.dim() - 1))
    return t.shape[0], t.stride(0)


def _ours(*tensors: torch.Tensor) -> bool:
    """Tensors the kernels take: on CPU, one dtype among DTYPE_CODES."""
    dtype = tensors[0].dtype
    if dtype not in DTYPE_CODES:
        return False
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu:
            return False
    return True


class CpuFusedOps:
    """The model's per-token ops as fused C kernels (the TorchOps contract of quantkit/models/llama.py). Inputs the
    kernels do not cover (another device or dtype, mixed dtypes, the dense [B, L, H, D] layout) take TorchOps."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    @classmethod
    def load(cls) -> "CpuFusedOps | None":
        lib = load_library("fused_ops", C_SOURCE, SIGNATURES)
        return None if lib is None else cls(lib)

    # stateless: a copied or unpickled model shares the loaded kernels
    def __deepcopy__(self, memo) -> "CpuFusedOps":
        return self

    def __reduce__(self):
        return CpuFusedOps.load, ()

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        """x [..., H] -> (weight * norm(x + residual), x + residual) (x alone when residual is None)."""
        if not _ours(x, weight) or (residual is not None and residual.dtype != x.dtype):
            return TorchOps.rms_norm(x, residual, weight, eps)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        n, xs = _rows(x2)
        out = torch.empty(x2.shape, dtype=x.dtype)
        total = x
        if residual is not None:
            residual = residual.contiguous()
            assert residual.shape == shape
            total = torch.empty(shape, dtype=x.dtype)
        self.lib.add_rms_norm(x2.data_ptr(), xs, None if residual is None else residual.data_ptr(),
                              None if residual is None else total.data_ptr(), weight.data_ptr(), out.data_ptr(),
                              n, shape[-1], eps, DTYPE_CODES[x.dtype], torch.get_num_threads())
        return out.view(shape), total

    def rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary):
        """q [T, Hq, D], k [T, Hkv, D] rotated in place at positions [T]."""
        if q.dim() != 3 or positions.dim() != 1 or not _ours(q, k):
            return TorchOps.rope(q, k, positions, rotary)
        table = rotary.table(positions)  # [P, D] fp32: cos | sin
        positions = positions.to(torch.int64).contiguous()
        n, qs = _rows(q)
        _, ks = _rows(k)
        self.lib.rope(q.data_ptr(), qs, q.shape[1], k.data_ptr(), ks, k.shape[1], positions.data_ptr(),
                      table.data_ptr(), n, q.shape[-1], DTYPE_CODES[q.dtype], torch.get_num_threads())
        return q, k

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [..., I] (rows may be strided) -> silu(gate) * up [..., I]."""
        if not _ours(gate, up):
            return TorchOps.silu_mul(gate, up)
        shape = gate.shape
        g2, u2 = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
        n, gs = _rows(g2)
        _, us = _rows(u2)
        out = torch.empty(g2.shape, dtype=gate.dtype)
        self.lib.silu_mul(g2.data_ptr(), gs, u2.data_ptr(), us, out.data_ptr(), n, shape[-1],
                          DTYPE_CODES[gate.dtype], torch.get_num_threads())
        return out.view(shape)

    def kv_store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """k, v [T, Hkv, D] -> k_cache/v_cache [blocks, block_size, Hkv, D] at flat slots [T] (int64)."""
        n, ks = _rows(k)
        _, vs = _rows(v)
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and slots.dtype == torch.int64
        row = k.shape[1] * k.shape[2] * k.element_size()
        self.lib.kv_store(k.data_ptr(), ks * k.element_size(), v.data_ptr(), vs * v.element_size(),
                          k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), n, row,
                          torch.get_num_threads())

"""Compile a C source once with the system C compiler (cached per source, flags, CPU and torch), load it with ctypes.

The library links the libgomp torch already loaded, so its OpenMP threads are torch's. Used by the CPU kernels of
cpu_attention.py and cpu_fused.py; a machine without a working compiler gets None and the torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from quantkit.files import cache_root

log = logging.getLogger("quantkit.serve")

# -fno-trapping-math lets the vectoriser if-convert clamps; nothing here reads floating-point exception flags
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC",
         "-std=c11"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the `dtype` argument of every kernel

# silu(a) * u in fp32, shared by cpu_fused's silu_mul and cpu_gemm's gate/up epilogue so both round alike. With
# -std=c11 gcc does not contract a * b + c into an FMA, so the vectorised and scalar forms give the same bits.
C_SILU = r"""
/* e^x for x <= 80 (clamped there), relative error ~2e-7, in plain arithmetic the compiler vectorises (libm's expf is a scalar call) */
static inline float exp_approx(float x) {
  x = x < -87.f ? -87.f : x;
  x = x > 80.f ? 80.f : x;  /* e^80 < 2^116 keeps recip() in range */
  const float t = x * 1.4426950408889634f;
  const int32_t it = (int32_t)t - (t < 0.f);  /* floor (an exact negative integer gives f = 1: still exact) */
  const float f = t - (float)it;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (it + 127) << 23;
  float scale; memcpy(&scale, &bits, 4);
  return p * scale;
}

/* 1/x for x in [1, 2^126): a bit-trick guess refined by three Newton steps (~1e-7); vector division is ~7x
   slower than this on the project's CPU */
static inline float recip(float x) {
  int32_t b; memcpy(&b, &x, 4); b = 0x7EF311C7 - b;
  float r; memcpy(&r, &b, 4);
  r = r * (2.f - x * r); r = r * (2.f - x * r); r = r * (2.f - x * r);
  return r;
}

static inline float silu_times(float a, float u) { return a * u * recip(1.f + exp_approx(-a)); }
"""

# fp32 <-> the 16-bit types, shared by the kernels' sources (bf16 rounds to nearest even, as torch does)
C_DTYPES = r"""
#include <stdint.h>
#include <string.h>
enum { F32 = 0, BF16 = 1, F16 = 2 };
static inline float bf16_to_f32(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u; memcpy(&u, &f, 4); u += 0x7FFFu + ((u >> 16) & 1u); return (uint16_t)(u >> 16);
}
"""


# AMX tiles: the permission request and the one tile shape the kernels use
C_AMX = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 when this process may use AMX tiles (asks Linux for the permission once) */
int amx_ready(void) {
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct { uint8_t palette; uint8_t start_row; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

/* every tile 16 rows x 64 bytes (each kernel says what its tiles hold) */
static void tiles_on(void) {
  tilecfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
}
"""

# e^x on 16 fp32 lanes with AVX-512 (cpu_attention's decode softmax, cpu_prefill's)
C_EXP16 = r"""
#if defined(__AVX512F__)
#include <immintrin.h>

/* e^x for 16 lanes, x <= 0 (clamped at -87), relative error ~2e-7 */
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, fi);
}
#endif
"""


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(source: str, out: Path) -> None:
    """Compile source into out (atomic)."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc/cc) found")
    torch_lib = Path(torch.__file__).parent / "lib"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, lib = Path(tmp) / f"{out.stem}.c", Path(tmp) / f"{out.stem}.so"
        src.write_text(source)
        gomp = [str(torch_lib / "libgomp.so.1"), f"-Wl,-rpath,{torch_lib}"] if (torch_lib / "libgomp.so.1").exists() else []
        subprocess.run([compiler, *FLAGS, str(src), "-o", str(lib), *gomp, "-lm"], check=True, capture_output=True,
                       text=True, timeout=300)
        os.replace(lib, out)


_loaded: dict[str, ctypes.CDLL | None] = {}


def load_library(name: str, source: str, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The compiled library of `source` (built on first use, then cached on disk, loaded once per process), or None
    when it cannot be built here (logged once). signatures: function name -> ctypes argtypes of each void function
    the callers use (other functions keep ctypes' int return)."""
    if name in _loaded:
        return _loaded[name]
    key = hashlib.sha256((source + " ".join(FLAGS) + _cpu_signature() + torch.__version__).encode()).hexdigest()
    path = cache_root() / "kernels" / f"{name}-{key[:16]}.so"
    try:
        if not path.exists():
            _build(source, path)
        lib = ctypes.CDLL(str(path))
        for fn_name, argtypes in signatures.items():
            fn = getattr(lib, fn_name)
            fn.restype, fn.argtypes = None, argtypes
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or ""
        log.warning("CPU kernels %s unavailable (%s %s): using the torch path", name, e, detail[-500:])
        lib = None
    _loaded[name] = lib
    return lib

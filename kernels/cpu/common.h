/* fp32 <-> the 16-bit types of the kernels' tensors (bf16 rounds to nearest even, as torch does); the dtype codes
   every kernel takes (build.py's DTYPE_CODES) */
#pragma once
#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline float bf16_to_f32(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u; memcpy(&u, &f, 4); u += 0x7FFFu + ((u >> 16) & 1u); return (uint16_t)(u >> 16);
}
/* v rounded to bf16 and back (nearest even) */
static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

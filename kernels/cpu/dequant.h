/* W4/W8 codes of gemm.py's packing -> bf16 VNNI blocks (gemm.c's AMX GEMM and rowwise_gemm.c's AVX-512 BF16 and
   AVX2 ones), w = s * (q - z) in fp32 rounded to bf16 once (nearest even), as dequantize(qt, bfloat16); AVX-512 or
   AVX2 + F16C, the same bits */
#pragma once
#include <immintrin.h>
#include <stdint.h>

/* one block's codes -> its VNNI block out [K/2][16] (bf16 of k = 2r in the low half, 2r + 1 in the high half) */
#if defined(__AVX512BF16__)
static inline void dequant_block(const void* codes, const uint16_t* qp, int K, int gs, int bits, uint32_t* out) {
  const int pairs_per_group = gs / 2;
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 s = _mm512_setzero_ps(), z = s;
  for (int r = 0; r < K / 2; r++) {
    if (r % pairs_per_group == 0) {
      const uint16_t* p = qp + (int64_t)(r / pairs_per_group) * 32;  /* fp16 scale, zero */
      s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
      z = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 16)));
    }
    __m512i v, lo, hi;
    if (bits == 4) {
      v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)((const uint8_t*)codes + (int64_t)r * 16)));
      lo = _mm512_and_si512(v, _mm512_set1_epi32(15));
      hi = _mm512_srli_epi32(v, 4);
    } else {
      v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)codes + (int64_t)r * 16)));
      lo = _mm512_and_si512(v, _mm512_set1_epi32(255));
      hi = _mm512_srli_epi32(v, 8);
    }
    const __m512 wlo = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(lo), z), s);
    const __m512 whi = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(hi), z), s);
    /* bf16 [wlo 0..15 | whi 0..15] -> pairs (wlo n, whi n) */
    const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(whi, wlo);
    _mm512_store_si512((__m512i*)(out + (int64_t)r * 16), _mm512_permutexvar_epi16(interleave, halves));
  }
}
#else
#include "avx2.h"

static inline void dequant_block(const void* codes, const uint16_t* qp, int K, int gs, int bits, uint32_t* out) {
  const int pairs_per_group = gs / 2;
  const __m256i low = _mm256_set1_epi32(bits == 4 ? 15 : 255);
  __m256 s[2], z[2];
  for (int r = 0; r < K / 2; r++) {
    if (r % pairs_per_group == 0) {
      const uint16_t* p = qp + (int64_t)(r / pairs_per_group) * 32;  /* fp16 scale, zero */
      for (int h = 0; h < 2; h++) {
        s[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8 * h)));
        z[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 + 8 * h)));
      }
    }
    for (int h = 0; h < 2; h++) {  /* columns 8h .. 8h + 7 */
      const __m256i v = bits == 4
          ? _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)((const uint8_t*)codes + (int64_t)r * 16 + 8 * h)))
          : _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)codes + (int64_t)r * 16 + 8 * h)));
      const __m256 wlo = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), z[h]), s[h]);
      const __m256 whi = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, bits)), z[h]), s[h]);
      _mm256_storeu_si256((__m256i*)(out + (int64_t)r * 16 + 8 * h),
                          _mm256_or_si256(bf16_bits8(wlo), _mm256_slli_epi32(bf16_bits8(whi), 16)));
    }
  }
}
#endif

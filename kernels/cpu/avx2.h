/* AVX2 helpers of the bf16 kernels' AVX2 builds (rowwise_gemm.c, dequant.h): bf16 <-> fp32 on 8 lanes */
#pragma once
#include <immintrin.h>

/* 8 bf16 in the even (low) or odd (high) halves of 8 32-bit words -> fp32 */
static inline __m256 even8(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 odd8(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* 8 fp32 -> their bf16 bits in each lane's low half (nearest even, as common.h's f32_to_bf16) */
static inline __m256i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
}

/* 8 fp32 -> 8 packed bf16 */
static inline __m128i bf16x8(__m256 v) {
  const __m256i r = bf16_bits8(v);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

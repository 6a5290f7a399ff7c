// What q_avx2.cpp's products share: its names from cpu_blocks.h and simd16.h, integer sums
// pinned to registers, and a group of 32 bf16 x loaded, and a row quantized to int8 per group of
// 32 (the int8 rows of q4_mm and q8g_mm).

#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "cpu_blocks.h"
#include "simd16.h"  // its AVX2 backend: this file is built without AVX-512

namespace {

using treeserve_cpu::over_blocks;
using treeserve_cpu::over_row_chunks;

using simd16::bf16_round8;
using simd16::bf16x8;
using simd16::reduce_add8;
using simd16::reduce_max8;

// v, kept in a register as it is here: GCC may not reassociate a chain of integer adds through
// it (see q_avx2.cpp's comment).
inline __m256i pinned(__m256i v) {
  asm("" : "+x"(v));
  return v;
}

inline int32_t reduce_add_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}


// A group of 32 bf16 x widened to fp32 (v, exact), their largest |x| and their fp32 sum. max_ps
// drops a NaN operand in favour of the other, so only the sum is sure to carry a NaN (or inf).
inline void load_group(const uint16_t* x, __m256 v[4], float& amax, float& total) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) v[i] = bf16x8(x + i * 8);
  amax = reduce_max8(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
  total = reduce_add8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
}

// One row's groups, as q4_amx.cpp's quantize_row: xq (K int8), d, -8 d sum(xq), and xs (the
// exact sum of the group's x). A group whose largest |x| is under 1e-30 counts as zero in the
// codes' term; NaN and inf rows stay non-finite through d and xs.
void quantize_row(const uint16_t* x, int64_t K, int8_t* xq, float* d, float* c8, float* xs) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < K / 32; ++g) {
    __m256 v[4];
    float amax, total;
    load_group(x + g * 32, v, amax, total);
    const bool tiny = amax < 1e-30f;
    const float scale = tiny ? 0.0f : amax / 127.0f, inverse = tiny ? 0.0f : 127.0f / amax;
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));  // nearest even
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * 32), _mm256_permutevar8x32_epi32(bytes, order));
    const int32_t qsum = reduce_add_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    // A NaN or inf x: total is non-finite, and so is every output of the row (via xs * zero).
    d[g] = scale;
    c8[g] = -8.0f * scale * static_cast<float>(qsum);
    xs[g] = total;
  }
}

}  // namespace

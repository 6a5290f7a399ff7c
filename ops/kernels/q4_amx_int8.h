// q4_amx.cpp's int8-row product (AVX512-VNNI): each row quantized per group of 32, vpdpbusd on
// the 4-bit codes (int8_gemm); quantize_row serves codes8 too.

#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "q4_amx_groups.h"

namespace {

// ---------------------------------------------------------------------------------------------
// int8 rows (AVX512-VNNI), for CPUs without AMX tiles, at every row count. Each row is quantized
// per group of 32 as llama.cpp's Q8_0 blocks are: d = max |x| / 127, xq = round(x / d) in int8.
// vpdpbusd multiplies the 4-bit codes (u8) by xq (s8) four k at a time, exactly in int32, so
//   sum_{k in g} x (q - 8)  ~  d * (sum xq q - 8 sum xq),
// scaled by the group's scale in fp32; the zero term takes the exact fp32 sum of the bf16 row.
// The weights are the same values as on the other paths; the rows are rounded to 8 bits a
// group (the precision llama.cpp computes these products in), which is what makes the products
// 4.6x cheaper than vdpbf16ps's on a CPU without tiles (64 products in 0.46 ns against 32 in
// 1.05 ns a core, measured).
//
// The packing serves as it is: a tile row pair p holds, per column c, the bytes of k = 4p, 4p+1
// (low nibbles) and 4p+2, 4p+3 (high nibbles); widened to 32 bits a column, (v | v << 12) &
// 0x0F0F0F0F puts the four codes in k order in the lane, matching four bytes of xq.

// One row's groups: xq (K int8), and per group d and -8 d sum(xq) (the zero term's exact sums
// of x come from group_sums).
void quantize_row(const uint16_t* x, int64_t K, int8_t* xq, float* d, float* c8) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const __m512 v0 = bf16x16_to_f32(x + g * 32), v1 = bf16x16_to_f32(x + g * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    // A group whose largest |x| is under 1e-30 counts as zero in the codes' term (127 / amax
    // would overflow from 3.7e-37 down); NaN and inf rows stay non-finite through d.
    const bool tiny = amax < 1e-30f;
    const float scale = tiny ? 0.0f : amax / 127.0f, inverse = tiny ? 0.0f : 127.0f / amax;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inverse)));  // nearest, ties to even
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inverse)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * 32), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * 32 + 16), _mm512_cvtsepi32_epi8(q1));
    d[g] = scale;
    c8[g] = -8.0f * scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

// 64 codes of one tile row pair (32 bytes: 16 columns) -> the u8 operand of vpdpbusd.
inline __m512i codes_u8(const uint8_t* src) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x0F0F0F0F), 0xA8);  // (a | b) & c
}

template <int R>
void int8_blocks(const int8_t* xq, const float* d, const float* c8, const float* xs, int64_t K, int64_t N,
                 const uint8_t* codes, const uint16_t* sz, uint16_t* y, int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32;
  row_blocks<R>(G, N, codes, sz, y, nb_begin, nb_end, [&](__m512 (&acc)[R][2], const uint8_t* src, const uint16_t* s,
                                                          int64_t g) {
    for (int h = 0; h < 2; ++h) {
      __m512i w[8];
      for (int p = 0; p < 8; ++p) w[p] = codes_u8(src + h * 256 + p * 32);
      __m512i dot[R];
      for (int m = 0; m < R; ++m) dot[m] = _mm512_setzero_si512();
      for (int p = 0; p < 8; ++p) {
        for (int m = 0; m < R; ++m) {
          int32_t four;
          memcpy(&four, xq + m * K + g * 32 + 4 * p, sizeof(four));
          dot[m] = _mm512_dpbusd_epi32(dot[m], w[p], _mm512_set1_epi32(four));
        }
      }
      const __m512 scale = bf16x16_to_f32(s + h * 16), zero = bf16x16_to_f32(s + 32 + h * 16);
      for (int m = 0; m < R; ++m) {
        const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_set1_ps(d[m * G + g]),
                                         _mm512_set1_ps(c8[m * G + g]));
        acc[m][h] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * G + g]), zero, _mm512_fmadd_ps(t, scale, acc[m][h]));
      }
    }
  });
}

constexpr int kInt8Rows = 4;

void int8_gemm(const uint16_t* x, int64_t M, int64_t K, int64_t N, const uint8_t* codes, const uint16_t* sz,
               uint16_t* y) {
  const int64_t G = K / 32, NB = N / 32;
  int8_t* xq = static_cast<int8_t*>(aligned_alloc(64, ((M * K + 63) / 64) * 64));
  float* f = static_cast<float*>(aligned_alloc(64, ((3 * M * G * 4 + 63) / 64) * 64));
  float *d = f, *c8 = f + M * G, *xs = f + 2 * M * G;
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, xq + m * K, d + m * G, c8 + m * G);
  group_sums(x, M, K, xs);
  over_blocks(NB, [&](int64_t begin, int64_t end) {
    over_row_chunks<kInt8Rows>(M, [&](auto rows, int64_t m) {
      int8_blocks<decltype(rows)::value>(xq + m * K, d + m * G, c8 + m * G, xs + m * G, K, N, codes, sz, y + m * N,
                                         begin, end);
    });
  });
  free(xq);
  free(f);
}

}  // namespace

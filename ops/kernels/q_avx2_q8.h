// q_avx2.cpp's q8_mm: the Q8_0 head on int16 rows (vpmaddwd against the codes widened to int16).

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmath>
#include <limits>

#include "q_avx2_rows.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Q8_0 head

constexpr int64_t kQ8BlockBytes = 2 * 16 * 32;
constexpr int64_t kQ8PrefetchBytes = 4096;
constexpr int kQ8Rows = 2;  // rows a pass: their 2 x 4 int32 sums, the 4 widened code vectors and x fill 14 registers

// One row's groups as int16 codes with a power-of-two scale: d = 2^(e - 14) for the group's
// largest |x| in [2^e, 2^(e+1)), xq = round(x / d), so |xq| <= 32640 and every bf16 x within 2^8
// of the largest is exact (its 8 significant bits sit on the grid); smaller ones are off by at
// most d / 2 = 2^-15 of the largest's power of two. A group of zeros (largest |x| under 1e-30)
// has d = 0; a non-finite group has d = NaN, so its row's outputs are NaN.
void quantize_row16(const uint16_t* x, int64_t K, int16_t* xq, float* d) {
  for (int64_t g = 0; g < K / 32; ++g) {
    __m256 v[4];
    float amax, total;
    load_group(x + g * 32, v, amax, total);
    if (!std::isfinite(total) || !std::isfinite(amax) || amax < 1e-30f) {
      memset(xq + g * 32, 0, 32 * sizeof(int16_t));
      d[g] = std::isfinite(total) && std::isfinite(amax) ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const int e = std::ilogb(amax);
    const __m256 inverse = _mm256_set1_ps(std::ldexp(1.0f, 14 - e));
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // exact scaling, nearest even
    // packs works per 128-bit lane: [q0 lo, q1 lo, q0 hi, q1 hi] -> 0xD8 puts the quarters in order.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * 32), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * 32 + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
    d[g] = std::ldexp(1.0f, e - 14);
  }
}

// The 16 codes of 8 columns x 2 k (half h, tile row r, columns 8v .. 8v+7) as int16, the
// vpmaddwd operand: lane 2c + j is column c's code for k = 2r + j.
inline __m256i codes16(const int8_t* src, int h, int r, int v) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + h * 512 + r * 32 + v * 16)));
}

// Rows m0 .. m0+R-1 over one group of one 32-column block: the int32 dots of their int16 codes
// with the weights' (vpmaddwd, exact: at most 32 * 32640 * 127 < 2^31), then one fp32 step a
// column, acc += float(dot) * (dw * dx) (float(dot) rounds once above 2^24; dw * dx is exact,
// dx being a power of two). `codes(h, r, v)` gives the widened weights; every row count runs
// the same operations per row.
template <int R, class Codes>
inline void q8_rows(const int16_t* xq, const float* dx, int64_t K, int64_t G, int64_t g, const __m256* dw, float* acc,
                    int64_t m0, Codes codes) {
  __m256i dot[R][4];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < 4; ++c) dot[m][c] = _mm256_setzero_si256();
  for (int r = 0; r < 16; ++r) {
    __m256i w[4];
    for (int c = 0; c < 4; ++c) w[c] = codes(c / 2, r, c % 2);
    for (int m = 0; m < R; ++m) {
      int32_t pair;
      memcpy(&pair, xq + (m0 + m) * K + g * 32 + 2 * r, sizeof(pair));
      const __m256i xb = _mm256_set1_epi32(pair);
      for (int c = 0; c < 4; ++c) dot[m][c] = pinned(_mm256_add_epi32(dot[m][c], _mm256_madd_epi16(w[c], xb)));
    }
  }
  for (int m = 0; m < R; ++m) {
    const __m256 x_scale = _mm256_set1_ps(dx[(m0 + m) * G + g]);
    float* a = acc + (m0 + m) * 32;
    for (int c = 0; c < 4; ++c)
      _mm256_store_ps(a + c * 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][c]), _mm256_mul_ps(dw[c], x_scale),
                                                 _mm256_load_ps(a + c * 8)));
  }
}

void q8_blocks(const int16_t* xq, const float* dx, int64_t M, int64_t K, int64_t N, const int8_t* codes,
               const uint16_t* scales, float* y, int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32;
  alignas(64) int16_t wide[2][16][32];  // one group's codes as int16 (M > 1): half, tile row, lane
  float* acc = static_cast<float*>(aligned_alloc(64, M * 32 * 4));
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    memset(acc, 0, M * 32 * 4);
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* src = codes + (nb * G + g) * kQ8BlockBytes;
      for (int line = 0; line < kQ8BlockBytes / 64; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(src + kQ8PrefetchBytes + line * 64), _MM_HINT_T0);
      const uint16_t* s = scales + (nb * G + g) * 32;
      __m256 dw[4];  // columns 8c .. 8c+7
      for (int c = 0; c < 4; ++c) dw[c] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + c * 8)));
      if (M == 1) {  // a decode step: the codes widened in registers as they stream
        q8_rows<1>(xq, dx, K, G, g, dw, acc, 0, [&](int h, int r, int v) { return codes16(src, h, r, v); });
        continue;
      }
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < 16; ++r)
          for (int v = 0; v < 2; ++v)
            _mm256_store_si256(reinterpret_cast<__m256i*>(&wide[h][r][v * 16]), codes16(src, h, r, v));
      const auto widened = [&](int h, int r, int v) {
        return _mm256_load_si256(reinterpret_cast<const __m256i*>(&wide[h][r][v * 16]));
      };
      over_row_chunks<kQ8Rows>(M, [&](auto rows, int64_t m0) {
        q8_rows<decltype(rows)::value>(xq, dx, K, G, g, dw, acc, m0, widened);
      });
    }
    for (int64_t m = 0; m < M; ++m) memcpy(y + m * N + nb * 32, acc + m * 32, 32 * sizeof(float));
  }
  free(acc);
}

at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "treeserve_avx2::q8_mm: x must be 2-D bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, G = K / 32;
  TORCH_CHECK(K % 32 == 0 && N % 32 == 0 && codes.numel() == N * K && codes.scalar_type() == at::kChar &&
                  codes.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.numel() == N * G,
              "treeserve_avx2::q8_mm: the packing does not fit x");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  int16_t* xq = static_cast<int16_t*>(aligned_alloc(64, ((M * K * 2 + 63) / 64) * 64));
  float* dx = static_cast<float*>(aligned_alloc(64, ((M * G * 4 + 63) / 64) * 64));
  for (int64_t m = 0; m < M; ++m) quantize_row16(xp + m * K, K, xq + m * K, dx + m * G);
  const auto* cp = codes.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  float* yp = y.data_ptr<float>();
  over_blocks(N / 32, [&](int64_t begin, int64_t end) { q8_blocks(xq, dx, M, K, N, cp, sp, yp, begin, end); });
  free(xq);
  free(dx);
  return y;
}

}  // namespace

// q_avx2.cpp's q8g_mm: signed 8-bit codes by group (kernels/codes8.py) on int8 rows.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmath>
#include <limits>

#include "codes5.h"
#include "cpu_blocks.h"
#include "q_avx2_rows.h"

namespace {

// ---------------------------------------------------------------------------------------------
// codes8: signed 8-bit codes by group (GGUF's Q8_0, Q5_0, Q5_1, Q5_K, Q6_K), q4_amx.cpp's
// q8g_mm on AVX2 (see there for the format, the layout and the order of the fp32 steps, which
// this one follows lane for lane: the same bits). The integer dots: vpmaddubsw takes u8 x s8, and
// a code may be any int8, so it gets |code| and xq carrying the code's sign (vpsignb; llama.cpp's
// Q8_0 on AVX2): a pair of products is then at most 2 * 128 * 127 = 32512, no saturation, and
// vpmaddwd by ones widens each 4 k of a column to int32 (exact), summed in int32 (pinned, as q4's).
// Four instructions a 32 products a row (vpdpbusd: one a 64): against q4_mm (2 threads, the
// default model's linears in cache) 1.3-1.7x its time at one, 16 and 64 rows.

using treeserve_cpu::kCodes8Bytes;
using treeserve_cpu::prefetch_codes8;
constexpr int kCodes8Rows = 4;  // rows a pass: their 4 x 2 int32 sums, the quad's codes and x fill the 16 registers

// Output blocks [nb_begin, nb_end) of 16 columns for all M rows: a group's codes stay in L1 while
// the rows go through them kCodes8Rows at a time, each row's 16 fp32 sums in acc (memory).
template <bool kHalves, bool kZeros>
void codes8_blocks(const int8_t* xq, const float* d, const float* xs, int64_t M, int64_t K, int64_t N,
                   const int8_t* codes, const float* scales, const float* zeros, void* y, bool float_out,
                   int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32, scale_floats = kHalves ? 32 : 16;
  const __m256i ones = _mm256_set1_epi16(1);
  float* acc = static_cast<float*>(aligned_alloc(64, M * 16 * 4));
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    memset(acc, 0, M * 16 * 4);
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* src = codes + (nb * G + g) * kCodes8Bytes;
      const float* s = scales + (nb * G + g) * scale_floats;
      const float* z = kZeros ? zeros + (nb * G + g) * 16 : nullptr;
      prefetch_codes8(src, s, scale_floats, z);
      over_row_chunks<kCodes8Rows>(M, [&](auto rows, int64_t m0) {
        constexpr int R = decltype(rows)::value;
        __m256i dot[R][2];  // columns 0-7, 8-15
        for (int h = 0; h < 2; ++h) {  // k 0-15, 16-31: each a scale's group where kHalves
          if (h == 0 || kHalves)
            for (int m = 0; m < R; ++m) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
          for (int p = 4 * h; p < 4 * h + 4; ++p) {
            const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + p * 64));
            const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + p * 64 + 32));
            const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);  // |-128| = 128 as u8
            for (int m = 0; m < R; ++m) {
              int32_t four;
              memcpy(&four, xq + (m0 + m) * K + g * 32 + 4 * p, sizeof(four));
              const __m256i xb = _mm256_set1_epi32(four);
              dot[m][0] = pinned(_mm256_add_epi32(dot[m][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0)), ones)));
              dot[m][1] = pinned(_mm256_add_epi32(dot[m][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1)), ones)));
            }
          }
          if (!kHalves && h == 0) continue;
          for (int m = 0; m < R; ++m) {
            const int64_t row = (m0 + m) * G + g;
            const __m256 dm = _mm256_set1_ps(d[row]);
            float* a = acc + (m0 + m) * 16;
            for (int c = 0; c < 2; ++c) {
              const __m256 scale = _mm256_loadu_ps(s + (kHalves ? h * 16 : 0) + c * 8);
              __m256 t = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot[m][c]), dm), scale, _mm256_load_ps(a + c * 8));
              if constexpr (kZeros)  // once a group, after its scale groups' terms
                if (h == 1) t = _mm256_fmadd_ps(_mm256_set1_ps(xs[row]), _mm256_loadu_ps(z + c * 8), t);
              _mm256_store_ps(a + c * 8, t);
            }
          }
        }
      });
    }
    for (int64_t m = 0; m < M; ++m) {
      for (int c = 0; c < 2; ++c) {
        const __m256 v = _mm256_load_ps(acc + m * 16 + c * 8);
        if (float_out) _mm256_storeu_ps(static_cast<float*>(y) + m * N + nb * 16 + c * 8, v);
        else _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(y) + m * N + nb * 16 + c * 8), bf16_round8(v));
      }
    }
  }
  free(acc);
}

at::Tensor q8g_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                  int64_t out_features, bool float_out) {
  const auto [halves, with_zeros, five_bits, offset] =
      treeserve_cpu::check_codes8("treeserve_avx2::q8g_mm", x, codes, scales, zeros, out_features);
  const int64_t M = x.size(0), K = x.size(1), N = out_features, G = K / 32;
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  int8_t* xq = static_cast<int8_t*>(aligned_alloc(64, ((M * K + 63) / 64) * 64));
  float* f = static_cast<float*>(aligned_alloc(64, ((3 * M * G * 4 + 63) / 64) * 64));
  float *d = f, *c8 = f + M * G, *xs = f + 2 * M * G;  // c8: quantize_row's -8 d sum(xq)
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, xq + m * K, d + m * G, c8 + m * G, xs + m * G);
  // A group whose xs is not finite (a NaN or inf x): d = NaN, so its row's outputs are NaN with
  // or without zeros (q4_amx.cpp's codes8_rows does the same).
  // The zero term's factor: the group's quantized sum d * sum(xq) (exactly -c8 / 8), not the
  // exact sum, so that a weight's offset meets the same rounded row as its code does.
  for (int64_t i = 0; i < M * G; ++i) {
    if (!std::isfinite(xs[i])) d[i] = std::numeric_limits<float>::quiet_NaN();
    xs[i] = c8[i] * -0.125f;
  }
  const auto* cp = static_cast<const int8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* zp = with_zeros ? zeros.data_ptr<float>() : nullptr;
  const auto blocks = [&](const int8_t* c, const float* s, const float* z, void* out, int64_t begin, int64_t end) {
    if (halves && with_zeros) codes8_blocks<true, true>(xq, d, xs, M, K, N, c, s, z, out, float_out, begin, end);
    else if (halves) codes8_blocks<true, false>(xq, d, xs, M, K, N, c, s, z, out, float_out, begin, end);
    else if (with_zeros) codes8_blocks<false, true>(xq, d, xs, M, K, N, c, s, z, out, float_out, begin, end);
    else codes8_blocks<false, false>(xq, d, xs, M, K, N, c, s, z, out, float_out, begin, end);
  };
  over_blocks(N / 16, [&](int64_t begin, int64_t end) {
    if (!five_bits) return blocks(cp, sp, zp, y.data_ptr(), begin, end);
    // Five-bit codes: widened a block at a time (codes5.h), the same products.
    treeserve_cpu::over_five_bit_blocks(cp, sp, zp, y.data_ptr(), M, G, kCodes8Rows, halves ? 32 : 16,
                                        float_out ? 4 : 2, offset, begin, end,
                                        [&](const int8_t* c, const float* s, const float* z, char* out, int64_t n) {
                                          blocks(c, s, z, out, 0, n);
                                        });
  });
  free(xq);
  free(f);
  return y;
}

}  // namespace

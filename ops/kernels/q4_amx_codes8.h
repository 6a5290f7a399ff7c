// q4_amx.cpp's q8g_mm: signed 8-bit codes by group (kernels/codes8.py) on the int8 rows of
// q4_amx_int8.h.

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
#include "q4_amx_int8.h"

namespace {

// ---------------------------------------------------------------------------------------------
// codes8: signed 8-bit codes by group (GGUF's Q8_0, Q5_0, Q5_1, Q5_K and Q6_K as they are),
//   w[n, k] = scale[n, k / S] * code[n, k] + zero[n, k / 32]   (S = 32 or 16; zeros optional),
// on int8 rows as q4_amx_int8.h's (quantize_row): per group g of row m, with h the group's 32 k (S = 32)
// or its two halves of 16 (S = 16),
//   acc = fma(float(dot_h) * d[m, g], scale[n, h], acc) for each h, then acc = fma(s[m, g], zero[n, g], acc),
// s the quantized row's sum d * sum(xq) over the group (the rounded row times the weights; see
// kernels/codes8.py),
// dot_h the exact int32 sum of code * xq over h (under 2^19 in size, so float(dot_h) is exact).
// vpdpbusd multiplies u8 by s8, so the codes go in as u = code ^ 0x80 = code + 128 (one vpxord per
// 64 bytes, shared by the pass's rows) and each dot starts at -128 * sum_h(xq) (exact in int32).
// Every fp32 step is lane-wise in that order, whatever the row count, and in q_avx2.cpp's build
// too: its integer dots are the same integers, and the bf16 stores here round as its do
// (simd16's integer rounding: vcvtneps2bf16 would flush subnormal sums to zero, which it keeps).
// Against the q4_1 int8-row path on the default model's linears (2 threads): one row 0.9-1.2x
// its time with the weights in cache, 1.5-1.7x from memory (twice the bytes); 16 and 64 rows
// 0.7-0.9x (no nibbles to unpack).
//
// Layouts (built by treeserve.ops.kernels.codes8.pack):
//   codes  [N/16][K/32][8 quads][16 columns][4] int8: a quad is 4 consecutive k of a column, so
//          one 64-byte row of a quad is one vpdpbusd operand for 16 columns.
//   scales [N/16][K/S][16] fp32;  zeros [N/16][K/32][16] fp32, or none.
//   y      (M, N) bf16 (nearest even) or fp32.

using treeserve_cpu::kCodes8Bytes;
using treeserve_cpu::prefetch_codes8;
constexpr int kCodes8Rows = 4;  // rows a pass (six: no faster; eight: their sums spill, 1.6x slower)

// R rows (their xq, d, bias and xs offset to the first) for output blocks [nb_begin, nb_end) of
// 16 columns: each row's 16 sums in one fp32 register over the K / 32 groups, then stored.
// kHalves: S = 16; kZeros: the zero term. bias[(m * G + g) * 2 + h] = -128 * sum_h(xq).
template <int R, bool kHalves, bool kZeros>
void codes8_blocks(const int8_t* xq, const float* d, const int32_t* bias, const float* xs, int64_t K, int64_t N,
                   const int8_t* codes, const float* scales, const float* zeros, void* y, bool float_out,
                   int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32, scale_floats = kHalves ? 32 : 16;
  const __m512i flip = _mm512_set1_epi8(-128);
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    __m512 acc[R];
    for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* src = codes + (nb * G + g) * kCodes8Bytes;
      const float* s = scales + (nb * G + g) * scale_floats;
      const float* z = kZeros ? zeros + (nb * G + g) * 16 : nullptr;
      prefetch_codes8(src, s, scale_floats, z);
      __m512i u[8];
      for (int p = 0; p < 8; ++p) u[p] = _mm512_xor_si512(_mm512_loadu_si512(src + p * 64), flip);
      __m512i dot[R][2];  // quads 0-3 and 4-7 (the halves of 16 k): two chains a row
      for (int m = 0; m < R; ++m)
        for (int h = 0; h < 2; ++h) dot[m][h] = _mm512_set1_epi32(bias[(m * G + g) * 2 + h]);
      for (int p = 0; p < 8; ++p) {
        for (int m = 0; m < R; ++m) {
          int32_t four;
          memcpy(&four, xq + m * K + g * 32 + 4 * p, sizeof(four));
          dot[m][p / 4] = _mm512_dpbusd_epi32(dot[m][p / 4], u[p], _mm512_set1_epi32(four));
        }
      }
      for (int m = 0; m < R; ++m) {
        const __m512 dm = _mm512_set1_ps(d[m * G + g]);
        if constexpr (kHalves) {
          acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[m][0]), dm), _mm512_loadu_ps(s), acc[m]);
          acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[m][1]), dm), _mm512_loadu_ps(s + 16), acc[m]);
        } else {
          const __m512 dot32 = _mm512_cvtepi32_ps(_mm512_add_epi32(dot[m][0], dot[m][1]));
          acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dot32, dm), _mm512_loadu_ps(s), acc[m]);
        }
        if constexpr (kZeros) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * G + g]), _mm512_loadu_ps(z), acc[m]);
      }
    }
    for (int m = 0; m < R; ++m) {
      if (float_out) _mm512_storeu_ps(static_cast<float*>(y) + m * N + nb * 16, acc[m]);
      else simd16::vstore_bf16(static_cast<uint16_t*>(y) + m * N + nb * 16, {acc[m]}, 0xFFFF);
    }
  }
}

// Per row: xq and d (quantize_row), xs (group_sums), and the halves' biases -128 * sum_h(xq)
// (vpsadbw on xq ^ 0x80 sums 8 bytes of xq + 128). A group whose xs is not finite (a NaN or inf
// x) gets d = NaN, so its row's outputs are NaN with or without zeros (q_avx2.cpp does the same).
void codes8_rows(const uint16_t* x, int64_t M, int64_t K, int8_t* xq, float* d, float* xs, int32_t* bias) {
  const int64_t G = K / 32;
  float* c8 = static_cast<float*>(aligned_alloc(64, ((M * G * 4 + 63) / 64) * 64));  // quantize_row's -8 d sum(xq)
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, xq + m * K, d + m * G, c8 + m * G);
  group_sums(x, M, K, xs);
  const __m128i flip = _mm_set1_epi8(-128);
  for (int64_t i = 0; i < M * G * 2; ++i) {
    const __m128i sad = _mm_sad_epu8(_mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + i * 16)), flip),
                                     _mm_setzero_si128());
    const int32_t sum = _mm_cvtsi128_si32(sad) + _mm_extract_epi16(sad, 4) - 16 * 128;
    bias[i] = -128 * sum;
    if (i % 2 == 1 && !std::isfinite(xs[i / 2])) d[i / 2] = std::numeric_limits<float>::quiet_NaN();
  }
  // The zero term's factor: the group's quantized sum d * sum(xq) (exactly -c8 / 8), not the
  // exact sum, so that a weight's offset meets the same rounded row as its code does.
  for (int64_t i = 0; i < M * G; ++i) xs[i] = c8[i] * -0.125f;
  free(c8);
}

// offset >= 0: the codes are packed at five bits (codes5.h; offset: what a field less is its
// code), widened a block at a time by over_five_bit_blocks, so a packed weight gives the bits of
// its 8-bit layout.
template <bool kHalves, bool kZeros>
void codes8_gemm(const int8_t* xq, const float* d, const int32_t* bias, const float* xs, int64_t M, int64_t K,
                 int64_t N, const int8_t* codes, const float* scales, const float* zeros, void* y, bool float_out,
                 int offset) {
  const int64_t G = K / 32, scale_floats = kHalves ? 32 : 16;
  const int64_t out_bytes = float_out ? 4 : 2;
  const auto blocks = [&](const int8_t* c, const float* s, const float* z, char* out, int64_t begin, int64_t end) {
    over_row_chunks<kCodes8Rows>(M, [&](auto rows, int64_t m) {
      codes8_blocks<decltype(rows)::value, kHalves, kZeros>(xq + m * K, d + m * G, bias + m * G * 2, xs + m * G, K, N,
                                                            c, s, z, out + m * N * out_bytes, float_out, begin, end);
    });
  };
  over_blocks(N / 16, [&](int64_t begin, int64_t end) {
    if (offset < 0) return blocks(codes, scales, zeros, static_cast<char*>(y), begin, end);
    treeserve_cpu::over_five_bit_blocks(codes, scales, zeros, y, M, G, kCodes8Rows, scale_floats, out_bytes,
                                        static_cast<int8_t>(offset), begin, end,
                                        [&](const int8_t* c, const float* s, const float* z, char* out, int64_t n) {
                                          blocks(c, s, z, out, 0, n);
                                        });
  });
}

at::Tensor q8g_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                  int64_t out_features, bool float_out) {
  TORCH_CHECK(treeserve_amx::has_vnni, "treeserve_q4::q8g_mm needs AVX512-VNNI, which this CPU lacks");
  const auto [halves, with_zeros, five_bits, offset] =
      treeserve_cpu::check_codes8("treeserve_q4::q8g_mm", x, codes, scales, zeros, out_features);
  const int64_t M = x.size(0), K = x.size(1), N = out_features, G = K / 32;
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  int8_t* xq = static_cast<int8_t*>(aligned_alloc(64, ((M * K + 63) / 64) * 64));
  float* f = static_cast<float*>(aligned_alloc(64, ((4 * M * G * 4 + 63) / 64) * 64));
  float *d = f, *xs = f + M * G;
  int32_t* bias = reinterpret_cast<int32_t*>(f + 2 * M * G);
  codes8_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr()), M, K, xq, d, xs, bias);
  const auto* cp = static_cast<const int8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* zp = with_zeros ? zeros.data_ptr<float>() : nullptr;
  const int off = five_bits ? offset : -1;
  if (halves && with_zeros) codes8_gemm<true, true>(xq, d, bias, xs, M, K, N, cp, sp, zp, y.data_ptr(), float_out, off);
  else if (halves) codes8_gemm<true, false>(xq, d, bias, xs, M, K, N, cp, sp, zp, y.data_ptr(), float_out, off);
  else if (with_zeros) codes8_gemm<false, true>(xq, d, bias, xs, M, K, N, cp, sp, zp, y.data_ptr(), float_out, off);
  else codes8_gemm<false, false>(xq, d, bias, xs, M, K, N, cp, sp, zp, y.data_ptr(), float_out, off);
  free(xq);
  free(f);
  return y;
}

}  // namespace

// q_avx2.cpp's q4_mm: the q4_1 format's linears on int8 rows (vpmaddubsw on the 4-bit codes).

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "q_avx2_rows.h"

namespace {

// ---------------------------------------------------------------------------------------------
// q4_1

constexpr int64_t kQ4BlockBytes = 2 * 8 * 32;  // codes of one 32-column block for one group
constexpr int64_t kPrefetchGroups = 8;
constexpr int kQ4Rows = 4;  // rows multiplied together (their int16 sums in registers)

// 32 codes of 8 columns of one tile row pair (16 bytes) -> the u8 operand of vpmaddubsw, the
// four codes of a column in k order in its 32-bit lane (see q4_amx.cpp's codes_u8).
inline __m256i codes_u8(const uint8_t* src) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi32(v, 12)), _mm256_set1_epi32(0x0F0F0F0F));
}

// The codes and scales/zeros of the group kPrefetchGroups groups after (src, s), into L1.
inline void prefetch_q4_group(const uint8_t* src, const uint16_t* s) {
  for (int line = 0; line < kQ4BlockBytes / 64; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchGroups * kQ4BlockBytes + line * 64), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(s + kPrefetchGroups * 64), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(s + kPrefetchGroups * 64 + 32), _MM_HINT_T0);
}

void q4_blocks(const int8_t* xq, const float* d, const float* c8, const float* xs, int64_t M, int64_t K, int64_t N,
               const uint8_t* codes, const uint16_t* sz, uint16_t* y, int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  float* acc = static_cast<float*>(aligned_alloc(64, M * 32 * 4));
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    memset(acc, 0, M * 32 * 4);
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* src = codes + (nb * G + g) * kQ4BlockBytes;
      const uint16_t* s = sz + (nb * G + g) * 64;
      prefetch_q4_group(src, s);
      for (int quarter = 0; quarter < 4; ++quarter) {  // columns quarter*8 .. +7: tile quarter/2, half quarter%2
        const uint8_t* base = src + (quarter / 2) * 256 + (quarter % 2) * 16;
        __m256i w[8];
        for (int p = 0; p < 8; ++p) w[p] = codes_u8(base + p * 32);
        const __m256 scale = bf16x8(s + quarter * 8), zero = bf16x8(s + 32 + quarter * 8);
        over_row_chunks<kQ4Rows>(M, [&](auto rows, int64_t m0) {
          constexpr int R = decltype(rows)::value;
          __m256i dot[R];
          for (int m = 0; m < R; ++m) dot[m] = _mm256_setzero_si256();
          for (int p = 0; p < 8; ++p) {
            for (int m = 0; m < R; ++m) {
              int32_t four;
              memcpy(&four, xq + (m0 + m) * K + g * 32 + 4 * p, sizeof(four));
              dot[m] = pinned(_mm256_add_epi16(dot[m], _mm256_maddubs_epi16(w[p], _mm256_set1_epi32(four))));
            }
          }
          for (int m = 0; m < R; ++m) {
            const int64_t row = (m0 + m) * G + g;
            const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dot[m], ones)), _mm256_set1_ps(d[row]),
                                             _mm256_set1_ps(c8[row]));
            float* a = acc + (m0 + m) * 32 + quarter * 8;
            _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(xs[row]), zero, _mm256_fmadd_ps(t, scale, _mm256_load_ps(a))));
          }
        });
      }
    }
    for (int64_t m = 0; m < M; ++m)
      for (int q = 0; q < 4; ++q)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + m * N + nb * 32 + q * 8), bf16_round8(_mm256_load_ps(acc + m * 32 + q * 8)));
  }
  free(acc);
}

// A decode-sized step (at most kQ4Rows rows), the same sums with fewer instructions: a tile's
// 32-byte row of codes holds 16 columns' four codes each (byte 2c = k0 | k2 << 4, byte 2c + 1 =
// k1 | k3 << 4, column c's bytes), so one mask gives vpmaddubsw's u8 operand for (k0, k1) of
// all 16 columns and a shift and a mask the one for (k2, k3), against x's pairs (x[4p], x[4p + 1])
// and (x[4p + 2], x[4p + 3]) broadcast from the quantized row as they are needed (a buffer of
// pre-broadcast pairs is 32x the row and falls out of L1 at two rows: slower, measured).
// The two int16 sums of a column (each at most 8 * 3810 = 30480) are added in int32, so every
// column's integer dot is q4_blocks' exactly, and the fp32 operations after it are the same:
// the same bits as the row would get in a larger batch.
template <int R>
void q4_blocks_few(const int8_t* xq, const float* d, const float* c8, const float* xs, int64_t K, int64_t N,
                   const uint8_t* codes, const uint16_t* sz, uint16_t* y, int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    alignas(32) float acc[R][32];
    for (int m = 0; m < R; ++m)
      for (int q = 0; q < 4; ++q) _mm256_store_ps(acc[m] + q * 8, _mm256_setzero_ps());
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* src = codes + (nb * G + g) * kQ4BlockBytes;
      const uint16_t* s = sz + (nb * G + g) * 64;
      prefetch_q4_group(src, s);
      for (int tile = 0; tile < 2; ++tile) {  // columns tile*16 .. +15
        __m256i lo[R], hi[R];
        for (int m = 0; m < R; ++m) lo[m] = hi[m] = _mm256_setzero_si256();
        for (int p = 0; p < 8; ++p) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + tile * 256 + p * 32));
          const __m256i k01 = _mm256_and_si256(v, low), k23 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int m = 0; m < R; ++m) {
            const int8_t* x = xq + m * K + g * 32 + 4 * p;
            int16_t p01, p23;
            memcpy(&p01, x, 2);
            memcpy(&p23, x + 2, 2);
            lo[m] = pinned(_mm256_add_epi16(lo[m], _mm256_maddubs_epi16(k01, _mm256_set1_epi16(p01))));
            hi[m] = pinned(_mm256_add_epi16(hi[m], _mm256_maddubs_epi16(k23, _mm256_set1_epi16(p23))));
          }
        }
        for (int m = 0; m < R; ++m) {
          const __m256i a = _mm256_madd_epi16(_mm256_unpacklo_epi16(lo[m], hi[m]), ones);  // columns 0-3, 8-11
          const __m256i b = _mm256_madd_epi16(_mm256_unpackhi_epi16(lo[m], hi[m]), ones);  // columns 4-7, 12-15
          const __m256i dots[2] = {_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31)};
          const int64_t row = m * G + g;
          for (int h = 0; h < 2; ++h) {
            const int quarter = tile * 2 + h;
            const __m256 scale = bf16x8(s + quarter * 8), zero = bf16x8(s + 32 + quarter * 8);
            const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[h]), _mm256_set1_ps(d[row]), _mm256_set1_ps(c8[row]));
            float* out = acc[m] + quarter * 8;
            _mm256_store_ps(out, _mm256_fmadd_ps(_mm256_set1_ps(xs[row]), zero, _mm256_fmadd_ps(t, scale, _mm256_load_ps(out))));
          }
        }
      }
    }
    for (int m = 0; m < R; ++m)
      for (int q = 0; q < 4; ++q)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + m * N + nb * 32 + q * 8), bf16_round8(_mm256_load_ps(acc[m] + q * 8)));
  }
}

at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_zeros, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "treeserve_avx2::q4_mm: x must be 2-D bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, G = K / 32;
  TORCH_CHECK(K % 32 == 0 && N % 32 == 0 && codes.numel() * 2 == N * K && codes.is_contiguous() &&
                  scales_zeros.is_contiguous() && scales_zeros.scalar_type() == at::kBFloat16 &&
                  scales_zeros.numel() == N * G * 2,
              "treeserve_avx2::q4_mm: the packing does not fit x");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  int8_t* xq = static_cast<int8_t*>(aligned_alloc(64, ((M * K + 63) / 64) * 64));
  float* f = static_cast<float*>(aligned_alloc(64, ((3 * M * G * 4 + 63) / 64) * 64));
  float *d = f, *c8 = f + M * G, *xs = f + 2 * M * G;
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, xq + m * K, d + m * G, c8 + m * G, xs + m * G);
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  if (M <= kQ4Rows) {
    over_blocks(N / 32, [&](int64_t begin, int64_t end) {
      switch (M) {
        case 1: return q4_blocks_few<1>(xq, d, c8, xs, K, N, cp, sp, yp, begin, end);
        case 2: return q4_blocks_few<2>(xq, d, c8, xs, K, N, cp, sp, yp, begin, end);
        case 3: return q4_blocks_few<3>(xq, d, c8, xs, K, N, cp, sp, yp, begin, end);
        default: return q4_blocks_few<4>(xq, d, c8, xs, K, N, cp, sp, yp, begin, end);
      }
    });
  } else {
    over_blocks(N / 32, [&](int64_t begin, int64_t end) { q4_blocks(xq, d, c8, xs, M, K, N, cp, sp, yp, begin, end); });
  }
  free(xq);
  free(f);
  return y;
}

}  // namespace

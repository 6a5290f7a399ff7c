// q4_amx.cpp's bf16 products: on AMX tiles (gemm: the codes widened to bf16 B tiles, a group
// of 32 per tile product) and, for a few rows or without tiles, by AVX512-BF16 dot products
// (vector_gemm).

#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "q4_amx_groups.h"

namespace {

// One B tile (256 code bytes) -> 16 rows of 32 bf16 in VNNI order.
inline void expand_tile(const uint8_t* src, uint16_t* dst, __m512i table) {
  const __m512i low_nibble = _mm512_set1_epi16(0xF);
  for (int p = 0; p < 8; ++p) {
    __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + p * 32)));
    __m512i low = _mm512_and_si512(bytes, low_nibble);
    __m512i high = _mm512_srli_epi16(bytes, 4);
    _mm512_store_si512(dst + (2 * p) * 32, _mm512_permutexvar_epi16(low, table));
    _mm512_store_si512(dst + (2 * p + 1) * 32, _mm512_permutexvar_epi16(high, table));
  }
}

// Output blocks [nb_begin, nb_end) of 32 columns, on one thread (arguments by value, so the
// compiler knows no store aliases them): each block's groups software-pipelined by
// treeserve_amx::pipelined_groups (widen: a group's codes to bf16 B tiles; scale: its stored
// products times the group's scales, plus the zero term, into the block's fp32 sums).
void gemm_blocks(const uint16_t* xa, const float* xs, const int64_t M, const int64_t K, const int64_t N,
                 const uint8_t* codes, const uint16_t* sz, uint16_t* y, const int64_t nb_begin, const int64_t nb_end) {
  const int64_t G = K / 32, MT = (M + 15) / 16, Mp = MT * 16;
  const __m512i table = code_table();
  configure_tiles(8);
  alignas(64) uint16_t bbuf[2][2][16 * 32];
  // cbuf[g & 1][mt]: row tile mt's products of group g, its 32 columns as two 16 x 16 tiles.
  float* cbuf = static_cast<float*>(aligned_alloc(64, 2 * MT * 512 * 4));
  float* acc = static_cast<float*>(aligned_alloc(64, Mp * 32 * 4));
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    memset(acc, 0, Mp * 32 * 4);
    const uint8_t* block = codes + nb * G * kBlockBytes;
    const uint16_t* block_sz = sz + nb * G * 64;
    auto widen = [&](int64_t g) {
      prefetch_group(block + g * kBlockBytes, block_sz + g * 64);
      expand_tile(block + g * kBlockBytes, bbuf[g & 1][0], table);
      expand_tile(block + g * kBlockBytes + 256, bbuf[g & 1][1], table);
    };
    auto scale = [&](int64_t g) {
      const uint16_t* s = block_sz + g * 64;
      const __m512 s0 = bf16x16_to_f32(s), s1 = bf16x16_to_f32(s + 16);
      const __m512 z0 = bf16x16_to_f32(s + 32), z1 = bf16x16_to_f32(s + 48);
      for (int64_t m = 0; m < M; ++m) {
        const float* c = cbuf + ((g & 1) * MT + m / 16) * 512 + (m % 16) * 16;
        float* a = acc + m * 32;
        const __m512 sums = _mm512_set1_ps(xs[m * G + g]);
        __m512 a0 = _mm512_fmadd_ps(_mm512_load_ps(c), s0, _mm512_load_ps(a));
        __m512 a1 = _mm512_fmadd_ps(_mm512_load_ps(c + 256), s1, _mm512_load_ps(a + 16));
        _mm512_store_ps(a, _mm512_fmadd_ps(sums, z0, a0));
        _mm512_store_ps(a + 16, _mm512_fmadd_ps(sums, z1, a1));
      }
    };
    pipelined_groups(xa, K, MT, G, bbuf, cbuf, widen, scale);
    for (int64_t m = 0; m < M; ++m) {
      uint16_t* out = y + m * N + nb * 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + m * 32)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + m * 32 + 16)));
    }
  }
  free(cbuf);
  free(acc);
  _tile_release();
}

void gemm(const uint16_t* x, int64_t M, int64_t K, int64_t N, const uint8_t* codes, const uint16_t* sz, uint16_t* y) {
  const int64_t G = K / 32, NB = N / 32, MT = (M + 15) / 16, Mp = MT * 16;
  // Rows padded to whole tiles, and each row's per-group sums (the zero term's factor).
  uint16_t* xa = treeserve_amx::padded_rows(x, M, K);
  float* xs = static_cast<float*>(aligned_alloc(64, ((Mp * G * 4 + 63) / 64) * 64));
  group_sums(xa, Mp, K, xs);
  over_blocks(NB, [&](int64_t begin, int64_t end) { gemm_blocks(xa, xs, M, K, N, codes, sz, y, begin, end); });
  free(xa);
  free(xs);
}

// R rows (R <= kMaxVectorRows) for output blocks [nb_begin, nb_end): the codes widened to bf16
// (q - 8, by table) and multiplied in pairs with each row's bf16 (x[k], x[k + 1]) by vdpbf16ps,
// whose lane c then sums column c's two weights: the tile layout serves this path as it is.
template <int R>
void vector_blocks(const uint16_t* x, const float* xs, int64_t K, int64_t N, const uint8_t* codes, const uint16_t* sz,
                   uint16_t* y, int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32;
  const __m512i table = code_table();
  const __m512i low_nibble = _mm512_set1_epi16(0xF);
  row_blocks<R>(G, N, codes, sz, y, nb_begin, nb_end, [&](__m512 (&acc)[R][2], const uint8_t* src, const uint16_t* s,
                                                          int64_t g) {
    __m512 part[R][4];  // [tile h][even, odd tile rows]: four independent sums per row
    for (int m = 0; m < R; ++m)
      for (int a = 0; a < 4; ++a) part[m][a] = _mm512_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      for (int p = 0; p < 8; ++p) {
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + h * 256 + p * 32)));
        const __m512bh even = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(bytes, low_nibble), table);
        const __m512bh odd = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
        for (int m = 0; m < R; ++m) {
          uint32_t x_even, x_odd;  // the bf16 pairs of tile rows 2p and 2p + 1: k = 4p, 4p + 1 and 4p + 2, 4p + 3
          memcpy(&x_even, x + m * K + g * 32 + 4 * p, sizeof(x_even));
          memcpy(&x_odd, x + m * K + g * 32 + 4 * p + 2, sizeof(x_odd));
          part[m][2 * h] = _mm512_dpbf16_ps(part[m][2 * h], even, (__m512bh)_mm512_set1_epi32(x_even));
          part[m][2 * h + 1] = _mm512_dpbf16_ps(part[m][2 * h + 1], odd, (__m512bh)_mm512_set1_epi32(x_odd));
        }
      }
    }
    const __m512 s0 = bf16x16_to_f32(s), s1 = bf16x16_to_f32(s + 16);
    const __m512 z0 = bf16x16_to_f32(s + 32), z1 = bf16x16_to_f32(s + 48);
    for (int m = 0; m < R; ++m) {
      const __m512 sums = _mm512_set1_ps(xs[m * G + g]);
      acc[m][0] = _mm512_fmadd_ps(sums, z0, _mm512_fmadd_ps(_mm512_add_ps(part[m][0], part[m][1]), s0, acc[m][0]));
      acc[m][1] = _mm512_fmadd_ps(sums, z1, _mm512_fmadd_ps(_mm512_add_ps(part[m][2], part[m][3]), s1, acc[m][1]));
    }
  });
}

void vector_gemm(const uint16_t* x, int64_t M, int64_t K, int64_t N, const uint8_t* codes, const uint16_t* sz,
                 uint16_t* y) {
  const int64_t G = K / 32, NB = N / 32;
  float* xs = static_cast<float*>(aligned_alloc(64, ((M * G * 4 + 63) / 64) * 64));
  group_sums(x, M, K, xs);
  over_blocks(NB, [&](int64_t begin, int64_t end) {
    over_row_chunks<kMaxVectorRows>(M, [&](auto rows, int64_t m) {
      vector_blocks<decltype(rows)::value>(x + m * K, xs + m * G, K, N, codes, sz, y + m * N, begin, end);
    });
  });
  free(xs);
}

}  // namespace

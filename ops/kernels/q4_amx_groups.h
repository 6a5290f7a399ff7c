// What every path of q4_amx.cpp shares: its names from amx_tiles.h, cpu_blocks.h and simd16.h,
// the bf16 values of the 4-bit codes, the packing's block size and prefetch, each row's sums per
// group (the zero term's factor), and the vector paths' loop over output blocks (row_blocks).

#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "cpu_blocks.h"
#include "simd16.h"  // its eight-lane pieces (group_sums) and its AVX-512 bf16 store (codes8)

namespace {

using treeserve_amx::bf16x16_to_f32;
using treeserve_amx::configure_tiles;
using treeserve_amx::pipelined_groups;
using treeserve_amx::load_b_tiles;
using treeserve_amx::over_blocks;
using treeserve_cpu::over_row_chunks;

using simd16::bf16x8;
using simd16::reduce_add8;

// bf16 bit patterns of q - 8 for q in 0..15 (entries 16..31 unused).
__m512i code_table() {
  alignas(64) uint16_t table[32] = {0};
  for (int q = 0; q < 16; ++q) {
    float value = static_cast<float>(q - 8);
    uint32_t bits;
    memcpy(&bits, &value, sizeof(bits));
    table[q] = static_cast<uint16_t>(bits >> 16);  // small integers are exact in bf16
  }
  return _mm512_load_si512(table);
}

constexpr int64_t kBlockBytes = 2 * 8 * 32;  // codes of one 32-column block for one group
constexpr int64_t kPrefetchGroups = 8;
constexpr int kMaxVectorRows = 3;

// The codes and scales kPrefetchGroups groups ahead into L1.
inline void prefetch_group(const uint8_t* src, const uint16_t* sz) {
  for (int line = 0; line < kBlockBytes / 64; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchGroups * kBlockBytes + line * 64), _MM_HINT_T0);
  for (int line = 0; line < 2; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(sz + kPrefetchGroups * 64 + line * 32), _MM_HINT_T0);
}

// Each row's sums over each group (the zero term's factor): xs[m * G + g]. Summed in q_avx2.cpp's
// order (its load_group: lane j adds (x[j] + x[j + 8]) + (x[j + 16] + x[j + 24]), then simd16's
// reduce_add8), so both builds' zero terms are the same bits: a 16-lane fold pairs x[j] with
// x[j + 16] and differs wherever a group's sum rounds (2^30, -2^30 and 1: 1 here, 0 there).
void group_sums(const uint16_t* x, int64_t M, int64_t K, float* xs) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* row = x + m * K + g * 32;
      const __m256 low = _mm256_add_ps(bf16x8(row), bf16x8(row + 8));
      const __m256 high = _mm256_add_ps(bf16x8(row + 16), bf16x8(row + 24));
      xs[m * G + g] = reduce_add8(_mm256_add_ps(low, high));
    }
  }
}

// Output blocks [nb_begin, nb_end) for R rows, each row's 32 sums held in fp32 registers over
// the K / 32 groups: group(acc, src, s, g) adds group g's products (src its codes, s its scales
// and zeros, both prefetched a few groups ahead); then the sums go to y as bf16.
template <int R, class Group>
inline void row_blocks(int64_t G, int64_t N, const uint8_t* codes, const uint16_t* sz, uint16_t* y, int64_t nb_begin,
                       int64_t nb_end, Group group) {
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    __m512 acc[R][2];
    for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* src = codes + (nb * G + g) * kBlockBytes;
      const uint16_t* s = sz + (nb * G + g) * 64;
      prefetch_group(src, s);
      group(acc, src, s, g);
    }
    for (int m = 0; m < R; ++m) {
      uint16_t* out = y + m * N + nb * 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(acc[m][0]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), (__m256i)_mm512_cvtneps_pbh(acc[m][1]));
    }
  }
}

}  // namespace

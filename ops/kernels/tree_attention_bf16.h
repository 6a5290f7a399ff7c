// tree_attention_cpu.cpp's vector item for bfloat16 on AVX512-BF16 (a head size that is a
// multiple of 32): attend_item_bf16, its keys in bf16 pairs for vdpbf16ps.

#pragma once

#include "tree_attention_common.h"

namespace {

#if defined(__AVX512BF16__)
// The same item for bfloat16 queries and cache with a head size HD that is a multiple of 32 (the
// default model's 64), on AVX512-BF16: no float32 copy of the keys. A block's keys are
// transposed as they are stored, in bf16 pairs (kp[p * kBf16Block + j]: dims 2p and 2p + 1 of
// key j, one 32-bit lane), and vdpbf16ps multiplies 16 keys' pairs by a query's broadcast pair:
// half the transposing of widened keys, no widening, half the instructions per product. The
// products of two bf16 values are exact in float32, as on the widened path. The values are
// widened to float32 by shifts alone, their even and odd dims into separate vectors (the row's
// sums are kept in that order and interleaved once at the end); weights and sums stay float32.
// Same visibility, online softmax, segments and output as attend_item.
constexpr int64_t kBf16Block = 64;  // keys per block

template <int RB, int KC, int HD>
inline void bf16_block_scores(const uint32_t (*qp)[HD / 2], const uint32_t* kp, float scale, float (*score)[256]) {
  __m512 acc[RB][KC];
  for (int i = 0; i < RB; ++i) {
    for (int c = 0; c < KC; ++c) acc[i][c] = _mm512_setzero_ps();
  }
  for (int p = 0; p < HD / 2; ++p) {
    __m512bh k[KC];
    for (int c = 0; c < KC; ++c) k[c] = (__m512bh)_mm512_load_si512(kp + p * kBf16Block + c * 16);
    for (int i = 0; i < RB; ++i) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[i][p]));
      for (int c = 0; c < KC; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], k[c], x);
    }
  }
  const __m512 factor = _mm512_set1_ps(scale);
  for (int i = 0; i < RB; ++i) {
    for (int c = 0; c < KC; ++c) _mm512_storeu_ps(score[i] + c * 16, _mm512_mul_ps(acc[i][c], factor));
  }
}

// acc[r] (even dims of each 32, then odd) = acc[r] * shrink[r] + sum_j weight[r][j] * v[j].
template <int RB, int HD>
inline void bf16_block_values(const uint16_t* v, int64_t count, const float (*weight)[256], const float* shrink,
                              float (*acc)[HD], bool prefetch) {
  constexpr int NC = HD / 32;
  __m512 a[RB][2 * NC];
  for (int i = 0; i < RB; ++i) {
    for (int c = 0; c < 2 * NC; ++c) a[i][c] = _mm512_mul_ps(_mm512_load_ps(acc[i] + c * 16), _mm512_set1_ps(shrink[i]));
  }
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t j = 0; j < count; ++j) {
    for (int c = 0; c < NC; ++c) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(v + (j + kBf16Block) * HD + c * 32), _MM_HINT_T0);
      const __m512i raw = _mm512_loadu_si512(v + j * HD + c * 32);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(raw, high_half));
      for (int i = 0; i < RB; ++i) {
        const __m512 w = _mm512_set1_ps(weight[i][j]);
        a[i][2 * c] = _mm512_fmadd_ps(w, even, a[i][2 * c]);
        a[i][2 * c + 1] = _mm512_fmadd_ps(w, odd, a[i][2 * c + 1]);
      }
    }
  }
  for (int i = 0; i < RB; ++i) {
    for (int c = 0; c < 2 * NC; ++c) _mm512_store_ps(acc[i] + c * 16, a[i][c]);
  }
}

// Chunk c's 16 even and 16 odd dims (a row's sums in bf16_block_values' order) in dim order.
inline void interleave_dims(const float* split, float* natural) {
  const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i high = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  const __m512 even = _mm512_load_ps(split), odd = _mm512_load_ps(split + 16);
  _mm512_store_ps(natural, _mm512_permutex2var_ps(even, low, odd));
  _mm512_store_ps(natural + 16, _mm512_permutex2var_ps(even, high, odd));
}

template <int HD>
void attend_item_bf16(const uint16_t* q, const uint16_t* keys, const uint16_t* values, const bool* tree_mask,
                      int64_t committed, const Shape& s, int64_t b, int64_t g, int64_t t0, int64_t tc, int64_t j_begin,
                      int64_t j_end, uint16_t* out, PartialRow* partial, uint32_t* kp, const NextRows& next) {
  constexpr int NC = HD / 32;
  const int64_t group = s.heads / s.kv_heads, rows = tc * group;
  const float scale = 1.0f / std::sqrt(float(HD));
  const uint16_t* kbase = keys + (b * s.kv_heads + g) * s.capacity * HD;
  const uint16_t* vbase = values + (b * s.kv_heads + g) * s.capacity * HD;

  alignas(64) uint32_t qp[kMaxRows][HD / 2];
  alignas(64) float acc[kMaxRows][HD];
  alignas(64) float score[kMaxRows][256];
  float run_max[kMaxRows], run_sum[kMaxRows], shrink[kMaxRows];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / group, h = g * group + r % group;
    std::memcpy(qp[r], q + ((b * s.num_new + t) * s.heads + h) * HD, HD * sizeof(uint16_t));
    std::fill(acc[r], acc[r] + HD, 0.0f);
    run_max[r] = -std::numeric_limits<float>::infinity();
    run_sum[r] = 0.0f;
  }
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kBf16Block) {
    const int64_t n = std::min(kBf16Block, j_end - j0), subs = (n + 15) / 16;
    for (int64_t sb = 0; sb < subs; ++sb) {
      for (int c = 0; c < NC; ++c) {
        V16 tile[16];  // 16 keys' pairs c*16 .. c*16+15 as 32-bit lanes, then transposed
        for (int i = 0; i < 16; ++i) {
          const int64_t j = sb * 16 + i;
          // The next block's keys into L1 meanwhile: the cache streams from memory, one item's
          // keys and values at a time, and the loads stalled without it.
          _mm_prefetch(reinterpret_cast<const char*>(kbase + (j0 + kBf16Block + j) * HD + c * 32), _MM_HINT_T0);
          tile[i] = {j < n ? _mm512_castsi512_ps(_mm512_loadu_si512(kbase + (j0 + j) * HD + c * 32)) : _mm512_setzero_ps()};
        }
        transpose16(tile);
        for (int i = 0; i < 16; ++i) vstore(reinterpret_cast<float*>(kp + (c * 16 + i) * kBf16Block + sb * 16), tile[i]);
      }
    }
    row_blocks(rows, [&](auto rb, int64_t r) {
      switch (subs) {
        case 4: return bf16_block_scores<rb.value, 4, HD>(qp + r, kp, scale, score + r);
        case 3: return bf16_block_scores<rb.value, 3, HD>(qp + r, kp, scale, score + r);
        case 2: return bf16_block_scores<rb.value, 2, HD>(qp + r, kp, scale, score + r);
        default: return bf16_block_scores<rb.value, 1, HD>(qp + r, kp, scale, score + r);
      }
    });
    for (int64_t r = 0; r < rows; ++r) {
      const bool* visible = tree_mask + (b * s.num_new + t0 + r / group) * s.num_new;
      block_softmax(score[r], n, j0, committed, visible, run_max[r], run_sum[r], shrink[r]);
    }
    row_blocks(rows, [&](auto rb, int64_t r) {
      bf16_block_values<rb.value, HD>(vbase + j0 * HD, n, score + r, shrink + r, acc + r, r == 0);
    });
    prefetch_next(next, j0 - j_begin, j0 - j_begin + n);
  }
  for (int64_t r = 0; r < rows; ++r) {
    alignas(64) float natural[HD];
    for (int c = 0; c < NC; ++c) interleave_dims(acc[r] + c * 32, natural + c * 32);
    if (partial != nullptr) {
      partial[r].max = run_max[r];
      partial[r].sum = run_sum[r];
      std::memcpy(partial[r].acc, natural, sizeof(natural));
      continue;
    }
    const int64_t t = t0 + r / group, h = g * group + r % group;
    uint16_t* o = out + ((b * s.num_new + t) * s.heads + h) * HD;
    const V16 inv = vset1(run_sum[r] == 0.0f ? 0.0f : 1.0f / run_sum[r]);  // nothing seen: 0; NaN stays
    for (int c = 0; c < HD / 16; ++c) store(o + c * 16, vmul(vload(natural + c * 16), inv), Mask16(0xffff));
  }
}
#endif  // __AVX512BF16__

}  // namespace

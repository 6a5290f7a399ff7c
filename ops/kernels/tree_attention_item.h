// tree_attention_cpu.cpp's vector item in float32 (either dtype, widened): scores against a
// block of keys transposed (AVX-512) or straight from the cache's rows (AVX2), the block's
// weighted values, and attend_item.

#pragma once

#include "tree_attention_common.h"

namespace {

// Scores of RB query rows against KC * 16 keys held transposed (kt[d * stride + j]):
// score[r][j] = q[r] . k[j], 16 keys a vector, every FMA broadcasting one query element (no
// horizontal sums); RB * KC independent sums keep the FMA units busy.
template <int RB, int KC, int NV>
inline void block_scores(const float (*q)[NV * 16], const float* kt, int64_t stride, int64_t head_dim,
                         float (*score)[256]) {
  V16 acc[RB][KC];
  for (int i = 0; i < RB; ++i) {
    for (int c = 0; c < KC; ++c) acc[i][c] = vzero();
  }
  for (int64_t d = 0; d < head_dim; ++d) {
    V16 k[KC];
    for (int c = 0; c < KC; ++c) k[c] = vload(kt + d * stride + c * 16);
    for (int i = 0; i < RB; ++i) {
      const V16 x = vset1(q[i][d]);
      for (int c = 0; c < KC; ++c) acc[i][c] = vfmadd(x, k[c], acc[i][c]);
    }
  }
  for (int i = 0; i < RB; ++i) {
    for (int c = 0; c < KC; ++c) vstore(score[i] + c * 16, acc[i][c]);
  }
}

template <int RB, int NV>
inline void block_scores(const float (*q)[NV * 16], const float* kt, int64_t stride, int64_t keys, int64_t head_dim,
                         float (*score)[256]) {
  int64_t j = 0;
  for (; j + 64 <= keys; j += 64) block_scores<RB, 4, NV>(q, kt + j, stride, head_dim, reinterpret_cast<float(*)[256]>(&score[0][j]));
  for (; j < keys; j += 16) block_scores<RB, 1, NV>(q, kt + j, stride, head_dim, reinterpret_cast<float(*)[256]>(&score[0][j]));
}

// acc[r] = acc[r] * shrink[r] + sum_j weight[r][j] * v[j] for RB rows, the rows' sums in registers.
template <int RB, int NV>
inline void block_values(const float* v, int64_t count, const float (*weight)[256], const float* shrink,
                         float (*acc)[NV * 16]) {
  V16 a[RB][NV];
  for (int i = 0; i < RB; ++i) {
    for (int c = 0; c < NV; ++c) a[i][c] = vmul(vload(acc[i] + c * 16), vset1(shrink[i]));
  }
  for (int64_t j = 0; j < count; ++j) {
    for (int c = 0; c < NV; ++c) {
      const V16 x = vload(v + j * NV * 16 + c * 16);
      for (int i = 0; i < RB; ++i) a[i][c] = vfmadd(vset1(weight[i][j]), x, a[i][c]);
    }
  }
  for (int i = 0; i < RB; ++i) {
    for (int c = 0; c < NV; ++c) vstore(acc[i] + c * 16, a[i][c]);
  }
}

#if !defined(__AVX512F__)
// AVX2: scores straight from the cache's key rows, with no transposed copy (on AVX2 a 16 x 16
// transpose is two dozen shuffles per 16 keys and a head's worth of them per block, which cost
// more than the products). Per key, each 8-dim piece of it widened to fp32 once for the RB rows,
// eight FMAs a row into two sums, and eight keys' sums reduced at once by horizontal adds
// (hsum8). The same fp32 products as block_scores, summed in another order.
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const uint16_t* p) {  // bf16 -> f32 is exact
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Lane i: the sum of p[i]'s eight lanes.
inline __m256 hsum8(const __m256 p[8]) {
  const __m256 a = _mm256_hadd_ps(p[0], p[1]), b = _mm256_hadd_ps(p[2], p[3]);
  const __m256 c = _mm256_hadd_ps(p[4], p[5]), d = _mm256_hadd_ps(p[6], p[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // p0..p3 | p4..p7, each lane half a sum
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// score[r][j] = q[r] . k[j] for j in [0, n) (and 0 up to the next multiple of 8).
template <int RB, int NV, typename T>
inline void direct_scores(const float (*q)[NV * 16], const T* k, int64_t n, float (*score)[256]) {
  for (int64_t j = 0; j < n; j += 8) {
    __m256 part[RB][8];
    for (int i = 0; i < 8; ++i) {
      if (j + i >= n) {
        for (int r = 0; r < RB; ++r) part[r][i] = _mm256_setzero_ps();
        continue;
      }
      const T* row = k + (j + i) * NV * 16;
      // Each piece of the key widened once and used by every row at once: RB x 2 sums, one
      // piece and the rows' query pieces (memory operands) in registers, nothing spilled.
      __m256 a[RB][2];
      {
        const __m256 k0 = widen8(row), k1 = widen8(row + 8);
        for (int r = 0; r < RB; ++r) {
          a[r][0] = _mm256_mul_ps(k0, _mm256_load_ps(q[r]));
          a[r][1] = _mm256_mul_ps(k1, _mm256_load_ps(q[r] + 8));
        }
      }
      for (int c = 2; c < 2 * NV; c += 2) {
        const __m256 k0 = widen8(row + c * 8), k1 = widen8(row + c * 8 + 8);
        for (int r = 0; r < RB; ++r) {
          a[r][0] = _mm256_fmadd_ps(k0, _mm256_load_ps(q[r] + c * 8), a[r][0]);
          a[r][1] = _mm256_fmadd_ps(k1, _mm256_load_ps(q[r] + c * 8 + 8), a[r][1]);
        }
      }
      for (int r = 0; r < RB; ++r) part[r][i] = _mm256_add_ps(a[r][0], a[r][1]);
    }
    for (int r = 0; r < RB; ++r) _mm256_storeu_ps(score[r] + j, hsum8(part[r]));
  }
}
#endif

// One item: new tokens [t0, t0 + tc) of row b, the heads of KV group g, over slots
// [j_begin, j_end) of the row's committed + new ones. With partial == nullptr it writes the
// attention output; otherwise, for a segment of the slots, each row's running maximum, sum and
// unnormalized weighted values (PartialRow), for merge_partials to combine.
template <typename T, int NV>
void attend_item(const T* q, const T* keys, const T* values, const bool* tree_mask, int64_t committed,
                 const Shape& s, int64_t b, int64_t g, int64_t t0, int64_t tc, int64_t j_begin, int64_t j_end,
                 T* out, PartialRow* partial, float* kt, float* vbuf, const NextRows& next) {
  constexpr int64_t block = kBlockKeys(NV), width = NV * 16;
  const int64_t hd = s.head_dim, group = s.heads / s.kv_heads, rows = tc * group;
  const Mask16 tail = hd % 16 == 0 ? Mask16(0xffff) : Mask16((1u << (hd % 16)) - 1);
  auto lanes = [&](int c) { return c == NV - 1 ? tail : Mask16(0xffff); };
  const float scale = 1.0f / std::sqrt(float(hd)), minus_inf = -std::numeric_limits<float>::infinity();
  const T* kbase = keys + (b * s.kv_heads + g) * s.capacity * hd;
  const T* vbase = values + (b * s.kv_heads + g) * s.capacity * hd;

  alignas(64) float qs[kMaxRows][width];
  alignas(64) float acc[kMaxRows][width];
  alignas(64) float score[kMaxRows][256];
  float run_max[kMaxRows], run_sum[kMaxRows], shrink[kMaxRows];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / group, h = g * group + r % group;
    const T* qr = q + ((b * s.num_new + t) * s.heads + h) * hd;
    for (int c = 0; c < NV; ++c) {
      vstore(qs[r] + c * 16, vmul(load(qr + c * 16, lanes(c)), vset1(scale)));
      vstore(acc[r] + c * 16, vzero());
    }
    run_max[r] = minus_inf;
    run_sum[r] = 0.0f;
  }
  for (int64_t j0 = j_begin; j0 < j_end; j0 += block) {
    const int64_t n = std::min(block, j_end - j0);
    // The block's values widened (vbuf[j * width + d]), and its scores: on AVX2 straight from the
    // key rows (direct_scores); otherwise from its keys widened to float32 and transposed
    // (kt[d * block + j]). Either is done once for all of the item's rows.
    for (int64_t j = 0; j < n; ++j) {
      // The next block's keys and values into L2 meanwhile: the cache streams from memory (into
      // L1 instead, 16 KiB a block beside the widened values, was slower).
      for (int64_t line = 0; j0 + block < j_end && line < hd * int64_t(sizeof(T)); line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(kbase + (j0 + block + j) * hd) + line, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vbase + (j0 + block + j) * hd) + line, _MM_HINT_T1);
      }
      for (int c = 0; c < NV; ++c) vstore(vbuf + j * width + c * 16, load(vbase + (j0 + j) * hd + c * 16, lanes(c)));
    }
#if !defined(__AVX512F__)
    if (hd == width) {  // no tail lanes
      row_blocks(rows, [&](auto rb, int64_t r) { direct_scores<rb.value, NV>(qs + r, kbase + j0 * hd, n, score + r); });
    } else
#endif
    {
      const int64_t padded = (n + 15) / 16 * 16;
      for (int64_t j = 0; j < padded; j += 16) {
        for (int c = 0; c < NV; ++c) {
          V16 tile[16];
          for (int i = 0; i < 16; ++i) {
            tile[i] = j + i < n ? load(kbase + (j0 + j + i) * hd + c * 16, lanes(c)) : vzero();
          }
          transpose16(tile);
          for (int i = 0; i < 16; ++i) vstore(kt + (c * 16 + i) * block + j, tile[i]);
        }
      }
      row_blocks(rows, [&](auto rb, int64_t r) { block_scores<rb.value, NV>(qs + r, kt, block, padded, hd, score + r); });
    }
    for (int64_t r = 0; r < rows; ++r) {
      const bool* visible = tree_mask + (b * s.num_new + t0 + r / group) * s.num_new;
      block_softmax(score[r], n, j0, committed, visible, run_max[r], run_sum[r], shrink[r]);
    }
#if defined(__AVX512F__)
    constexpr bool row_blocked = NV <= 4;
#else
    // On AVX2 a V16 is two registers, so four rows' sums of a 64-dim head are all sixteen: they
    // spilled, and a 64-row decode's attention took 1.5x as long as one row at a time.
    constexpr bool row_blocked = false;
#endif
    if constexpr (row_blocked) {
      row_blocks(rows, [&](auto rb, int64_t r) { block_values<rb.value, NV>(vbuf, n, score + r, shrink + r, acc + r); });
    } else {
      for (int64_t r = 0; r < rows; ++r) block_values<1, NV>(vbuf, n, score + r, shrink + r, acc + r);
    }
    prefetch_next(next, j0 - j_begin, j0 - j_begin + n);
  }
  if (partial != nullptr) {
    for (int64_t r = 0; r < rows; ++r) {
      partial[r].max = run_max[r];
      partial[r].sum = run_sum[r];
      for (int c = 0; c < NV; ++c) vstore(partial[r].acc + c * 16, vload(acc[r] + c * 16));
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / group, h = g * group + r % group;
    T* o = out + ((b * s.num_new + t) * s.heads + h) * hd;
    const V16 inv = vset1(run_sum[r] == 0.0f ? 0.0f : 1.0f / run_sum[r]);  // nothing seen: 0; NaN stays
    for (int c = 0; c < NV; ++c) store(o + c * 16, vmul(vload(acc[r] + c * 16), inv), lanes(c));
  }
}

}  // namespace

// decode_layers.cpp's attention over a whole call (attend): each token's visible sequence, the
// units of work and their prefetches, and the merge of each token's segments in order. Its
// parts, and the order every sum runs in, are in decode_layers_attn_blocks.h.

#pragma once

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "decode_layers_attn_blocks.h"
#include "simd16.h"

namespace {

using simd16::bf16_round8;
using simd16::bf16x8;

// out (B, T, H * hd) bf16: every new token's attention (see decode_layers_attn_blocks.h). q (B, T, H, hd) bf16;
// keys/values the layer's (B, n_kv, C, hd) bf16 cache, the new tokens' K/V already written;
// mask (B, T, T) bool or null (causal); window > 0: each token sees its last `window` keys only
// (its sequence's keys [count - window, count): the blocks and segments are still counted from
// the sequence's first key, so the order of every sum stays a function of the token's own
// position); scale the scores' factor.
void attend(const uint16_t* q, const uint16_t* keys, const uint16_t* values, const int64_t* lengths,
            const bool* mask, const AttnShape& s, int64_t window, float scale, uint16_t* out) {
  const int64_t G = s.H / s.n_kv, tokens = s.B * s.T, hd = s.hd;
  // Each token's visible new slots (a tree), its segments, and where its partial results go:
  // (token, KV head, segment) at first_part[token] + g * segments + k.
  std::vector<int32_t> nodes(mask ? tokens * s.T : 0);
  std::vector<Visible> visible(tokens);
  std::vector<int64_t> first_part(tokens + 1, 0), row_segments(s.B, 0);
  for (int64_t bt = 0; bt < tokens; ++bt) {
    const int64_t b = bt / s.T, t = bt % s.T;
    Visible& v = visible[bt];
    v.committed = lengths[b];
    if (mask) {
      int32_t* list = nodes.data() + bt * s.T;
      int64_t count = 0;
      for (int64_t j = 0; j < s.T; ++j) {
        if (mask[bt * s.T + j]) list[count++] = static_cast<int32_t>(j);
      }
      v.nodes = list;
      v.count = v.committed + count;
    } else {
      v.nodes = nullptr;
      v.count = v.committed + t + 1;
    }
    v.first = window > 0 ? std::max<int64_t>(0, v.count - window) : 0;
    const int64_t segments = std::max<int64_t>(1, (v.count + kSegment - 1) / kSegment);
    row_segments[b] = std::max(row_segments[b], segments);
    first_part[bt + 1] = first_part[bt] + segments * s.n_kv;
  }
  const int64_t part_floats = G * (2 + hd);
  // Every part is written before it is read: kept between calls, never cleared.
  static thread_local std::vector<float> scratch;  // (thread_local: the workers below see the caller's through parts)
  if (scratch.size() < static_cast<size_t>(first_part[tokens] * part_floats)) scratch.resize(first_part[tokens] * part_floats);
  float* const parts = scratch.data();
  // Units: (row, a chunk of its tokens, KV head, segment), taken as threads come free (their sizes
  // differ: a segment of a row's last keys is short, and a tree's tokens reach few of them).
  // A unit takes one segment, or, where (row, chunk, KV head) alone make enough units for the
  // threads (a decode batch), all of that row's segments one after another: each segment is
  // attended and kept apart as before, so this changes which thread computes what, never what
  // is computed; it spares a batch's rows the per-unit work of their short last segments.
  const int64_t chunks = (s.T + kTokenChunk - 1) / kTokenChunk;
  const bool whole_rows = s.B * chunks * s.n_kv >= 4 * at::get_num_threads();
  const auto spans = [&](int64_t b) { return whole_rows ? int64_t{1} : row_segments[b]; };  // units per (chunk, KV head)
  std::vector<int64_t> first_unit(s.B + 1, 0);
  for (int64_t b = 0; b < s.B; ++b) first_unit[b + 1] = first_unit[b] + chunks * s.n_kv * spans(b);
  const int64_t units = first_unit[s.B];
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units)));
  // Each thread claims its next unit when it starts one, so that it knows which rows to fetch
  // meanwhile (a guess such as u + threads was often the other thread's unit, and a 64-row
  // step's attention took 1.2x as long on AVX2); units are still taken as threads come free.
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(threads)
  {
    static thread_local std::unique_ptr<Block> blk(new Block());  // a block's rows are written before they are read
    std::vector<float> qf, acc;
    std::vector<RowState> rows;
    std::vector<int64_t> members;
    for (int64_t u = claimed.fetch_add(1, std::memory_order_relaxed), following; u < units; u = following) {
      following = claimed.fetch_add(1, std::memory_order_relaxed);
      // Unit u: row b, chunk c, KV head g, segments [k_first, k_last).
      const auto locate = [&](int64_t unit, int64_t& b, int64_t& c, int64_t& g, int64_t& k_first, int64_t& k_last) {
        b = std::upper_bound(first_unit.begin(), first_unit.end(), unit) - first_unit.begin() - 1;
        const int64_t index = unit - first_unit[b], S = spans(b);
        c = index / (s.n_kv * S);
        g = index / S % s.n_kv;
        k_first = whole_rows ? 0 : index % S;
        k_last = whole_rows ? row_segments[b] : k_first + 1;
      };
      int64_t b, c, g, k_first, k_last;
      locate(u, b, c, g, k_first, k_last);
      // The committed keys and values of this thread's next unit go into L2 meanwhile, a block's
      // worth of rows with each block this unit attends (Ahead): a decode batch streams each
      // row's cache from memory once, and without this its 64-row attention took 1.05-1.3x as long.
      const uint16_t* next_keys = nullptr;
      const uint16_t* next_values = nullptr;
      int64_t next_rows = 0, next_done = 0;
      if (following < units) {
        int64_t nb, nc, ng, nk_first, nk_last;
        locate(following, nb, nc, ng, nk_first, nk_last);
        const int64_t begin = nk_first * kSegment;
        next_rows = std::max<int64_t>(0, std::min(lengths[nb], nk_last * kSegment) - begin);
        next_keys = keys + ((nb * s.n_kv + ng) * s.C + begin) * hd;
        next_values = values + ((nb * s.n_kv + ng) * s.C + begin) * hd;
      }
      const auto next_unit = [&](int64_t count) {  // its next `count` rows not yet fetched
        const Ahead::Stream rows{reinterpret_cast<const char*>(next_keys + next_done * hd),
                                 reinterpret_cast<const char*>(next_values + next_done * hd),
                                 std::max<int64_t>(0, std::min(count, next_rows - next_done))};
        next_done += rows.rows;
        return rows;
      };
      for (int64_t k = k_first; k < k_last; ++k) {
        const int64_t i_begin = k * kSegment, L = lengths[b];
        // The chunk's tokens that reach this segment, their queries and states.
        members.clear();
        for (int64_t t = c * kTokenChunk; t < std::min(s.T, (c + 1) * kTokenChunk); ++t) {
          const Visible& v = visible[b * s.T + t];
          if (v.count > i_begin && v.first < i_begin + kSegment) members.push_back(t);
        }
        const int64_t m = static_cast<int64_t>(members.size());
        qf.resize(m * G * hd);
        acc.assign(m * G * hd, 0.0f);
        rows.resize(m * G);
        for (int64_t i = 0; i < m; ++i) {
          const uint16_t* qrow = q + ((b * s.T + members[i]) * s.H + g * G) * hd;
          for (int64_t e = 0; e < G * hd; e += 8) _mm256_storeu_ps(qf.data() + i * G * hd + e, bf16x8(qrow + e));
          for (int64_t r = 0; r < G; ++r)
            rows[i * G + r] = {-std::numeric_limits<float>::infinity(), 0.0f, acc.data() + (i * G + r) * hd};
        }
        const uint16_t* kbase = keys + (b * s.n_kv + g) * s.C * hd;
        const uint16_t* vbase = values + (b * s.n_kv + g) * s.C * hd;
        const uint16_t* krow[kKeyBlock];
        const uint16_t* vrow[kKeyBlock];
        for (int64_t i0 = i_begin; i0 < i_begin + kSegment; i0 += kKeyBlock) {
          if (!mask || i0 + kKeyBlock <= L) {  // key i is slot i for every token
            int64_t widest = 0, reach = 0;
            for (int64_t i = 0; i < m; ++i) {
              const Visible& v = visible[b * s.T + members[i]];
              reach = std::max(reach, v.count - i0);
              if (v.first < i0 + kKeyBlock) widest = std::max(widest, std::min(kKeyBlock, v.count - i0));
            }
            if (reach <= 0) break;
            if (widest <= 0) continue;  // every token's window starts past this block
            // The segment's next block and the next unit's rows, fetched as this block goes.
            Ahead ahead;
            ahead.row_bytes = hd * 2;
            if (i0 + kKeyBlock < i_begin + kSegment)
              ahead.next_block = {reinterpret_cast<const char*>(kbase + (i0 + kKeyBlock) * hd),
                                  reinterpret_cast<const char*>(vbase + (i0 + kKeyBlock) * hd), kKeyBlock};
            ahead.next_unit = next_unit(kKeyBlock);
            for (int64_t j = 0; j < widest; ++j) {
              krow[j] = kbase + (i0 + j) * hd;
              vrow[j] = vbase + (i0 + j) * hd;
            }
            if (m > 1) widen_block(krow, vrow, widest, hd, *blk, ahead);  // once for the unit's tokens
            else touch_block(krow, vrow, widest, hd, ahead);
            const Widened wk{blk->k, hd}, wv{blk->v, hd};
            const Cached ck{krow}, cv{vrow};
            for (int64_t i = 0; i < m; ++i) {
              const Visible& v = visible[b * s.T + members[i]];
              const int64_t n = std::min(kKeyBlock, v.count - i0), lo = std::max<int64_t>(0, v.first - i0);
              if (n <= lo) continue;
              if (m > 1) attend_block(qf.data() + i * G * hd, G, hd, wk, wv, lo, n, scale, rows.data() + i * G);
              else attend_block(qf.data() + i * G * hd, G, hd, ck, cv, lo, n, scale, rows.data() + i * G);
            }
            // The next unit's rows once more: prefetches that found the memory's queue full were
            // dropped, and the rest are in L2 by now (a 64-row step's attention 0.95x the time).
            Ahead::all(ahead.next_unit, ahead.row_bytes);
          } else {  // tree slots: each token's own keys, read in the cache
            bool any = false;
            for (int64_t i = 0; i < m; ++i) {
              const Visible& v = visible[b * s.T + members[i]];
              const int64_t n = std::min(kKeyBlock, v.count - i0), lo = std::max<int64_t>(0, v.first - i0);
              if (n <= 0) continue;
              any = true;
              if (n <= lo) continue;
              for (int64_t j = 0; j < n; ++j) {
                const int64_t slot = v.slot(i0 + j);
                krow[j] = kbase + slot * hd;
                vrow[j] = vbase + slot * hd;
              }
              attend_block(qf.data() + i * G * hd, G, hd, Cached{krow}, Cached{vrow}, lo, n, scale, rows.data() + i * G);
            }
            if (!any) break;
          }
        }
        for (int64_t i = 0; i < m; ++i) {
          const int64_t bt = b * s.T + members[i];
          const int64_t segments = (first_part[bt + 1] - first_part[bt]) / s.n_kv;
          float* part = parts + (first_part[bt] + g * segments + k) * part_floats;
          for (int64_t r = 0; r < G; ++r) {
            part[r] = rows[i * G + r].max;
            part[G + r] = rows[i * G + r].sum;
            std::memcpy(part + 2 * G + r * hd, rows[i * G + r].acc, hd * sizeof(float));
          }
        }
      }
      Ahead::all(next_unit(next_rows), hd * 2);  // the rest of them, if this unit was shorter
    }
#pragma omp barrier
    // Then merge each token's segments in order, in the same region.
    alignas(32) float total[kMaxHeadDim];
#pragma omp for schedule(static)
    for (int64_t item = 0; item < tokens * s.n_kv; ++item) {
      const int64_t bt = item / s.n_kv, g = item % s.n_kv;
      const int64_t segments = (first_part[bt + 1] - first_part[bt]) / s.n_kv;
      const int64_t k0 = visible[bt].first / kSegment;  // segments before a window: never attended
      const float* first = parts + (first_part[bt] + g * segments) * part_floats;
      for (int64_t r = 0; r < G; ++r) {
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t k = k0; k < segments; ++k) top = std::max(top, first[k * part_floats + r]);
        float sum = 0.0f;
        std::fill(total, total + hd, 0.0f);
        for (int64_t k = k0; k < segments; ++k) {
          const float* p = first + k * part_floats;
          const float factor = first_lane(simd16::vexp(simd16::vset1(p[r] - top)));
          sum += p[G + r] * factor;
          const float* a = p + 2 * G + r * hd;
          for (int64_t d = 0; d < hd; d += 8)
            _mm256_store_ps(total + d, _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_set1_ps(factor), _mm256_load_ps(total + d)));
        }
        // A token that sees no key (never served: a pad sees itself) gets zeros; NaN stays NaN.
        const __m256 inverse = _mm256_set1_ps(sum == 0.0f ? 0.0f : 1.0f / sum);
        uint16_t* o = out + (bt * s.H + g * G + r) * hd;
        for (int64_t d = 0; d < hd; d += 8)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + d), bf16_round8(_mm256_mul_ps(_mm256_load_ps(total + d), inverse)));
      }
    }
  }
}

}  // namespace

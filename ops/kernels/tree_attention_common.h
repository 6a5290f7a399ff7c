// What every path of tree_attention_cpu.cpp shares: the item's limits and shape, the 16-lane
// loads and stores of a head vector (simd16.h), register blocks of rows, a block's online
// softmax, the next unit's prefetch, and the merge of a segmented item's partial rows.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "simd16.h"

namespace {

constexpr int kMaxRows = 16;     // query rows (new tokens x heads of one KV group) per item

using namespace simd16;

// 16 lanes of a head vector; the last vector of a head dimension that is not a multiple of 16
// is loaded and stored under a lane mask.
inline V16 load(const float* p, Mask16 lanes) { return vmaskz_loadu(lanes, p); }
inline V16 load(const uint16_t* p, Mask16 lanes) { return vload_bf16(p, lanes); }  // bf16 -> f32 is exact
inline void store(float* p, V16 v, Mask16 lanes) { vmask_storeu(p, lanes, v); }
inline void store(uint16_t* p, V16 v, Mask16 lanes) { vstore_bf16(p, v, lanes); }  // nearest even, NaN stays

// exp(x) for x <= 0 (scores minus their running maximum): simd16's vexp. Inputs below -87 give
// about 1e-38 instead of a smaller number or 0; masked scores never get here (their weights are
// set to exactly 0).
inline V16 exp_nonpositive(V16 x) { return vexp(x); }

struct Shape {
  int64_t batch, num_new, heads, kv_heads, capacity, head_dim;
};

// Rows [0, rows) in register blocks: fours, then one block of the 1-3 left.
template <typename F>
inline void row_blocks(int64_t rows, F&& run) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) run(std::integral_constant<int, 4>{}, r);
  switch (rows - r) {
    case 3: return run(std::integral_constant<int, 3>{}, r);
    case 2: return run(std::integral_constant<int, 2>{}, r);
    case 1: return run(std::integral_constant<int, 1>{}, r);
    default: return;
  }
}

constexpr int kBlockKeys(int nv) { return nv <= 4 ? 64 : 32; }  // a widened block: 16 KiB per K and V at hd 64

// One block of a row's scores sr[0, n) (slots j0 + j) turned into the online softmax's weights:
// new slots the tree hides get weight 0, the running maximum and sum are updated, and shrink is
// what the row's earlier weighted sum must be multiplied by (0 on the first visible block).
inline void block_softmax(float* sr, int64_t n, int64_t j0, int64_t committed, const bool* visible, float& run_max,
                          float& run_sum, float& shrink) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  if (j0 + n > committed) {  // new slots are visible only along the tree
    for (int64_t j = std::max<int64_t>(0, committed - j0); j < n; ++j) {
      if (!visible[j0 + j - committed]) sr[j] = minus_inf;
    }
  }
  V16 top = vset1(minus_inf);
  Mask16 unordered = 0;
  for (int64_t j = 0; j < n; j += 16) {
    const Mask16 in = n - j >= 16 ? Mask16(0xffff) : Mask16((1u << (n - j)) - 1);
    const V16 x = vloadu(sr + j);
    top = vmask_max(top, in, top, x);
    unordered |= vmask_unord(in, x);
  }
  const float block_max = vreduce_max(top);
  const float new_max = std::max(run_max, block_max);
  if (unordered || new_max == minus_inf) {  // a NaN score spoils the row; nothing visible yet: no change
    if (unordered) run_sum = std::numeric_limits<float>::quiet_NaN();
    std::fill(sr, sr + n, 0.0f);
    shrink = 1.0f;
    return;
  }
  shrink = std::exp(run_max - new_max);  // 0 on the first visible block
  const V16 top_all = vset1(new_max), inf = vset1(minus_inf);
  V16 weight_sum = vzero();
  for (int64_t j = 0; j < n; j += 16) {
    const Mask16 in = n - j >= 16 ? Mask16(0xffff) : Mask16((1u << (n - j)) - 1);
    const V16 x = vmaskz_loadu(in, sr + j);
    const Mask16 seen = vmask_neq(in, x, inf);
    const V16 w = vmaskz_mov(seen, exp_nonpositive(vsub(x, top_all)));
    weight_sum = vadd(weight_sum, w);
    vmask_storeu(sr + j, in, w);
  }
  run_sum = run_sum * shrink + vreduce_add(weight_sum);
  run_max = new_max;
}

// The key and value rows of the unit this thread attends next (its item's slots [j_begin,
// j_end)), prefetched into L2 while the current one runs: the cache streams from memory and a
// unit's first block would otherwise wait for it.
struct NextRows {
  const char* keys = nullptr;  // the next unit's first key row (nullptr: none)
  const char* values = nullptr;
  int64_t count = 0;      // its rows
  int64_t row_bytes = 0;  // a key's (and a value's) bytes
};

// Rows [from, to) of the next unit into L2, a block at a time as the current unit goes (so the
// current unit's own streaming is not crowded out all at once).
inline void prefetch_next(const NextRows& next, int64_t from, int64_t to) {
  for (int64_t j = from; j < std::min(to, next.count); ++j) {
    for (int64_t line = 0; line < next.row_bytes; line += 64) {
      _mm_prefetch(next.keys + j * next.row_bytes + line, _MM_HINT_T1);
      _mm_prefetch(next.values + j * next.row_bytes + line, _MM_HINT_T1);
    }
  }
}

// A segment's running maximum, sum and unnormalized weighted values for one query row (see
// attend_item).
struct PartialRow {
  float max, sum;
  alignas(64) float acc[128];
};

// The output of an item's rows from its segments' partial results: the online softmax's merge.
template <typename T, int NV>
void merge_partials(const PartialRow* parts, int64_t segments, int64_t rows, const Shape& s, int64_t b, int64_t g,
                    int64_t t0, T* out, int64_t stride = kMaxRows) {
  const int64_t hd = s.head_dim, group = s.heads / s.kv_heads;
  const Mask16 tail = hd % 16 == 0 ? Mask16(0xffff) : Mask16((1u << (hd % 16)) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < segments; ++k) top = std::max(top, parts[k * stride + r].max);
    float sum = 0.0f;
    V16 acc[NV];
    for (int c = 0; c < NV; ++c) acc[c] = vzero();
    for (int64_t k = 0; k < segments; ++k) {
      const PartialRow& p = parts[k * stride + r];
      if (p.max == -std::numeric_limits<float>::infinity() && !std::isnan(p.sum)) continue;  // saw nothing
      const float w = std::exp(p.max - top);
      sum += p.sum * w;
      for (int c = 0; c < NV; ++c) acc[c] = vfmadd(vload(p.acc + c * 16), vset1(w), acc[c]);
    }
    const int64_t t = t0 + r / group, h = g * group + r % group;
    T* o = out + ((b * s.num_new + t) * s.heads + h) * hd;
    const V16 inv = vset1(sum == 0.0f ? 0.0f : 1.0f / sum);  // nothing seen: 0; NaN stays
    for (int c = 0; c < NV; ++c) store(o + c * 16, vmul(acc[c], inv), c == NV - 1 ? tail : Mask16(0xffff));
  }
}

}  // namespace

// decode_layers.cpp's attention, its parts: the order every sum runs in (below), the visible
// sequence of a token, the 16 lanes folded alike on both builds, where a block's rows are read
// (in the cache or widened) and prefetched, and the scores, online softmax and weighted values of
// up to three query rows over one block. attend, in decode_layers_attn.h, runs them.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "simd16.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Attention whose every output row is a function of that row alone.
//
// New token t of row b sees the row's committed slots [0, L) (L = lengths[b]) and, among its
// new slots L + s, those with tree_mask[b, t, s] set (no mask: a causal chain, s <= t). Its
// visible keys, in slot order, form one sequence: the committed prefix, then its tree
// ancestors and itself. A decode step at length L + d, a chain, a tree whose accepted path
// reaches the same token, and a prefill all give that token the same sequence of key and
// value rows (the same bits, written by the same forward), so every sum below runs in an order
// fixed by the position in that sequence alone, never by the slots, the number of new tokens,
// the rows in the batch or the threads:
//   * the sequence is cut into segments of kSegment keys and blocks of kKeyBlock keys, both
//     counted from its first key. A token's segment is attended under an online softmax over
//     its blocks; its segments are merged in order, always (one merges with itself, exactly);
//   * a score is the query's dot product with one key: sixteen FMA chains, lane l over the
//     dimensions d = l, l + 16, ... in order, lanes l and l + 8 added, then those eight in one
//     fixed tree (sum_lanes), times 1/sqrt(hd);
//   * weights are simd16's vexp of a block's scores minus the running maximum (zero past its
//     keys); their sum is the block's 16-key pieces added in order, then folded and summed in
//     a fixed tree, and the weighted values are accumulated key by key in sequence order.
// All in float32; bf16 inputs widen exactly, and the output is rounded to nearest even.
//
// Work: a unit is (row, a chunk of kTokenChunk new tokens, KV head, segment) and takes the
// chunk's tokens that reach that segment, with their H / n_kv query heads; a thread claims its
// next unit as it starts one (so it can fetch that unit's rows meanwhile), and each token's
// segments are then merged in the same parallel region. A unit of one token (a decode step's)
// reads its keys and values in the bf16 cache (touched once a block first); a unit of several
// widens each block of the committed prefix (or, for a causal chain, any block: key i
// is slot i) to float32 once for all of its tokens, and reads tree slots in the cache per
// token. Either way a token's arithmetic is the same, so sharing changes what is read, not
// what is computed.
constexpr int64_t kKeyBlock = 64;
constexpr int64_t kSegment = 128;  // a multiple of kKeyBlock
constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kTokenChunk = 16;  // new tokens of a row a unit of work takes at most
constexpr int64_t kMaxHeadDim = 256;

struct AttnShape {
  int64_t B, T, H, n_kv, C, hd;
};

// The visible sequence of one new token: its length, and key i's slot.
struct Visible {
  int64_t committed;     // L
  const int32_t* nodes;  // the visible new slots' indices s, ascending; null for a causal chain
  int64_t count;         // L + number of visible new slots
  int64_t first;         // the first key in a sliding window (key i is at position i), else 0
  int64_t slot(int64_t i) const { return i < committed || !nodes ? i : committed + nodes[i - committed]; }
};

// simd16's 16 lanes, folded and summed the same way on both of its backends (one zmm, or two
// ymm halves), so the AVX-512 build of this op computes what the AVX2 build does, bit for bit.
using simd16::V16;
#if defined(__AVX512F__)
constexpr int kKeysPerPass = 4;  // keys a score pass takes: R x 4 sums in zmm registers
constexpr int kWeighVectors = 4;  // 16-dim pieces of a row's weighted values held at once
inline __m256 low(V16 a) { return _mm512_castps512_ps256(a.v); }  // lanes 0..7
inline __m256 high(V16 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)); }  // 8..15
#else
constexpr int kKeysPerPass = 8;  // one key's R sums (two ymm halves each) at a time, eight keys reduced at once
constexpr int kWeighVectors = 1;  // R x 1 sums, R weights and a value: 11 ymm registers at R = 3 (two spilled)
inline __m256 low(V16 a) { return a.lo; }
inline __m256 high(V16 a) { return a.hi; }
#endif
inline __m256 fold(V16 a) { return _mm256_add_ps(low(a), high(a)); }      // lanes 0..7 + lanes 8..15
inline __m256 fold_max(V16 a) { return _mm256_max_ps(low(a), high(a)); }
inline float first_lane(V16 a) { return _mm256_cvtss_f32(low(a)); }
inline V16 bf16x16(const uint16_t* p) { return simd16::vload_bf16(p, 0xffff); }

// Where a unit reads a block's key and value rows: in the bf16 cache itself (Cached: a unit of
// one token, or a block of tree slots, which each token gathers for itself), or widened once to
// float32 rows (Widened: a block of the committed prefix shared by several tokens). load(j, d)
// is dims d .. d+15 of the block's row j, the same float32 values either way (widening is exact).
struct Cached {
  const uint16_t* const* row;
  V16 load(int64_t j, int64_t d) const { return bf16x16(row[j] + d); }
};
struct Widened {
  const float* rows;
  int64_t hd;
  V16 load(int64_t j, int64_t d) const { return simd16::vload(rows + j * hd + d); }
};

// Key and value rows that a later block or unit will read, fetched into L2 a row at a time
// while a block's own rows are first read (widened, or touched): a decode batch streams every
// row's cache from memory once. Issued in bursts between blocks instead, these prefetches
// stalled on the memory's queue while nothing else ran (a 64-row step's attention 1.2-1.3x the
// time on AVX2). Two streams: the segment's next block and this thread's next unit.
struct Ahead {
  struct Stream {
    const char* keys = nullptr;  // row 0 of the keys, and of the values
    const char* values = nullptr;
    int64_t rows = 0;
  } next_block, next_unit;
  int64_t row_bytes = 0;
  // Always inlined: GCC (12) takes a function whose only effect is a prefetch for a const one,
  // and drops the calls whose results go unused, with the prefetches.
  [[gnu::always_inline]] static void fetch(const Stream& s, int64_t j, int64_t offset) {
    if (j >= s.rows) return;
    _mm_prefetch(s.keys + offset, _MM_HINT_T1);
    _mm_prefetch(s.values + offset, _MM_HINT_T1);
  }
  [[gnu::always_inline]] void line(int64_t j, int64_t at) const {  // the streams' row j, its line at byte `at`
    fetch(next_block, j, j * row_bytes + at);
    fetch(next_unit, j, j * row_bytes + at);
  }
  [[gnu::always_inline]] void rest(int64_t from) const {  // their rows from `from` on
    for (int64_t j = from; j < std::max(next_block.rows, next_unit.rows); ++j)
      for (int64_t at = 0; at < row_bytes; at += 64) line(j, at);
  }
  [[gnu::always_inline]] static void all(const Stream& s, int64_t row_bytes) {  // every row of one stream
    for (int64_t j = 0; j < s.rows; ++j)
      for (int64_t at = 0; at < row_bytes; at += 64) fetch(s, j, j * row_bytes + at);
  }
};

// A decode unit's block, read in the cache where it lies: each key and value row's lines loaded
// once up front (into L1, 2 x 8 KiB at hd 64), beside the prefetches of `ahead`'s rows, so that
// scoring and weighing find them there.
void touch_block(const uint16_t* const* krow, const uint16_t* const* vrow, int64_t n, int64_t hd, const Ahead& ahead) {
  __m256i sink = _mm256_setzero_si256();
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t at = 0; at < hd * 2; at += 64) {
      ahead.line(j, at);
      sink = _mm256_or_si256(sink, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const char*>(krow[j]) + at)));
      sink = _mm256_or_si256(sink, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const char*>(vrow[j]) + at)));
    }
  }
  asm volatile("" : : "x"(sink));  // the loads are the point: kept
  ahead.rest(n);
}

// A block's rows widened to float32: k[j * hd + d] and v[j * hd + d].
struct Block {
  alignas(64) float k[kKeyBlock * kMaxHeadDim];
  alignas(64) float v[kKeyBlock * kMaxHeadDim];
};

void widen_block(const uint16_t* const* krow, const uint16_t* const* vrow, int64_t n, int64_t hd, Block& out,
                 const Ahead& ahead) {
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t at = 0; at < hd * 2; at += 64) ahead.line(j, at);
    for (int64_t d = 0; d < hd; d += 16) {
      simd16::vstore(out.k + j * hd + d, bf16x16(krow[j] + d));
      simd16::vstore(out.v + j * hd + d, bf16x16(vrow[j] + d));
    }
  }
  ahead.rest(n);
}

// The online-softmax state of one query row: its running maximum and sum, and its weighted
// values acc (hd floats).
struct RowState {
  float max, sum;
  float* acc;
};

// Keys' folded eight-lane partial dot products -> their scores, each summed as
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): eight keys at once, four, or one, alike.
template <int K>
inline void sum_lanes(const __m256* a, float* out) {
  static_assert(K == 1 || K == 4 || K == 8, "sum_lanes takes one key, four or eight");
  if constexpr (K == 8) {  // lanes 0..3 of x: keys 0..3's l0..l3 sums, 4..7 their l4..l7 sums; y keys 4..7's
    const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31)));
  } else if constexpr (K == 4) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  } else {
    const __m256 t = _mm256_hadd_ps(a[0], a[0]), u = _mm256_hadd_ps(t, t);
    out[0] = _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
  }
}

// Rows q[0, R) (R <= 3; hd apart) against keys j0 .. j0 + K - 1 of a block:
// score[r][j] = (lane l's FMA chain over d = l, l + 16, ... folded with lane l + 8's, then
// summed by sum_lanes) * scale. Four keys' sums are held at once (AVX-512: R x 4 zmm), or, for
// eight (AVX2, where a key's R sums are 2R ymm registers), one key's at a time, their folded
// halves kept for one reduction of all eight.
template <int R, int K, class Keys>
inline void score_keys(const float* q, int64_t hd, const Keys& keys, int64_t j0, float scale, float (*score)[kKeyBlock]) {
  alignas(32) float sums[K];
  if constexpr (K == 8) {
    __m256 folded[R][K];
    for (int j = 0; j < K; ++j) {
      V16 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = simd16::vzero();
      for (int64_t d = 0; d < hd; d += 16) {
        const V16 k = keys.load(j0 + j, d);
        for (int r = 0; r < R; ++r) acc[r] = simd16::vfmadd(simd16::vloadu(q + r * hd + d), k, acc[r]);
      }
      for (int r = 0; r < R; ++r) folded[r][j] = fold(acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      sum_lanes<K>(folded[r], sums);
      for (int j = 0; j < K; ++j) score[r][j0 + j] = sums[j] * scale;
    }
  } else {
    V16 acc[R][K];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < K; ++j) acc[r][j] = simd16::vzero();
    for (int64_t d = 0; d < hd; d += 16) {
      for (int j = 0; j < K; ++j) {
        const V16 k = keys.load(j0 + j, d);
        for (int r = 0; r < R; ++r) acc[r][j] = simd16::vfmadd(simd16::vloadu(q + r * hd + d), k, acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 folded[K];
      for (int j = 0; j < K; ++j) folded[j] = fold(acc[r][j]);
      sum_lanes<K>(folded, sums);
      for (int j = 0; j < K; ++j) score[r][j0 + j] = sums[j] * scale;
    }
  }
}

// Rows [0, R) (R <= 3) take weights p[r][0 .. n) of dims d0 .. d0 + 16W of the block's values:
// acc = acc * shrink, then acc = fma(p[r][j], v_j, acc) key by key in order, each lane on its
// own (W, a constant, keeps the R x W sums in registers).
template <int R, int W, class Values>
inline void weigh_dims(const float (*p)[kKeyBlock], const float* shrink, int64_t n, const Values& values, int64_t d0,
                       RowState* rows) {
  V16 a[R][W];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) a[r][c] = simd16::vmul(simd16::vloadu(rows[r].acc + d0 + 16 * c), simd16::vset1(shrink[r]));
  for (int64_t j = 0; j < n; ++j) {
    V16 w[R];
    for (int r = 0; r < R; ++r) w[r] = simd16::vset1(p[r][j]);
    for (int c = 0; c < W; ++c) {
      const V16 v = values.load(j, d0 + 16 * c);
      for (int r = 0; r < R; ++r) a[r][c] = simd16::vfmadd(w[r], v, a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) simd16::vstoreu(rows[r].acc + d0 + 16 * c, a[r][c]);
}

template <int R, class Values>
inline void weigh(const float (*p)[kKeyBlock], const float* shrink, int64_t n, const Values& values, int64_t hd,
                  RowState* rows) {
  constexpr int W = kWeighVectors;
  int64_t d0 = 0;
  for (; d0 + 16 * W <= hd; d0 += 16 * W) weigh_dims<R, W>(p, shrink, n, values, d0, rows);
  switch ((hd - d0) / 16) {
    case 3: return weigh_dims<R, 3>(p, shrink, n, values, d0, rows);
    case 2: return weigh_dims<R, 2>(p, shrink, n, values, d0, rows);
    case 1: return weigh_dims<R, 1>(p, shrink, n, values, d0, rows);
    default: return;
  }
}

// R query rows (q, their states) take keys [lo, n) of a block (lo < n; the scores of keys
// before lo, outside a sliding window, are never used). The block's weights are exp(score - max) (simd16's exp, lane by lane; zero outside
// [lo, n)), and their sum the 16-key pieces added in order, then folded and summed as
// reduce_add8 does.
template <int R, class Keys, class Values>
void attend_rows(const float* q, int64_t hd, const Keys& keys, const Values& values, int64_t lo, int64_t n, float scale,
                 RowState* rows) {
  alignas(64) float score[R][kKeyBlock];
  int64_t j0 = 0;
  for (; j0 + kKeysPerPass <= n; j0 += kKeysPerPass) score_keys<R, kKeysPerPass>(q, hd, keys, j0, scale, score);
  for (; j0 < n; ++j0) score_keys<R, 1>(q, hd, keys, j0, scale, score);
  float shrink[R] = {};
  const int64_t pieces = (n + 15) / 16;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < R; ++r) {
    RowState& row = rows[r];
    float* sr = score[r];
    for (int64_t j = n; j < pieces * 16; ++j) sr[j] = minus_inf;  // padding: no part in the maximum
    for (int64_t j = 0; j < lo; ++j) sr[j] = minus_inf;  // before the window, likewise
    V16 top = simd16::vload(sr);
    for (int64_t c = 1; c < pieces; ++c) top = simd16::vmax(top, simd16::vload(sr + 16 * c));
    const float new_max = std::max(row.max, simd16::reduce_max8(fold_max(top)));
    const V16 m = simd16::vset1(new_max);
    V16 total = simd16::vzero();
    for (int64_t c = 0; c < pieces; ++c) {
      V16 w = simd16::vexp(simd16::vsub(simd16::vload(sr + 16 * c), m));
      if (c == pieces - 1 && n % 16) w = simd16::vmaskz_mov(simd16::Mask16((1u << (n % 16)) - 1), w);
      if (lo > 16 * c) w = lo >= 16 * c + 16 ? simd16::vzero() : simd16::vmaskz_mov(simd16::Mask16(~((1u << (lo - 16 * c)) - 1)), w);
      simd16::vstore(sr + 16 * c, w);
      total = simd16::vadd(total, w);
    }
    shrink[r] = row.max == minus_inf ? 0.0f : first_lane(simd16::vexp(simd16::vset1(row.max - new_max)));
    row.max = new_max;
    row.sum = row.sum * shrink[r] + simd16::reduce_add8(fold(total));
  }
  weigh<R>(score, shrink, n, values, hd, rows);
}

// G query rows take keys [lo, n) of a block, three rows at a time.
template <class Keys, class Values>
void attend_block(const float* q, int64_t G, int64_t hd, const Keys& keys, const Values& values, int64_t lo, int64_t n,
                  float scale, RowState* rows) {
  int64_t r = 0;
  for (; r + 3 <= G; r += 3) attend_rows<3>(q + r * hd, hd, keys, values, lo, n, scale, rows + r);
  if (G - r == 2) attend_rows<2>(q + r * hd, hd, keys, values, lo, n, scale, rows + r);
  if (G - r == 1) attend_rows<1>(q + r * hd, hd, keys, values, lo, n, scale, rows + r);
}

}  // namespace

// Attention of a verify step's new tokens (a decode token, a chain or a token tree) over a KV
// cache, for CPUs with AVX-512 or AVX2 (16-lane vectors from simd16.h, one build per kind of CPU):
// the CPU twin of the CUDA tree-mask kernel.
//
//   out = tree_decode(q, keys, values, lengths, tree_mask)
//
//   q          (B, T, H, hd)  the new tokens' queries (after RoPE), float32 or bfloat16
//   keys       (B, n_kv, C, hd) the cache, same dtype; values alike
//   lengths    (B,) int64     row b's committed prefix: slots [0, lengths[b])
//   tree_mask  (B, T, T) bool new token t sees new token s (at slot lengths[b] + s) iff set
//   out        (B, T, H * hd) same dtype as q, ready for the output projection
//
// Token t of row b attends to slots [0, lengths[b]) and to the tree-visible slots among
// [lengths[b], lengths[b] + T); nothing else is read. So the dense (B, 1, T, S) mask of the
// eager path is never built, and each row reads only its own committed length, not the longest.
//
// Work is split into items (row b, KV head g, a chunk of new tokens): the chunk's queries of all
// H / n_kv heads that share head g (GQA: K/V never expanded) are at most kMaxRows rows, and the
// item reads each of its keys and values once, in blocks, under an online softmax (flash
// style: no score matrix over all slots). When there are fewer items than a few per thread (a
// one-row decode has one per KV head), each item's slots are split into segments of whole key
// blocks, attended apart and merged (flash-decoding's split over the keys). Scores, softmax and
// the weighted sum are in float32; bfloat16 inputs are widened exactly and the output is
// rounded to nearest even.
//
// write_kv(keys, values, new_keys, new_values, lengths) stores the new tokens' K/V (B, T, n_kv, hd)
// at slots lengths[b] + t of the cache, in place.
//
// Threads: OpenMP (torch's libgomp), torch's thread count, items handed out round robin (so each
// thread knows its next item and, on the bf16 path, prefetches its rows into L2 meanwhile).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include "simd16.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx_tiles.h"
#endif
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

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

// One item: new tokens [t0, t0 + tc) of row b, the heads of KV group g, over slots
// [j_begin, j_end) of the row's committed + new ones. With partial == nullptr it writes the
// attention output; otherwise, for a segment of the slots, each row's running maximum, sum and
// unnormalized weighted values (PartialRow), for merge_partials to combine.
struct PartialRow {
  float max, sum;
  alignas(64) float acc[128];
};

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

template <typename T, int NV>
void attend(const T* q, const T* keys, const T* values, const int64_t* lengths, const bool* tree_mask, const Shape& s,
            T* out) {
  const int64_t group = s.heads / s.kv_heads;
  const int64_t per_chunk = std::max<int64_t>(1, kMaxRows / group);
  const int64_t chunks = (s.num_new + per_chunk - 1) / per_chunk;
  const int64_t tc = (s.num_new + chunks - 1) / chunks;  // balanced chunks
  const int64_t items = s.batch * s.kv_heads * chunks;
  const int64_t work = items * tc * group * (lengths[0] + s.num_new);
  const int threads = work < (1 << 11) ? 1 : at::get_num_threads();  // tiny steps: no fork
  // Fewer items than a few per thread (a one-row decode has one per KV head): each item's slots
  // are split into segments of whole key blocks, attended apart and merged (flash-decoding).
  int64_t longest = 0;
  for (int64_t b = 0; b < s.batch; ++b) longest = std::max(longest, lengths[b] + s.num_new);
  const int64_t block = kBlockKeys(NV);
  const int64_t wanted = threads == 1 || items >= 4 * threads ? 1 : (4 * threads + items - 1) / items;
  const int64_t segment = std::max<int64_t>(1, (longest + wanted * block - 1) / (wanted * block)) * block;
  const int64_t segments = (longest + segment - 1) / segment;
  std::vector<PartialRow> parts(segments > 1 ? items * segments * kMaxRows : 0);
#pragma omp parallel num_threads(threads)
  {
    // kt also holds attend_item_bf16's transposed key pairs (64 keys x NV * 8 pairs).
    alignas(64) float kt[kBlockKeys(NV) * NV * 16 > 64 * NV * 8 ? kBlockKeys(NV) * NV * 16 : 64 * NV * 8],
        vbuf[kBlockKeys(NV) * NV * 16];
    // Round robin: a thread's next unit is known (unit + threads), so its rows can be prefetched.
    const int64_t stride = omp_get_num_threads();
    auto unit_slots = [&](int64_t unit, int64_t& b, int64_t& g, int64_t& j_begin, int64_t& j_end) {
      const int64_t item = unit / segments, k = unit % segments;
      b = item / (s.kv_heads * chunks);
      g = item / chunks % s.kv_heads;
      j_begin = k * segment;
      j_end = std::min(lengths[b] + s.num_new, j_begin + segment);
    };
#pragma omp for schedule(static, 1)
    for (int64_t unit = 0; unit < items * segments; ++unit) {
      const int64_t item = unit / segments, k = unit % segments, c = item % chunks;
      int64_t b, g, j_begin, j_end;
      unit_slots(unit, b, g, j_begin, j_end);
      const int64_t t0 = c * tc, count = std::min(tc, s.num_new - t0);
      if (count <= 0) continue;
      PartialRow* partial = segments > 1 ? parts.data() + (item * segments + k) * kMaxRows : nullptr;
      if (j_begin >= j_end) {  // this row is shorter than the longest: an empty segment
        for (int64_t r = 0; r < count * group; ++r) {
          partial[r].max = -std::numeric_limits<float>::infinity();
          partial[r].sum = 0.0f;
        }
        continue;
      }
      NextRows next;
      if (unit + stride < items * segments) {
        int64_t nb, ng, nj_begin, nj_end;
        unit_slots(unit + stride, nb, ng, nj_begin, nj_end);
        const int64_t offset = ((nb * s.kv_heads + ng) * s.capacity + nj_begin) * s.head_dim;
        next = {reinterpret_cast<const char*>(keys + offset), reinterpret_cast<const char*>(values + offset),
                std::max<int64_t>(0, nj_end - nj_begin), s.head_dim * int64_t(sizeof(T))};
      }
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, uint16_t> && NV % 2 == 0) {
        if (s.head_dim == NV * 16) {  // a multiple of 32
          attend_item_bf16<NV * 16>(q, keys, values, tree_mask, lengths[b], s, b, g, t0, count, j_begin, j_end, out,
                                    partial, reinterpret_cast<uint32_t*>(kt), next);
          continue;
        }
      }
#endif
      attend_item<T, NV>(q, keys, values, tree_mask, lengths[b], s, b, g, t0, count, j_begin, j_end, out, partial, kt, vbuf,
                         next);
    }
  }
  if (segments > 1) {
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / (s.kv_heads * chunks), g = item / chunks % s.kv_heads, c = item % chunks;
      const int64_t t0 = c * tc, count = std::min(tc, s.num_new - t0);
      if (count > 0) merge_partials<T, NV>(parts.data() + item * segments * kMaxRows, segments, count * group, s, b, g, t0, out);
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// Many new tokens on AMX tiles (bfloat16, head size 64): a tree or chain whose queries of one
// KV group are more than one item's kMaxRows rows (the verifier's 16- and 64-node trees).
//
// The vector items above give each chunk of a few new tokens its own item, which reads,
// transposes and multiplies the group's keys again: at 16 new tokens 4 items per KV head, at 64
// nodes 13, and a 64-node tree cost more than torch's dense attention. Here one unit takes every
// query row of its KV group (T * H / n_kv rows, in tiles of 16) over a segment of the slots, in
// blocks of at most kTileKeys keys, and per tile of 16 rows:
//   * scores transposed, S^T = K Q^T: the A tiles are 16 keys straight from the cache (no
//     transposing), the B tiles the rows' queries in bf16 pairs (built once per unit); fp32 sums
//     of exact bf16 products, as on the vector path. A score vector is then one key for the 16
//     rows, so the online softmax's maxima, sums and shrink factors are per-lane vectors, with
//     no reduction across lanes;
//   * the weights are rounded to bf16 in key pairs (as torch's flash attention does for bf16)
//     and transposed back into an A tile of 16 rows x 32 keys, which multiplies the block's
//     values (B tiles of 16 dims, the values interleaved in key pairs once per block) into
//     16 x 64 fp32 sums, added to the rows' sums after the softmax's shrink. Measured in q4_1
//     on 432 greedy positions: a 16-token chain's argmax agreed with 16 one-token steps' 99.3%
//     of the time, against 99.1% with the vector path's fp32 weights and 99.1% with each weight
//     split into two bf16 terms (which cost 1.35x); the steps differ more in their products.
// Segments are merged as on the vector path. A tree-hidden slot gets weight 0; a NaN score makes
// NaN weights in its own row only; the output is rounded to nearest even, as elsewhere.
constexpr int64_t kTileKeys = 128;  // keys per block at most
constexpr int64_t kTileDim = 64;    // the head size the tiles take

// Tiles (all 8 of treeserve_amx::configure_tiles' 16 x 64 bytes): tmm0-3 C (scores of 16 keys
// in tmm0; the weighted values' 16 x 64 fp32 sums in tmm0-3), tmm4/tmm5 A (keys' dims 0-31 /
// 32-63; the weights in tmm4), tmm6/tmm7 B (queries' pairs of dims 0-31 / 32-63; the values of
// 16 dims).

// 2^y for weights that are then rounded to bf16: y = n + f, |f| <= 1/2, 2^f by a degree-4
// polynomial (relative error below 5e-5, a fortieth of bf16's rounding), scaled by 2^n with
// vscalefps (0 below the float range; NaN stays NaN).
inline __m512 exp2_for_bf16(__m512 y) {
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(0.0096181291f);                   // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0555041087f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265070f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471806f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Value rows 2i and 2i + 1 interleaved per dim (dst[2d + j] = value 2i + j, dim d; a null row is
// zero): one row of the weighted sum's B tiles (16 dims x 2 keys per 64 bytes).
inline void interleave_value_pair(const uint16_t* v0, const uint16_t* v1, uint16_t* dst) {
  alignas(64) static constexpr uint16_t low_index[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                         8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t high_index[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                          24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(low_index), high = _mm512_load_si512(high_index);
  for (int half = 0; half < 2; ++half) {
    const __m512i a = v0 ? _mm512_loadu_si512(v0 + half * 32) : _mm512_setzero_si512();
    const __m512i b = v1 ? _mm512_loadu_si512(v1 + half * 32) : _mm512_setzero_si512();
    _mm512_store_si512(dst + half * 64, _mm512_permutex2var_epi16(a, low, b));
    _mm512_store_si512(dst + half * 64 + 32, _mm512_permutex2var_epi16(a, high, b));
  }
}

// A 64-byte aligned array, not initialized, freed with its scope.
template <typename T>
struct AlignedBuffer {
  explicit AlignedBuffer(int64_t count)
      : ptr(static_cast<T*>(std::aligned_alloc(64, (std::max<int64_t>(1, count) * sizeof(T) + 63) / 64 * 64))) {}
  ~AlignedBuffer() { std::free(ptr); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  T* data() const { return ptr; }
  T* ptr;
};

// Per thread: the unit's queries as B tiles and its rows' sums, then one block's values, and
// one row tile's scores and weights.
struct TileScratch {
  explicit TileScratch(int64_t padded_rows)
      : qt(padded_rows * kTileDim), acc(padded_rows * kTileDim), run_max(padded_rows), run_sum(padded_rows) {}
  AlignedBuffer<uint32_t> qt;  // [row tile][32 dim pairs][16 rows]: B tiles of the scores
  AlignedBuffer<float> acc;    // [row][64]: the rows' weighted sums
  AlignedBuffer<float> run_max, run_sum;
  alignas(64) uint16_t vp[kTileKeys * kTileDim];  // the block's values in key pairs
  alignas(64) uint16_t kpad[16 * kTileDim];       // a last partial tile of keys, zero-padded
  alignas(64) float score[kTileKeys * 16];        // [key][16 rows]
  alignas(64) uint32_t weight[kTileKeys / 2 * 16];  // [32-key chunk][16 rows][16 key pairs]
  alignas(64) float sums[16 * kTileDim];
};

// One unit: all rows of row b's KV group g (rows = T * group, token-major as attend_item's)
// over slots [j_begin, j_end); writes the output, or the segment's partial rows. seen[rt * T +
// s] holds, for row tile rt, which of its 16 rows see new slot committed + s.
void attend_unit_tiles(const uint16_t* q, const uint16_t* keys, const uint16_t* values, int64_t committed,
                       const Shape& s, int64_t b, int64_t g, int64_t j_begin, int64_t j_end, const __mmask16* seen,
                       uint16_t* out, PartialRow* partial, TileScratch& w) {
  constexpr int64_t HD = kTileDim;
  const int64_t group = s.heads / s.kv_heads, rows = s.num_new * group, tiles = (rows + 15) / 16;
  constexpr float kLog2e = 1.44269504088896341f;
  const float scale = 1.0f / std::sqrt(float(HD)), minus_inf = -std::numeric_limits<float>::infinity();
  const uint16_t* kbase = keys + (b * s.kv_heads + g) * s.capacity * HD;
  const uint16_t* vbase = values + (b * s.kv_heads + g) * s.capacity * HD;
  // The queries as B tiles: qt[rt][p][r] = dims 2p, 2p + 1 of row rt * 16 + r (padding rows 0).
  for (int64_t rt = 0; rt < tiles; ++rt) {
    for (int c = 0; c < 2; ++c) {
      V16 tile[16];
      for (int r = 0; r < 16; ++r) {
        const int64_t row = rt * 16 + r;
        const uint16_t* qr = q + ((b * s.num_new + row / group) * s.heads + g * group + row % group) * HD;
        tile[r] = {row < rows ? _mm512_castsi512_ps(_mm512_loadu_si512(qr + c * 32)) : _mm512_setzero_ps()};
      }
      transpose16(tile);
      for (int p = 0; p < 16; ++p) vstore(reinterpret_cast<float*>(w.qt.data() + (rt * 32 + c * 16 + p) * 16), tile[p]);
    }
  }
  std::fill(w.acc.data(), w.acc.data() + tiles * 16 * HD, 0.0f);
  std::fill(w.run_max.data(), w.run_max.data() + tiles * 16, minus_inf);
  std::fill(w.run_sum.data(), w.run_sum.data() + tiles * 16, 0.0f);
  // Blocks of equal size (a multiple of 32 keys but the last).
  const int64_t length = j_end - j_begin, blocks = (length + kTileKeys - 1) / kTileKeys;
  const int64_t block = (length + blocks * 32 - 1) / (blocks * 32) * 32;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += block) {
    const int64_t n = std::min(block, j_end - j0), n16 = (n + 15) / 16 * 16, n32 = (n + 31) / 32 * 32;
    for (int64_t i = 0; i < n32 / 2; ++i) {  // keys past n are zero (0 * a stale slot's NaN is NaN)
      const int64_t j = 2 * i;
      interleave_value_pair(j < n ? vbase + (j0 + j) * HD : nullptr, j + 1 < n ? vbase + (j0 + j + 1) * HD : nullptr,
                            w.vp + i * 2 * HD);
    }
    if (n < n16) {  // the last keys' tile would read past the block (perhaps past the cache)
      std::memcpy(w.kpad, kbase + (j0 + n16 - 16) * HD, (n - (n16 - 16)) * HD * sizeof(uint16_t));
      std::memset(w.kpad + (n - (n16 - 16)) * HD, 0, (n16 - n) * HD * sizeof(uint16_t));
    }
    // New slots in this block: keys [first_new, n).
    const int64_t first_new = std::clamp<int64_t>(committed - j0, 0, n);
    for (int64_t rt = 0; rt < tiles; ++rt) {
      const int64_t first = rt * 16;
      _tile_loadd(6, w.qt.data() + rt * 32 * 16, 64);
      _tile_loadd(7, w.qt.data() + (rt * 32 + 16) * 16, 64);
      for (int64_t kt = 0; kt < n16 / 16; ++kt) {  // S^T for 16 keys: key rows, row columns
        const uint16_t* k16 = kt * 16 + 16 > n ? w.kpad : kbase + (j0 + kt * 16) * HD;
        _tile_zero(0);
        _tile_loadd(4, k16, HD * 2);
        _tile_loadd(5, k16 + 32, HD * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(0, 5, 7);
        _tile_stored(0, w.score + kt * 16 * 16, 64);
      }
      // The online softmax, 16 rows a vector.
      const __m512 factor = _mm512_set1_ps(scale);
      __m512 top = _mm512_set1_ps(minus_inf);
      for (int64_t j = 0; j < first_new; ++j) top = _mm512_max_ps(top, _mm512_load_ps(w.score + j * 16));
      for (int64_t j = first_new; j < n; ++j) {
        top = _mm512_mask_max_ps(top, seen[rt * s.num_new + j0 + j - committed], top, _mm512_load_ps(w.score + j * 16));
      }
      const __m512 old_max = _mm512_load_ps(w.run_max.data() + first);
      const __m512 new_max = _mm512_max_ps(old_max, _mm512_mul_ps(top, factor));
      const __mmask16 alive = _mm512_cmp_ps_mask(new_max, _mm512_set1_ps(minus_inf), _CMP_NEQ_UQ);  // NaN rows too
      // exp(old - new): 0 on a row's first visible block (old = -inf, clamped); 1 where none yet.
      const __m512 shrink = _mm512_mask_blend_ps(
          alive, _mm512_set1_ps(1.0f), exp_nonpositive(V16{_mm512_maskz_sub_ps(alive, old_max, new_max)}).v);
      const __m512 mul = _mm512_set1_ps(scale * kLog2e);
      const __m512 sub = _mm512_maskz_mul_ps(alive, new_max, _mm512_set1_ps(kLog2e));
      __m512 weight_sum = _mm512_setzero_ps();
      for (int64_t chunk = 0; chunk < n32 / 32; ++chunk) {
        V16 pairs[16];  // pairs[i] lane r: the bf16 weights of keys 2i and 2i + 1 of the chunk for row r
        for (int i = 0; i < 16; ++i) {
          __m512 wk[2];
          for (int e = 0; e < 2; ++e) {
            const int64_t j = chunk * 32 + 2 * i + e;
            const __mmask16 m = j >= n ? __mmask16(0) : j < first_new ? alive : __mmask16(alive & seen[rt * s.num_new + j0 + j - committed]);
            wk[e] = _mm512_maskz_mov_ps(m, exp2_for_bf16(_mm512_fmsub_ps(_mm512_load_ps(w.score + j * 16), mul, sub)));
            weight_sum = _mm512_add_ps(weight_sum, wk[e]);
          }
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(wk[1], wk[0]);  // key 2i in the low half
          const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(both));
          const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(both, 1));
          pairs[i] = {_mm512_castsi512_ps(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)))};
        }
        transpose16(pairs);  // now pairs[r] = row r's 16 key pairs: one A tile row
        for (int r = 0; r < 16; ++r) vstore(reinterpret_cast<float*>(w.weight + (chunk * 16 + r) * 16), pairs[r]);
      }
      _mm512_store_ps(w.run_sum.data() + first,
                      _mm512_fmadd_ps(_mm512_load_ps(w.run_sum.data() + first), shrink, weight_sum));
      _mm512_store_ps(w.run_max.data() + first, new_max);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t chunk = 0; chunk < n32 / 32; ++chunk) {
        const uint16_t* vpairs = w.vp + chunk * 16 * 2 * HD;
        _tile_loadd(4, w.weight + chunk * 16 * 16, 64);
        _tile_loadd(6, vpairs, 4 * HD);
        _tile_loadd(7, vpairs + 32, 4 * HD);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, vpairs + 64, 4 * HD);
        _tile_loadd(7, vpairs + 96, 4 * HD);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(3, 4, 7);
      }
      _tile_stored(0, w.sums, HD * 4);
      _tile_stored(1, w.sums + 16, HD * 4);
      _tile_stored(2, w.sums + 32, HD * 4);
      _tile_stored(3, w.sums + 48, HD * 4);
      alignas(64) float shrink_rows[16];
      _mm512_store_ps(shrink_rows, shrink);
      for (int64_t r = 0; r < std::min<int64_t>(16, rows - first); ++r) {
        float* a = w.acc.data() + (first + r) * HD;
        const __m512 f = _mm512_set1_ps(shrink_rows[r]);
        for (int c = 0; c < HD / 16; ++c) {
          _mm512_store_ps(a + c * 16, _mm512_fmadd_ps(_mm512_load_ps(a + c * 16), f, _mm512_load_ps(w.sums + r * HD + c * 16)));
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = w.acc.data() + r * HD;
    if (partial != nullptr) {
      partial[r].max = w.run_max.data()[r];
      partial[r].sum = w.run_sum.data()[r];
      std::memcpy(partial[r].acc, a, HD * sizeof(float));
      continue;
    }
    const float sum = w.run_sum.data()[r];
    const int64_t t = r / group, h = g * group + r % group;
    uint16_t* o = out + ((b * s.num_new + t) * s.heads + h) * HD;
    const V16 inv = vset1(sum == 0.0f ? 0.0f : 1.0f / sum);  // nothing seen: 0; NaN stays
    for (int c = 0; c < HD / 16; ++c) store(o + c * 16, vmul(vload(a + c * 16), inv), Mask16(0xffff));
  }
}

// Whether this process may run tile instructions (asked of the OS once).
inline bool tiles_granted() {
  static const bool granted = (treeserve_amx::init(true) & treeserve_amx::kTiles) != 0;
  return granted;
}

// The tile path's shapes: bf16 (checked by the caller), head size 64, more query rows per KV
// group than one vector item takes.
inline bool use_tiles(const Shape& s) {
  return s.head_dim == kTileDim && s.num_new * (s.heads / s.kv_heads) > kMaxRows && tiles_granted();
}

void attend_tiles(const uint16_t* q, const uint16_t* keys, const uint16_t* values, const int64_t* lengths,
                  const bool* tree_mask, const Shape& s, uint16_t* out) {
  constexpr int64_t HD = kTileDim;
  const int64_t group = s.heads / s.kv_heads, rows = s.num_new * group, tiles = (rows + 15) / 16;
  const int64_t items = s.batch * s.kv_heads;
  const int threads = at::get_num_threads();
  int64_t longest = 0;
  for (int64_t b = 0; b < s.batch; ++b) longest = std::max(longest, lengths[b] + s.num_new);
  // At least two units a thread: one row's three KV heads on two threads are split in six.
  const int64_t wanted = items >= 2 * threads ? 1 : (2 * threads + items - 1) / items;
  const int64_t segment = std::max<int64_t>(1, (longest + wanted * 32 - 1) / (wanted * 32)) * 32;
  const int64_t segments = (longest + segment - 1) / segment;
  AlignedBuffer<PartialRow> parts(segments > 1 ? items * segments * rows : 0);  // each unit writes its rows
  // seen[(b * tiles + rt) * T + s]: the rows of row tile rt (of any KV group) that see new slot s.
  AlignedBuffer<__mmask16> seen(s.batch * tiles * s.num_new);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t rt = 0; rt < tiles; ++rt) {
      for (int64_t slot = 0; slot < s.num_new; ++slot) {
        unsigned bits = 0;
        for (int r = 0; r < 16 && rt * 16 + r < rows; ++r) {
          bits |= unsigned(tree_mask[(b * s.num_new + (rt * 16 + r) / group) * s.num_new + slot]) << r;
        }
        seen.data()[(b * tiles + rt) * s.num_new + slot] = __mmask16(bits);
      }
    }
  }
#pragma omp parallel num_threads(threads)
  {
    treeserve_amx::configure_tiles(8);
    TileScratch scratch(tiles * 16);
    const int64_t stride = omp_get_num_threads();
#pragma omp for schedule(static, 1)
    for (int64_t unit = 0; unit < items * segments; ++unit) {
      const int64_t item = unit / segments, k = unit % segments;
      const int64_t b = item / s.kv_heads, g = item % s.kv_heads;
      const int64_t j_begin = k * segment, j_end = std::min(lengths[b] + s.num_new, j_begin + segment);
      PartialRow* partial = segments > 1 ? parts.data() + unit * rows : nullptr;
      if (unit + stride < items * segments) {  // this thread's next unit's keys and values into L2 meanwhile
        const int64_t next = unit + stride, nitem = next / segments, nb = nitem / s.kv_heads;
        const int64_t nbegin = next % segments * segment, nend = std::min(lengths[nb] + s.num_new, nbegin + segment);
        const int64_t offset = ((nb * s.kv_heads + nitem % s.kv_heads) * s.capacity + nbegin) * HD;
        for (int64_t line = 0; line < std::max<int64_t>(0, nend - nbegin) * HD * 2; line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(keys + offset) + line, _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(values + offset) + line, _MM_HINT_T1);
        }
      }
      if (j_begin >= j_end) {  // a row shorter than the longest: an empty segment
        for (int64_t r = 0; r < rows; ++r) {
          partial[r].max = -std::numeric_limits<float>::infinity();
          partial[r].sum = 0.0f;
        }
        continue;
      }
      attend_unit_tiles(q, keys, values, lengths[b], s, b, g, j_begin, j_end, seen.data() + b * tiles * s.num_new, out,
                        partial, scratch);
    }
    _tile_release();
    if (segments > 1) {  // each new token's rows (its heads of group g) merged by one thread
#pragma omp for schedule(static)
      for (int64_t task = 0; task < items * s.num_new; ++task) {
        const int64_t item = task / s.num_new, t = task % s.num_new;
        const int64_t b = item / s.kv_heads, g = item % s.kv_heads;
        merge_partials<uint16_t, HD / 16>(parts.data() + item * segments * rows + t * group, segments, group, s, b, g,
                                          t, out, rows);
      }
    }
  }
}
#endif  // AMX tiles

template <typename T>
void dispatch(const T* q, const T* keys, const T* values, const int64_t* lengths, const bool* tree_mask, const Shape& s,
              T* out) {
  switch ((s.head_dim + 15) / 16) {
    case 1: return attend<T, 1>(q, keys, values, lengths, tree_mask, s, out);
    case 2: return attend<T, 2>(q, keys, values, lengths, tree_mask, s, out);
    case 3: return attend<T, 3>(q, keys, values, lengths, tree_mask, s, out);
    case 4: return attend<T, 4>(q, keys, values, lengths, tree_mask, s, out);
    case 5: return attend<T, 5>(q, keys, values, lengths, tree_mask, s, out);
    case 6: return attend<T, 6>(q, keys, values, lengths, tree_mask, s, out);
    case 7: return attend<T, 7>(q, keys, values, lengths, tree_mask, s, out);
    case 8: return attend<T, 8>(q, keys, values, lengths, tree_mask, s, out);
    default: TORCH_CHECK(false, "treeserve_attn::tree_decode: head_dim must be at most 128");
  }
}

at::Tensor tree_decode(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values,
                       const at::Tensor& lengths_in, const at::Tensor& tree_mask_in) {
  TORCH_CHECK(q_in.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "treeserve_attn::tree_decode: q must be (B, T, H, hd) and keys/values (B, n_kv, C, hd)");
  TORCH_CHECK(q_in.scalar_type() == keys.scalar_type() && values.scalar_type() == keys.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16),
              "treeserve_attn::tree_decode: q, keys and values must all be float32 or all bfloat16");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "treeserve_attn::tree_decode: the cache must be contiguous");
  const Shape s{q_in.size(0), q_in.size(1), q_in.size(2), keys.size(1), keys.size(2), q_in.size(3)};
  TORCH_CHECK(keys.size(0) == s.batch && keys.size(3) == s.head_dim && s.heads % s.kv_heads == 0,
              "treeserve_attn::tree_decode: q and the cache disagree on batch, head_dim or heads");
  TORCH_CHECK(s.num_new >= 1 && s.head_dim <= 128 && s.heads / s.kv_heads <= kMaxRows,
              "treeserve_attn::tree_decode: needs T >= 1, head_dim <= 128 and at most 16 query heads per KV head");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor lengths = lengths_in.to(at::kLong).contiguous();
  const at::Tensor tree_mask = tree_mask_in.to(at::kBool).contiguous();
  TORCH_CHECK(lengths.numel() == s.batch && tree_mask.numel() == s.batch * s.num_new * s.num_new,
              "treeserve_attn::tree_decode: lengths must be (B,) and tree_mask (B, T, T)");
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < s.batch; ++b) {
    TORCH_CHECK(len[b] >= 0 && len[b] + s.num_new <= s.capacity, "treeserve_attn::tree_decode: row ", b, " holds ",
                len[b], " tokens, and ", s.num_new, " more do not fit its ", s.capacity, " slots");
  }
  at::Tensor out = at::empty({s.batch, s.num_new, s.heads * s.head_dim}, q.options());
  const bool* mask = tree_mask.data_ptr<bool>();
  if (keys.scalar_type() == at::kFloat) {
    dispatch<float>(q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), len, mask, s,
                    out.data_ptr<float>());
  } else {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (use_tiles(s)) {
      attend_tiles(reinterpret_cast<const uint16_t*>(q.data_ptr()), reinterpret_cast<const uint16_t*>(keys.data_ptr()),
                   reinterpret_cast<const uint16_t*>(values.data_ptr()), len, mask, s,
                   reinterpret_cast<uint16_t*>(out.data_ptr()));
      return out;
    }
#endif
    dispatch<uint16_t>(reinterpret_cast<const uint16_t*>(q.data_ptr()), reinterpret_cast<const uint16_t*>(keys.data_ptr()),
                       reinterpret_cast<const uint16_t*>(values.data_ptr()), len, mask, s,
                       reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
  return out;
}

// keys[b, :, lengths[b] + t] = new_keys[b, t] (and values alike), in place: in a compiled graph
// an indexed store into the cache is functionalized into a copy of the whole cache per step
// (measured: a 64-row step took 90 ms on a 260-slot cache and 311 ms on a 1256-slot one).
void write_kv(at::Tensor& keys, at::Tensor& values, const at::Tensor& new_keys_in, const at::Tensor& new_values_in,
              const at::Tensor& lengths_in) {
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.is_contiguous() && values.is_contiguous(),
              "treeserve_attn::write_kv: keys/values must be contiguous (B, n_kv, C, hd)");
  TORCH_CHECK(new_keys_in.dim() == 4 && new_values_in.sizes() == new_keys_in.sizes() &&
                  new_keys_in.scalar_type() == keys.scalar_type() && new_values_in.scalar_type() == keys.scalar_type(),
              "treeserve_attn::write_kv: new keys/values must be (B, T, n_kv, hd) in the cache's dtype");
  const int64_t batch = keys.size(0), kv_heads = keys.size(1), capacity = keys.size(2), head_dim = keys.size(3);
  const int64_t num_new = new_keys_in.size(1);
  TORCH_CHECK(new_keys_in.size(0) == batch && new_keys_in.size(2) == kv_heads && new_keys_in.size(3) == head_dim,
              "treeserve_attn::write_kv: new keys/values do not match the cache's shape");
  // Strided new keys and values are read in place (the step's values are a slice of the fused
  // QKV output, and a copy of them cost a clone per layer); only the head dim must be dense.
  const at::Tensor new_keys = new_keys_in.stride(3) == 1 ? new_keys_in : new_keys_in.contiguous();
  const at::Tensor new_values = new_values_in.stride(3) == 1 ? new_values_in : new_values_in.contiguous();
  const at::Tensor lengths = lengths_in.to(at::kLong).contiguous();
  TORCH_CHECK(lengths.numel() == batch, "treeserve_attn::write_kv: lengths must be (B,)");
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t elem = keys.element_size(), row_bytes = head_dim * elem;
  auto* kc = static_cast<char*>(keys.data_ptr());
  auto* vc = static_cast<char*>(values.data_ptr());
  const auto* kn = static_cast<const char*>(new_keys.data_ptr());
  const auto* vn = static_cast<const char*>(new_values.data_ptr());
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len[b] >= 0 && len[b] + num_new <= capacity, "treeserve_attn::write_kv: row ", b, " holds ", len[b],
                " tokens, and ", num_new, " more do not fit its ", capacity, " slots");
    for (int64_t t = 0; t < num_new; ++t) {
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t to = ((b * kv_heads + g) * capacity + len[b] + t) * row_bytes;
        const int64_t key_from = (b * new_keys.stride(0) + t * new_keys.stride(1) + g * new_keys.stride(2)) * elem;
        const int64_t value_from = (b * new_values.stride(0) + t * new_values.stride(1) + g * new_values.stride(2)) * elem;
        std::memcpy(kc + to, kn + key_from, row_bytes);
        std::memcpy(vc + to, vn + value_from, row_bytes);
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY(treeserve_attn, m) {
  m.def("tree_decode(Tensor q, Tensor keys, Tensor values, Tensor lengths, Tensor tree_mask) -> Tensor");
  m.def("write_kv(Tensor(a!) keys, Tensor(b!) values, Tensor new_keys, Tensor new_values, Tensor lengths) -> ()");
}

TORCH_LIBRARY_IMPL(treeserve_attn, CPU, m) {
  m.impl("tree_decode", tree_decode);
  m.impl("write_kv", write_kv);
}

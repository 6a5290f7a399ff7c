// Attention of a verify step's new tokens (a decode token, a chain or a token tree) over a KV
// cache, for CPUs with AVX-512: the CPU twin of the CUDA tree-mask kernel.
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
// Threads: OpenMP (torch's libgomp), torch's thread count, items handed out dynamically.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
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

// 16 lanes of a head vector; the last vector of a head dimension that is not a multiple of 16
// is loaded and stored under a lane mask.
inline __m512 load(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 load(const uint16_t* p, __mmask16 lanes) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));  // bf16 -> f32 is exact
}
inline void store(float* p, __m512 v, __mmask16 lanes) { _mm512_mask_storeu_ps(p, lanes, v); }
inline void store(uint16_t* p, __m512 v, __mmask16 lanes) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);  // NaN stays a (quiet) NaN
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
  _mm256_mask_storeu_epi16(p, lanes, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// exp(x) for x <= 0 (scores minus their running maximum): x = n ln2 + r, |r| <= ln2 / 2, a
// degree-7 Taylor polynomial for exp(r) (relative error below 1e-8), then scaled by 2^n.
// Inputs below -87 give about 1e-38 instead of a smaller number or 0; masked scores never get
// here (their weights are set to exactly 0).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2, split in two
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

struct Shape {
  int64_t batch, num_new, heads, kv_heads, capacity, head_dim;
};

// In-register transpose of a 16 x 16 float32 tile: rows r[i] become columns.
inline void transpose16(__m512 r[16]) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a0 = _mm512_castps_pd(a[4 * i]), a1 = _mm512_castps_pd(a[4 * i + 1]);
    const __m512d a2 = _mm512_castps_pd(a[4 * i + 2]), a3 = _mm512_castps_pd(a[4 * i + 3]);
    b[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
    b[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
    b[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
    b[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
  }
  for (int k = 0; k < 4; ++k) {  // b[4 i + k]: column 4 L + k of rows 4 i .. 4 i + 3, in 128-bit lane L
    const __m512 x_lo = _mm512_shuffle_f32x4(b[k], b[4 + k], 0x44), x_hi = _mm512_shuffle_f32x4(b[k], b[4 + k], 0xEE);
    const __m512 y_lo = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0x44), y_hi = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0xEE);
    r[k] = _mm512_shuffle_f32x4(x_lo, y_lo, 0x88);
    r[4 + k] = _mm512_shuffle_f32x4(x_lo, y_lo, 0xDD);
    r[8 + k] = _mm512_shuffle_f32x4(x_hi, y_hi, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(x_hi, y_hi, 0xDD);
  }
}

// Scores of RB query rows against KC * 16 keys held transposed (kt[d * stride + j]):
// score[r][j] = q[r] . k[j], 16 keys a vector, every FMA broadcasting one query element (no
// horizontal sums); RB * KC independent sums keep the FMA units busy.
template <int RB, int KC, int NV>
inline void block_scores(const float (*q)[NV * 16], const float* kt, int64_t stride, int64_t head_dim,
                         float (*score)[256]) {
  __m512 acc[RB][KC];
  for (int i = 0; i < RB; ++i) {
    for (int c = 0; c < KC; ++c) acc[i][c] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < head_dim; ++d) {
    __m512 k[KC];
    for (int c = 0; c < KC; ++c) k[c] = _mm512_load_ps(kt + d * stride + c * 16);
    for (int i = 0; i < RB; ++i) {
      const __m512 x = _mm512_set1_ps(q[i][d]);
      for (int c = 0; c < KC; ++c) acc[i][c] = _mm512_fmadd_ps(x, k[c], acc[i][c]);
    }
  }
  for (int i = 0; i < RB; ++i) {
    for (int c = 0; c < KC; ++c) _mm512_store_ps(score[i] + c * 16, acc[i][c]);
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
  __m512 a[RB][NV];
  for (int i = 0; i < RB; ++i) {
    for (int c = 0; c < NV; ++c) a[i][c] = _mm512_mul_ps(_mm512_load_ps(acc[i] + c * 16), _mm512_set1_ps(shrink[i]));
  }
  for (int64_t j = 0; j < count; ++j) {
    for (int c = 0; c < NV; ++c) {
      const __m512 x = _mm512_load_ps(v + j * NV * 16 + c * 16);
      for (int i = 0; i < RB; ++i) a[i][c] = _mm512_fmadd_ps(_mm512_set1_ps(weight[i][j]), x, a[i][c]);
    }
  }
  for (int i = 0; i < RB; ++i) {
    for (int c = 0; c < NV; ++c) _mm512_store_ps(acc[i] + c * 16, a[i][c]);
  }
}

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
                 T* out, PartialRow* partial, float* kt, float* vbuf) {
  constexpr int64_t block = kBlockKeys(NV), width = NV * 16;
  const int64_t hd = s.head_dim, group = s.heads / s.kv_heads, rows = tc * group;
  const __mmask16 tail = hd % 16 == 0 ? __mmask16(0xffff) : __mmask16((1u << (hd % 16)) - 1);
  auto lanes = [&](int c) { return c == NV - 1 ? tail : __mmask16(0xffff); };
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
      _mm512_store_ps(qs[r] + c * 16, _mm512_mul_ps(load(qr + c * 16, lanes(c)), _mm512_set1_ps(scale)));
      _mm512_store_ps(acc[r] + c * 16, _mm512_setzero_ps());
    }
    run_max[r] = minus_inf;
    run_sum[r] = 0.0f;
  }
  for (int64_t j0 = j_begin; j0 < j_end; j0 += block) {
    const int64_t n = std::min(block, j_end - j0), padded = (n + 15) / 16 * 16;
    // The block's keys widened to float32 and transposed (kt[d * block + j]), its values widened
    // (vbuf[j * width + d]): once for all of the item's rows.
    for (int64_t j = 0; j < padded; j += 16) {
      for (int c = 0; c < NV; ++c) {
        __m512 tile[16];
        for (int i = 0; i < 16; ++i) {
          tile[i] = j + i < n ? load(kbase + (j0 + j + i) * hd + c * 16, lanes(c)) : _mm512_setzero_ps();
        }
        transpose16(tile);
        for (int i = 0; i < 16; ++i) _mm512_store_ps(kt + (c * 16 + i) * block + j, tile[i]);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      for (int c = 0; c < NV; ++c) _mm512_store_ps(vbuf + j * width + c * 16, load(vbase + (j0 + j) * hd + c * 16, lanes(c)));
    }
    row_blocks(rows, [&](auto rb, int64_t r) { block_scores<rb.value, NV>(qs + r, kt, block, padded, hd, score + r); });
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = score[r];
      if (j0 + n > committed) {  // new slots are visible only along the tree
        const bool* visible = tree_mask + (b * s.num_new + t0 + r / group) * s.num_new;
        for (int64_t j = std::max<int64_t>(0, committed - j0); j < n; ++j) {
          if (!visible[j0 + j - committed]) sr[j] = minus_inf;
        }
      }
      __m512 top = _mm512_set1_ps(minus_inf);
      __mmask16 unordered = 0;
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 in = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
        const __m512 x = _mm512_loadu_ps(sr + j);
        top = _mm512_mask_max_ps(top, in, top, x);
        unordered |= _mm512_mask_cmp_ps_mask(in, x, x, _CMP_UNORD_Q);
      }
      const float block_max = _mm512_reduce_max_ps(top);
      const float new_max = std::max(run_max[r], block_max);
      if (unordered || new_max == minus_inf) {  // a NaN score spoils the row; nothing visible yet: no change
        if (unordered) run_sum[r] = std::numeric_limits<float>::quiet_NaN();
        std::fill(sr, sr + n, 0.0f);
        shrink[r] = 1.0f;
        continue;
      }
      shrink[r] = std::exp(run_max[r] - new_max);  // 0 on the first visible block
      const __m512 top_all = _mm512_set1_ps(new_max), inf = _mm512_set1_ps(minus_inf);
      __m512 weight_sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 in = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(in, sr + j);
        const __mmask16 seen = _mm512_mask_cmp_ps_mask(in, x, inf, _CMP_NEQ_OQ);
        const __m512 w = _mm512_maskz_mov_ps(seen, exp_nonpositive(_mm512_sub_ps(x, top_all)));
        weight_sum = _mm512_add_ps(weight_sum, w);
        _mm512_mask_storeu_ps(sr + j, in, w);
      }
      run_sum[r] = run_sum[r] * shrink[r] + _mm512_reduce_add_ps(weight_sum);
      run_max[r] = new_max;
    }
    if constexpr (NV <= 4) {
      row_blocks(rows, [&](auto rb, int64_t r) { block_values<rb.value, NV>(vbuf, n, score + r, shrink + r, acc + r); });
    } else {
      for (int64_t r = 0; r < rows; ++r) block_values<1, NV>(vbuf, n, score + r, shrink + r, acc + r);
    }
  }
  if (partial != nullptr) {
    for (int64_t r = 0; r < rows; ++r) {
      partial[r].max = run_max[r];
      partial[r].sum = run_sum[r];
      for (int c = 0; c < NV; ++c) _mm512_store_ps(partial[r].acc + c * 16, _mm512_load_ps(acc[r] + c * 16));
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / group, h = g * group + r % group;
    T* o = out + ((b * s.num_new + t) * s.heads + h) * hd;
    const __m512 inv = _mm512_set1_ps(run_sum[r] == 0.0f ? 0.0f : 1.0f / run_sum[r]);  // nothing seen: 0; NaN stays
    for (int c = 0; c < NV; ++c) store(o + c * 16, _mm512_mul_ps(_mm512_load_ps(acc[r] + c * 16), inv), lanes(c));
  }
}

// The output of an item's rows from its segments' partial results: the online softmax's merge.
template <typename T, int NV>
void merge_partials(const PartialRow* parts, int64_t segments, int64_t rows, const Shape& s, int64_t b, int64_t g,
                    int64_t t0, T* out) {
  const int64_t hd = s.head_dim, group = s.heads / s.kv_heads;
  const __mmask16 tail = hd % 16 == 0 ? __mmask16(0xffff) : __mmask16((1u << (hd % 16)) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < segments; ++k) top = std::max(top, parts[k * kMaxRows + r].max);
    float sum = 0.0f;
    __m512 acc[NV];
    for (int c = 0; c < NV; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < segments; ++k) {
      const PartialRow& p = parts[k * kMaxRows + r];
      if (p.max == -std::numeric_limits<float>::infinity() && !std::isnan(p.sum)) continue;  // saw nothing
      const float w = std::exp(p.max - top);
      sum += p.sum * w;
      for (int c = 0; c < NV; ++c) acc[c] = _mm512_fmadd_ps(_mm512_load_ps(p.acc + c * 16), _mm512_set1_ps(w), acc[c]);
    }
    const int64_t t = t0 + r / group, h = g * group + r % group;
    T* o = out + ((b * s.num_new + t) * s.heads + h) * hd;
    const __m512 inv = _mm512_set1_ps(sum == 0.0f ? 0.0f : 1.0f / sum);  // nothing seen: 0; NaN stays
    for (int c = 0; c < NV; ++c) store(o + c * 16, _mm512_mul_ps(acc[c], inv), c == NV - 1 ? tail : __mmask16(0xffff));
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
    alignas(64) float kt[kBlockKeys(NV) * NV * 16], vbuf[kBlockKeys(NV) * NV * 16];
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < items * segments; ++unit) {
      const int64_t item = unit / segments, k = unit % segments;
      const int64_t b = item / (s.kv_heads * chunks), g = item / chunks % s.kv_heads, c = item % chunks;
      const int64_t t0 = c * tc, count = std::min(tc, s.num_new - t0), total = lengths[b] + s.num_new;
      const int64_t j_begin = k * segment, j_end = std::min(total, j_begin + segment);
      if (count <= 0) continue;
      PartialRow* partial = segments > 1 ? parts.data() + (item * segments + k) * kMaxRows : nullptr;
      if (j_begin >= j_end) {  // this row is shorter than the longest: an empty segment
        for (int64_t r = 0; r < count * group; ++r) {
          partial[r].max = -std::numeric_limits<float>::infinity();
          partial[r].sum = 0.0f;
        }
        continue;
      }
      attend_item<T, NV>(q, keys, values, tree_mask, lengths[b], s, b, g, t0, count, j_begin, j_end, out, partial, kt, vbuf);
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
  const at::Tensor new_keys = new_keys_in.contiguous(), new_values = new_values_in.contiguous();
  const at::Tensor lengths = lengths_in.to(at::kLong).contiguous();
  TORCH_CHECK(lengths.numel() == batch, "treeserve_attn::write_kv: lengths must be (B,)");
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t row_bytes = head_dim * keys.element_size();
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
        const int64_t from = ((b * num_new + t) * kv_heads + g) * row_bytes;
        std::memcpy(kc + to, kn + from, row_bytes);
        std::memcpy(vc + to, vn + from, row_bytes);
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

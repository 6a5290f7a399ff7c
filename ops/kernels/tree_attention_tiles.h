// tree_attention_cpu.cpp's AMX tile path: bfloat16 trees of more query rows per KV group than
// one vector item takes (attend_tiles). Compiled only in the build with AMX-BF16.

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <cstdlib>

#include "amx_tiles.h"
#include "tree_attention_common.h"

namespace {

// Many new tokens on AMX tiles (bfloat16, head size 64): a tree or chain whose queries of one
// KV group are more than one item's kMaxRows rows (the verifier's 16- and 64-node trees).
//
// The vector items (attend) give each chunk of a few new tokens its own item, which reads,
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

}  // namespace

#endif  // AMX tiles

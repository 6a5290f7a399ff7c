// Every transformer block in one call, for the int formats of GGUF blocks (q4_1, gguf) on CPUs
// with AVX2: a decode step, a
// token tree, a batch of rows or a prefill of any length, each row computed the same way
// whatever else shares the call. Built for AVX-512 where the CPU has it, else for AVX2; the two
// builds compute the same bits (the attention's 16 lanes are one zmm register or two ymm
// halves, folded and summed alike).
// treeserve_layers::run(h, positions, tree_mask, lengths, keys, values, rope_cos, rope_sin,
//                       rope_cos_local, rope_sin_local, weights, windows, num_heads,
//                       num_kv_heads, ffn, eps, kernel, activation, attn_scale) -> hidden
//
// Why one op: at one row the compiled step's own work is about 4.5 ms, but the step took about
// 6.5. Its Python wrapper makes ~330 calls (a fused elementwise kernel or an extern op each,
// with their buffers) and its prologue reads ~130 tensor sizes; 1.5-2 ms a step on this
// project's 2-core AVX2 host (bench/RESULTS.md). Here one op runs every block: the matrix
// products are the formats' own ops, called through the dispatcher without Python (4-bit codes,
// kernel 0: treeserve_avx2::q4_mm, 1: treeserve_q4::mm on int8 rows, AVX512-VNNI; 8-bit codes,
// treeserve_avx2::q8g_mm or treeserve_q4::q8g_mm, each linear on its own kind), the new
// tokens' K/V are stored by treeserve_attn::write_kv, and the attention and the small
// elementwise work between them are written out below.
//
// One answer per row. Nothing a row gets depends on the other rows, the number of new tokens,
// the tree, or the threads: the products quantize each row to int8 per group on its own and
// sum exact int32 dots, scaled in a fixed order; the norms, RoPE, SiLU and adds go row by row,
// element by element in a fixed order; and the attention (attend, below) sums over each token's
// visible keys in an order fixed by their place in that token's own sequence. So a prefill's
// K/V equal the steps' K/V bit for bit, and a token's hidden state is the same in a step, a
// chain, a tree, a batch or a prefill.
//
// What it computes is decode_step.blocks_hidden's, in bf16 activations with float32 inside each
// elementwise stage, rounded to bf16 once per stage:
//   x = rms_norm(h) * w_in; q|k|v = q4_mm(x); q, k = rope(q), rope(k) (cos/sin rounded to bf16
//   first, as the step does); write k, v; a = attend(q); h = bf16(h + q4_mm(a));
//   x = rms_norm(h) * w_post; g|u = q4_mm(x); h = bf16(h + q4_mm(silu(g) * u))
// and the final norm. Gemma 3's parts, where a layer has them: a sliding window (windows[layer]
// > 0 keys, rotated by the local rope tables when they are given), scores times attn_scale
// (0: 1/sqrt(hd)), rms norms on the attention's and the MLP's outputs before each add (their
// weights, 17 and 18 of a layer, or empty), and tanh GELU for SiLU (activation 1). The weights are the model's own buffers (the same values as every other
// path); h is (B, T, D) bf16, positions (B, T) long, tree_mask (B, T, T) bool (or empty: a
// causal chain, as a prefill is), lengths (B,) long (committed lengths: K/V go to slots
// lengths[b] + t), keys/values the cache's per-layer contiguous (B, n_kv, C, hd) bf16 storage,
// rope_cos/rope_sin (P, hd) float32, and weights 19 a layer (w_in, qkv's three, qkv's bias (bf16,
// or empty: Qwen2's q/k/v biases, added as the eager step adds them, bf16(y + b)), the q and k
// head norms' weights (or empty: Qwen3's, each head normed before RoPE), o's three, w_post,
// gate_up's three, down's three, the attention's and the MLP's output norms (or empty); the
// norms' weights float32) and the final norm's last.
// A linear's three are (codes, scales_zeros bf16, empty) on the 4-bit kernel's packing or
// (codes, scales float32, zeros) on the 8-bit codes' (kernels/codes8.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "simd16.h"  // its AVX2 backend: this file is built without AVX-512

namespace {

using bf16 = c10::BFloat16;
using simd16::bf16_round8;
using simd16::bf16x8;
using simd16::reduce_add8;

constexpr int64_t kWeightsPerLayer = 19;
constexpr int64_t kGrain = 4;  // rows a thread takes in the elementwise stages

inline const uint16_t* bits(const bf16* p) { return reinterpret_cast<const uint16_t*>(p); }
inline uint16_t* bits(bf16* p) { return reinterpret_cast<uint16_t*>(p); }
inline void store8(bf16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_round8(v)); }

// y = bf16(x * rsqrt(mean(x^2) + eps) * w) for one row of D (a multiple of 8); y may be x.
inline void rms_norm_row(const bf16* x, const float* w, int64_t D, double eps, bf16* y) {
  const uint16_t* xr = bits(x);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 v = bf16x8(xr + i);
    sum = _mm256_fmadd_ps(v, v, sum);
  }
  const float scale = 1.0f / std::sqrt(reduce_add8(sum) / static_cast<float>(D) + static_cast<float>(eps));
  for (int64_t i = 0; i < D; i += 8)
    store8(y + i, _mm256_mul_ps(_mm256_mul_ps(bf16x8(xr + i), _mm256_set1_ps(scale)), _mm256_loadu_ps(w + i)));
}

// rms_norm_row of every row of D.
void rms_norm(const bf16* x, const float* w, int64_t rows, int64_t D, double eps, bf16* y) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x + r * D, w, D, eps, y + r * D);
  });
}

// Qwen3's per-head norms, in place in each qkv row: rms_norm_row over each of the q heads (wq)
// and of the k heads (wk), each head of hd on its own.
void head_norms(bf16* qkv, int64_t width, int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd,
                const float* wq, const float* wk, double eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      bf16* row = qkv + r * width;
      for (int64_t h = 0; h < heads; ++h) rms_norm_row(row + h * hd, wq, hd, eps, row + h * hd);
      for (int64_t h = 0; h < kv_heads; ++h) rms_norm_row(row + (heads + h) * hd, wk, hd, eps, row + (heads + h) * hd);
    }
  });
}

// Rotate-half RoPE of `heads` heads of hd starting at column `first` of a qkv row, into out
// (rows, heads, hd): x * cos + rotate_half(x) * sin, cos/sin rounded to bf16 as the step does.
void rope(const bf16* qkv, int64_t width, int64_t first, int64_t heads, int64_t hd, const int64_t* positions,
          const float* cos_table, const float* sin_table, int64_t rows, bf16* out) {
  const int64_t half = hd / 2;
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> c(hd), s(hd);
    for (int64_t r = begin; r < end; ++r) {
      const float* cr = cos_table + positions[r] * hd;
      const float* sr = sin_table + positions[r] * hd;
      for (int64_t i = 0; i < hd; ++i) {
        c[i] = static_cast<float>(bf16(cr[i]));
        s[i] = static_cast<float>(bf16(sr[i]));
      }
      for (int64_t h = 0; h < heads; ++h) {
        const bf16* x = qkv + r * width + first + h * hd;
        bf16* y = out + (r * heads + h) * hd;
        for (int64_t i = 0; i < half; ++i) {
          const float lo = static_cast<float>(x[i]), hi = static_cast<float>(x[i + half]);
          y[i] = bf16(lo * c[i] - hi * s[i]);
          y[i + half] = bf16(hi * c[i + half] + lo * s[i + half]);
        }
      }
    }
  });
}

// h = bf16(h + delta), in place (n a multiple of 8).
void add_into(bf16* h, const bf16* delta, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store8(h + i, _mm256_add_ps(bf16x8(bits(h + i)), bf16x8(bits(delta + i))));
}

// out[r] = bf16(act(g) * u) for a row g | u of 2F (F a multiple of 16), with simd16's exp
// (clamped: a very negative argument gives g / 3.3e38, about 0): SiLU, g / (1 + exp(-g)), or
// (gelu) tanh GELU, 0.5 g (1 + tanh(c (g + 0.044715 g^3))) = g / (1 + exp(-2c (g + 0.044715 g^3))).
void act_mul(const bf16* gate_up, int64_t rows, int64_t F, bool gelu, bf16* out) {
  using simd16::V16;
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    const V16 one = simd16::vset1(1.0f);
    const V16 cubic = simd16::vset1(0.044715f), two_c = simd16::vset1(-1.5957691216057308f);  // -2 sqrt(2 / pi)
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* g = bits(gate_up + r * 2 * F);
      for (int64_t i = 0; i < F; i += 16) {
        const V16 gv = simd16::vload_bf16(g + i, 0xffff);
        const V16 arg = gelu ? simd16::vmul(two_c, simd16::vfmadd(simd16::vmul(cubic, gv), simd16::vmul(gv, gv), gv))
                             : simd16::vsub(simd16::vzero(), gv);
        const V16 silu = simd16::vdiv(gv, simd16::vadd(one, simd16::vexp(arg)));
        simd16::vstore_bf16(bits(out + r * F + i), simd16::vmul(silu, simd16::vload_bf16(g + F + i, 0xffff)), 0xffff);
      }
    }
  });
}

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

// out (B, T, H * hd) bf16: every new token's attention (see above). q (B, T, H, hd) bf16;
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

using MatmulFn = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>;
using VnniFn = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                                   int64_t, bool)>;

// The q4_1 product of the kernel this CPU runs: 0, q_avx2.cpp's q4_mm; 1, q4_amx.cpp's mm on int8
// rows (AVX512-VNNI). Both quantize each row on its own and sum exact int32 dots per group.
at::Tensor q4_mm(int64_t kernel, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_zeros,
                 int64_t out_features) {
  if (kernel == 0) {
    static MatmulFn op = c10::Dispatcher::singleton().findSchemaOrThrow("treeserve_avx2::q4_mm", "").typed<
        at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
    return op.call(x, codes, scales_zeros, out_features);
  }
  static VnniFn op = c10::Dispatcher::singleton().findSchemaOrThrow("treeserve_q4::mm", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool)>();
  return op.call(x, codes, scales_zeros, out_features, 2, true);
}

using Codes8Fn = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, int64_t, bool)>;

// One linear of a layer, w its three weights: the 4-bit kernel's packing (scales_zeros bf16) or
// the 8-bit codes' (scales float32), on this CPU's kernel of that kind.
at::Tensor linear(int64_t kernel, const at::Tensor& x, const at::Tensor* w, int64_t out_features) {
  if (w[1].scalar_type() == at::kBFloat16) return q4_mm(kernel, x, w[0], w[1], out_features);
  TORCH_CHECK(w[1].scalar_type() == at::kFloat &&
                  (w[0].numel() == out_features * x.size(1) || w[0].numel() * 8 == out_features * x.size(1) * 5),
              "treeserve_layers::run: a linear's weights must be the 4-bit or the 8-bit codes' packing");
  static Codes8Fn avx2 = c10::Dispatcher::singleton().findSchemaOrThrow("treeserve_avx2::q8g_mm", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool)>();
  if (kernel == 0) return avx2.call(x, w[0], w[1], w[2], out_features, false);
  static Codes8Fn vnni = c10::Dispatcher::singleton().findSchemaOrThrow("treeserve_q4::q8g_mm", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool)>();
  return vnni.call(x, w[0], w[1], w[2], out_features, false);
}

at::Tensor run(const at::Tensor& h_in, const at::Tensor& positions_in, const at::Tensor& tree_mask_in,
               const at::Tensor& lengths_in, at::TensorList keys, at::TensorList values, const at::Tensor& rope_cos,
               const at::Tensor& rope_sin, const at::Tensor& rope_cos_local, const at::Tensor& rope_sin_local,
               at::TensorList weights, at::IntArrayRef windows, int64_t num_heads, int64_t num_kv_heads, int64_t ffn,
               double eps, int64_t kernel, int64_t activation, double attn_scale) {
  static auto write_kv = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("treeserve_attn::write_kv", "")
                             .typed<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&)>();
  const int64_t num_layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(h_in.dim() == 3 && h_in.scalar_type() == at::kBFloat16, "treeserve_layers::run: h must be (B, T, D) bf16");
  TORCH_CHECK(kernel == 0 || kernel == 1, "treeserve_layers::run: kernel must be 0 (AVX2) or 1 (AVX512-VNNI)");
  TORCH_CHECK(activation == 0 || activation == 1, "treeserve_layers::run: activation must be 0 (SiLU) or 1 (tanh GELU)");
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == static_cast<int64_t>(keys.size()),
              "treeserve_layers::run: one window a layer (0: none)");
  TORCH_CHECK(values.size() == keys.size() && static_cast<int64_t>(weights.size()) == kWeightsPerLayer * num_layers + 1,
              "treeserve_layers::run: ", kWeightsPerLayer, " weights a layer and the final norm's, per cache layer");
  const int64_t B = h_in.size(0), T = h_in.size(1), D = h_in.size(2), rows = B * T;
  TORCH_CHECK(D % 32 == 0, "treeserve_layers::run: the model's width must be a multiple of 32");
  TORCH_CHECK(ffn > 0 && ffn % 16 == 0, "treeserve_layers::run: the MLP's width must be a positive multiple of 16");
  TORCH_CHECK(num_layers > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= kMaxGroup,
              "treeserve_layers::run: at most ", kMaxGroup, " query heads per KV head");
  const int64_t hd = keys[0].size(3), capacity = keys[0].size(2);
  TORCH_CHECK(hd % 16 == 0 && hd <= kMaxHeadDim, "treeserve_layers::run: the head size must be a multiple of 16, at most ",
              kMaxHeadDim);
  const int64_t q_size = num_heads * hd, kv_size = num_kv_heads * hd, width = q_size + 2 * kv_size;
  TORCH_CHECK(positions_in.numel() == rows && rope_cos.scalar_type() == at::kFloat && rope_sin.scalar_type() == at::kFloat &&
                  rope_cos.is_contiguous() && rope_sin.is_contiguous() && rope_cos.size(1) == hd && hd % 2 == 0,
              "treeserve_layers::run: positions must be (B, T) and the rope tables (P, hd) float32");
  const bool causal = tree_mask_in.numel() == 0;
  TORCH_CHECK(causal || (tree_mask_in.scalar_type() == at::kBool && tree_mask_in.numel() == B * T * T),
              "treeserve_layers::run: tree_mask must be (B, T, T) bool, or empty for a causal chain");
  const at::Tensor tree_mask = causal ? tree_mask_in : tree_mask_in.contiguous();
  const at::Tensor lengths = lengths_in.to(at::kLong).contiguous();
  const int64_t* len = lengths.data_ptr<int64_t>();
  TORCH_CHECK(lengths.numel() == B, "treeserve_layers::run: lengths must be (B,)");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(len[b] >= 0 && len[b] + T <= capacity, "treeserve_layers::run: a row's new tokens overflow the cache");
  for (int64_t layer = 0; layer < num_layers; ++layer)
    TORCH_CHECK(keys[layer].scalar_type() == at::kBFloat16 && values[layer].scalar_type() == at::kBFloat16 &&
                    keys[layer].is_contiguous() && values[layer].is_contiguous() && keys[layer].dim() == 4 &&
                    keys[layer].size(0) == B && keys[layer].size(1) == num_kv_heads && keys[layer].size(2) == capacity &&
                    keys[layer].size(3) == hd && values[layer].sizes() == keys[layer].sizes(),
                "treeserve_layers::run: each layer's keys and values must be contiguous (B, n_kv, C, hd) bf16");
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < rope_cos.size(0), "treeserve_layers::run: a position outside the rope tables");
  const bool local_rope = rope_cos_local.numel() != 0;
  TORCH_CHECK(!local_rope || (rope_cos_local.scalar_type() == at::kFloat && rope_sin_local.scalar_type() == at::kFloat &&
                              rope_cos_local.is_contiguous() && rope_sin_local.is_contiguous() &&
                              rope_cos_local.sizes() == rope_cos.sizes() && rope_sin_local.sizes() == rope_cos.sizes()),
              "treeserve_layers::run: the local rope tables must be empty or as the others");
  for (const at::Tensor& w : weights)
    TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "treeserve_layers::run: weights must be contiguous CPU tensors");

  const AttnShape shape{B, T, num_heads, num_kv_heads, capacity, hd};
  const bool* mask = causal ? nullptr : tree_mask.data_ptr<bool>();
  at::Tensor h = h_in.contiguous().clone();
  at::Tensor x = at::empty({rows, D}, h.options());
  at::Tensor q = at::empty({B, T, num_heads, hd}, h.options());
  at::Tensor k = at::empty({B, T, num_kv_heads, hd}, h.options());
  at::Tensor attended = at::empty({rows, q_size}, h.options());
  auto* hp = reinterpret_cast<bf16*>(h.data_ptr());
  auto* xp = reinterpret_cast<bf16*>(x.data_ptr());
  const float scale = attn_scale > 0 ? static_cast<float>(attn_scale) : 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    const bool local = local_rope && windows[layer] > 0;
    const auto* cos_p = (local ? rope_cos_local : rope_cos).data_ptr<float>();
    const auto* sin_p = (local ? rope_sin_local : rope_sin).data_ptr<float>();
    for (int64_t i : {17, 18})
      TORCH_CHECK(w[i].numel() == 0 || (w[i].scalar_type() == at::kFloat && w[i].numel() == D),
                  "treeserve_layers::run: the output norms' weights must be (D,) float32, or empty");
    TORCH_CHECK(w[0].scalar_type() == at::kFloat && w[10].scalar_type() == at::kFloat && w[0].numel() == D &&
                    w[10].numel() == D,
                "treeserve_layers::run: the norms' weights must be (D,) float32");
    const bool head_normed = w[5].numel() != 0;
    TORCH_CHECK(!head_normed || (w[5].scalar_type() == at::kFloat && w[6].scalar_type() == at::kFloat &&
                                 w[5].numel() == hd && w[6].numel() == hd),
                "treeserve_layers::run: the head norms' weights must be (hd,) float32, or empty");
    TORCH_CHECK(w[4].numel() == 0 || (w[4].scalar_type() == at::kBFloat16 && w[4].numel() == width),
                "treeserve_layers::run: the q|k|v bias must be (width,) bfloat16, or empty");
    rms_norm(hp, w[0].data_ptr<float>(), rows, D, eps, xp);
    const at::Tensor qkv = linear(kernel, x, w + 1, width);  // (rows, width)
    if (w[4].numel() != 0) {
      auto* qkv_rows = reinterpret_cast<bf16*>(qkv.data_ptr());
      const auto* bias = reinterpret_cast<const bf16*>(w[4].data_ptr());
      at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) add_into(qkv_rows + r * width, bias, width);
      });
    }
    if (head_normed)
      head_norms(reinterpret_cast<bf16*>(qkv.data_ptr()), width, rows, num_heads, num_kv_heads, hd,
                 w[5].data_ptr<float>(), w[6].data_ptr<float>(), eps);
    const auto* qkv_p = reinterpret_cast<const bf16*>(qkv.data_ptr());
    rope(qkv_p, width, 0, num_heads, hd, pos, cos_p, sin_p, rows, reinterpret_cast<bf16*>(q.data_ptr()));
    rope(qkv_p, width, q_size, num_kv_heads, hd, pos, cos_p, sin_p, rows, reinterpret_cast<bf16*>(k.data_ptr()));
    const at::Tensor v = qkv.view({B, T, width}).narrow(2, q_size + kv_size, kv_size).view({B, T, num_kv_heads, hd});
    at::Tensor layer_keys = keys[layer], layer_values = values[layer];
    write_kv.call(layer_keys, layer_values, k, v, lengths);
    attend(bits(reinterpret_cast<const bf16*>(q.data_ptr())), bits(reinterpret_cast<const bf16*>(layer_keys.data_ptr())),
           bits(reinterpret_cast<const bf16*>(layer_values.data_ptr())), len, mask, shape, windows[layer], scale,
           bits(reinterpret_cast<bf16*>(attended.data_ptr())));
    const at::Tensor o = linear(kernel, attended, w + 7, D);
    if (w[17].numel() != 0) rms_norm(reinterpret_cast<bf16*>(o.data_ptr()), w[17].data_ptr<float>(), rows, D, eps,
                                     reinterpret_cast<bf16*>(o.data_ptr()));
    add_into(hp, reinterpret_cast<const bf16*>(o.data_ptr()), rows * D);
    rms_norm(hp, w[10].data_ptr<float>(), rows, D, eps, xp);
    const at::Tensor gate_up = linear(kernel, x, w + 11, 2 * ffn);
    at::Tensor act = at::empty({rows, ffn}, h.options());
    act_mul(reinterpret_cast<const bf16*>(gate_up.data_ptr()), rows, ffn, activation == 1,
            reinterpret_cast<bf16*>(act.data_ptr()));
    const at::Tensor down = linear(kernel, act, w + 14, D);
    if (w[18].numel() != 0) rms_norm(reinterpret_cast<bf16*>(down.data_ptr()), w[18].data_ptr<float>(), rows, D, eps,
                                     reinterpret_cast<bf16*>(down.data_ptr()));
    add_into(hp, reinterpret_cast<const bf16*>(down.data_ptr()), rows * D);
  }
  const at::Tensor& final_norm = weights[weights.size() - 1];
  TORCH_CHECK(final_norm.scalar_type() == at::kFloat && final_norm.numel() == D,
              "treeserve_layers::run: the final norm's weight must be (D,) float32");
  at::Tensor out = at::empty({B, T, D}, h.options());
  rms_norm(hp, final_norm.data_ptr<float>(), rows, D, eps, reinterpret_cast<bf16*>(out.data_ptr()));
  return out;
}

// One layer's attention alone, as run() calls it (for the tests and bench/attention_kernel.py):
// q (B, T, H, hd) bf16; keys/values (B, n_kv, C, hd) bf16 with the new tokens' rows written at
// lengths[b] + t; tree_mask (B, T, T) bool, or empty for a causal chain. Returns (B, T, H * hd).
at::Tensor attend_op(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& lengths_in,
                     const at::Tensor& tree_mask_in, int64_t window, double scale) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.scalar_type() == at::kBFloat16, "treeserve_layers::attend: q must be (B, T, H, hd) bf16");
  const at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3);
  TORCH_CHECK(keys.dim() == 4 && keys.scalar_type() == at::kBFloat16 && keys.is_contiguous() && keys.size(0) == B &&
                  keys.size(3) == hd && values.sizes() == keys.sizes() && values.scalar_type() == at::kBFloat16 &&
                  values.is_contiguous(),
              "treeserve_layers::attend: keys and values must be contiguous (B, n_kv, C, hd) bf16");
  const int64_t n_kv = keys.size(1), C = keys.size(2);
  TORCH_CHECK(hd % 16 == 0 && hd <= kMaxHeadDim && H % n_kv == 0 && H / n_kv <= kMaxGroup,
              "treeserve_layers::attend: the head size must be a multiple of 16 (at most ", kMaxHeadDim, "), at most ",
              kMaxGroup, " query heads per KV head");
  const at::Tensor lengths = lengths_in.to(at::kLong).contiguous();
  TORCH_CHECK(lengths.numel() == B, "treeserve_layers::attend: lengths must be (B,)");
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(len[b] >= 0 && len[b] + T <= C, "treeserve_layers::attend: a row's new tokens overflow the cache");
  const bool causal = tree_mask_in.numel() == 0;
  TORCH_CHECK(causal || (tree_mask_in.scalar_type() == at::kBool && tree_mask_in.numel() == B * T * T),
              "treeserve_layers::attend: tree_mask must be (B, T, T) bool, or empty for a causal chain");
  const at::Tensor tree_mask = causal ? tree_mask_in : tree_mask_in.contiguous();
  at::Tensor out = at::empty({B, T, H * hd}, q.options());
  attend(bits(reinterpret_cast<const bf16*>(q.data_ptr())), bits(reinterpret_cast<const bf16*>(keys.data_ptr())),
         bits(reinterpret_cast<const bf16*>(values.data_ptr())), len, causal ? nullptr : tree_mask.data_ptr<bool>(),
         AttnShape{B, T, H, n_kv, C, hd}, window, static_cast<float>(scale), bits(reinterpret_cast<bf16*>(out.data_ptr())));
  return out;
}

}  // namespace

TORCH_LIBRARY(treeserve_layers, m) {
  m.def("attend(Tensor q, Tensor keys, Tensor values, Tensor lengths, Tensor tree_mask, int window, float scale) -> Tensor");
  m.def("run(Tensor h, Tensor positions, Tensor tree_mask, Tensor lengths, Tensor(a!)[] keys, Tensor(b!)[] values, "
        "Tensor rope_cos, Tensor rope_sin, Tensor rope_cos_local, Tensor rope_sin_local, Tensor[] weights, "
        "int[] windows, int num_heads, int num_kv_heads, int ffn, float eps, int kernel, int activation, float attn_scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(treeserve_layers, CPU, m) {
  m.impl("run", run);
  m.impl("attend", attend_op);
}

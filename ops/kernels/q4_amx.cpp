// 4-bit group-32 weight GEMM for the q4_1 format, at every row count: AVX512-BF16 dot products
// for a few rows (decode), AMX tiles for more (trees, batches, prefill).
//
//   y[m, n] = sum_k x[m, k] * w[n, k],  w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g],  g = k / 32
//
// computed as  sum_g scale[n, g] * (sum_{k in g} x[m, k] * (q[n, k] - 8)) + zero[n, g] * (sum_{k in g} x[m, k]).
// The codes q - 8 are small integers, exact in bf16, so each product x * (q - 8) is exact in
// fp32; a group's partial sum is accumulated in fp32 (by vdpbf16ps pairs, or by one bf16 AMX
// tile product, whose K depth of 32 is exactly one group) and then scaled in fp32. Both paths
// therefore multiply by the same real weight values, the GGUF's codes with the bf16 scale and
// zero of the format (the scale dtype of torch's _weight_int4pack_mm_for_cpu, which this
// replaced for one row); only the float summation order differs. Nothing rounds a weight to bf16.
//
// Layouts (built by treeserve.ops.kernels.q4_amx.pack):
//   x      (M, K) bf16, row-major
//   codes  [N/32][K/32][2 tiles][8 row pairs][32 lanes] bytes. Tile h holds columns
//          h*16..h*16+15 of the 32-column block in the VNNI layout of a bf16 B tile: lane
//          2*c + j of tile row r is weight k = 2*r + j of column c. Byte (p, lane) carries tile
//          row 2p in its low nibble and row 2p+1 in its high nibble.
//   sz     [N/32][K/32][2][32] bf16: the 32 columns' scales, then their zeros.
//   y      (M, N) bf16, row-major (fp32 accumulators rounded to nearest even).
// Requires K % 32 == 0 and N % 32 == 0. Threads: OpenMP (torch's own libgomp), torch's thread count.
//
// The op treeserve_q4::mm (registered below) is what the q4_1 format calls at every shape: under
// min_rows rows the vector path, from min_rows rows on the tiles (where this process has none,
// the vector path at every row count); with int8_rows, the int8-row path (below) at every row
// count, which the format asks for wherever the CPU has AVX512-VNNI (a row's sums are then the
// same bits at every row count). Both prefetch the codes a few groups ahead (without it a
// one-row step read them 1.2x slower, measured). treeserve_q4::q8g_mm (codes8, at the end) takes
// GGUF's 8-bit-code block types on the same int8 rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "amx_tiles.h"
#include "codes5.h"
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

// One B tile (256 code bytes) -> 16 rows of 32 bf16 in VNNI order.
inline void expand_tile(const uint8_t* src, uint16_t* dst, __m512i table) {
  const __m512i low_nibble = _mm512_set1_epi16(0xF);
  for (int p = 0; p < 8; ++p) {
    __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + p * 32)));
    __m512i low = _mm512_and_si512(bytes, low_nibble);
    __m512i high = _mm512_srli_epi16(bytes, 4);
    _mm512_store_si512(dst + (2 * p) * 32, _mm512_permutexvar_epi16(low, table));
    _mm512_store_si512(dst + (2 * p + 1) * 32, _mm512_permutexvar_epi16(high, table));
  }
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

}  // namespace

extern "C" {

// treeserve_amx::init's mask: 0 when this CPU lacks AVX512-BF16 (the caller must not call the
// op); kVectors alone where it has no AMX tiles for this process (the op then runs the vector
// path at every row count); kVectors | kTiles where both run; kVnni where the int8-row path may.
int ts_q4_amx_init(void) { return treeserve_amx::init(true); }

}  // extern "C"

namespace {

// Output blocks [nb_begin, nb_end) of 32 columns, on one thread (arguments by value, so the
// compiler knows no store aliases them): each block's groups software-pipelined by
// treeserve_amx::pipelined_groups (widen: a group's codes to bf16 B tiles; scale: its stored
// products times the group's scales, plus the zero term, into the block's fp32 sums).
void gemm_blocks(const uint16_t* xa, const float* xs, const int64_t M, const int64_t K, const int64_t N,
                 const uint8_t* codes, const uint16_t* sz, uint16_t* y, const int64_t nb_begin, const int64_t nb_end) {
  const int64_t G = K / 32, MT = (M + 15) / 16, Mp = MT * 16;
  const __m512i table = code_table();
  configure_tiles(8);
  alignas(64) uint16_t bbuf[2][2][16 * 32];
  // cbuf[g & 1][mt]: row tile mt's products of group g, its 32 columns as two 16 x 16 tiles.
  float* cbuf = static_cast<float*>(aligned_alloc(64, 2 * MT * 512 * 4));
  float* acc = static_cast<float*>(aligned_alloc(64, Mp * 32 * 4));
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    memset(acc, 0, Mp * 32 * 4);
    const uint8_t* block = codes + nb * G * kBlockBytes;
    const uint16_t* block_sz = sz + nb * G * 64;
    auto widen = [&](int64_t g) {
      prefetch_group(block + g * kBlockBytes, block_sz + g * 64);
      expand_tile(block + g * kBlockBytes, bbuf[g & 1][0], table);
      expand_tile(block + g * kBlockBytes + 256, bbuf[g & 1][1], table);
    };
    auto scale = [&](int64_t g) {
      const uint16_t* s = block_sz + g * 64;
      const __m512 s0 = bf16x16_to_f32(s), s1 = bf16x16_to_f32(s + 16);
      const __m512 z0 = bf16x16_to_f32(s + 32), z1 = bf16x16_to_f32(s + 48);
      for (int64_t m = 0; m < M; ++m) {
        const float* c = cbuf + ((g & 1) * MT + m / 16) * 512 + (m % 16) * 16;
        float* a = acc + m * 32;
        const __m512 sums = _mm512_set1_ps(xs[m * G + g]);
        __m512 a0 = _mm512_fmadd_ps(_mm512_load_ps(c), s0, _mm512_load_ps(a));
        __m512 a1 = _mm512_fmadd_ps(_mm512_load_ps(c + 256), s1, _mm512_load_ps(a + 16));
        _mm512_store_ps(a, _mm512_fmadd_ps(sums, z0, a0));
        _mm512_store_ps(a + 16, _mm512_fmadd_ps(sums, z1, a1));
      }
    };
    pipelined_groups(xa, K, MT, G, bbuf, cbuf, widen, scale);
    for (int64_t m = 0; m < M; ++m) {
      uint16_t* out = y + m * N + nb * 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + m * 32)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + m * 32 + 16)));
    }
  }
  free(cbuf);
  free(acc);
  _tile_release();
}

void gemm(const uint16_t* x, int64_t M, int64_t K, int64_t N, const uint8_t* codes, const uint16_t* sz, uint16_t* y) {
  const int64_t G = K / 32, NB = N / 32, MT = (M + 15) / 16, Mp = MT * 16;
  // Rows padded to whole tiles, and each row's per-group sums (the zero term's factor).
  uint16_t* xa = treeserve_amx::padded_rows(x, M, K);
  float* xs = static_cast<float*>(aligned_alloc(64, ((Mp * G * 4 + 63) / 64) * 64));
  group_sums(xa, Mp, K, xs);
  over_blocks(NB, [&](int64_t begin, int64_t end) { gemm_blocks(xa, xs, M, K, N, codes, sz, y, begin, end); });
  free(xa);
  free(xs);
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

// R rows (R <= kMaxVectorRows) for output blocks [nb_begin, nb_end): the codes widened to bf16
// (q - 8, by table) and multiplied in pairs with each row's bf16 (x[k], x[k + 1]) by vdpbf16ps,
// whose lane c then sums column c's two weights: the tile layout serves this path as it is.
template <int R>
void vector_blocks(const uint16_t* x, const float* xs, int64_t K, int64_t N, const uint8_t* codes, const uint16_t* sz,
                   uint16_t* y, int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32;
  const __m512i table = code_table();
  const __m512i low_nibble = _mm512_set1_epi16(0xF);
  row_blocks<R>(G, N, codes, sz, y, nb_begin, nb_end, [&](__m512 (&acc)[R][2], const uint8_t* src, const uint16_t* s,
                                                          int64_t g) {
    __m512 part[R][4];  // [tile h][even, odd tile rows]: four independent sums per row
    for (int m = 0; m < R; ++m)
      for (int a = 0; a < 4; ++a) part[m][a] = _mm512_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      for (int p = 0; p < 8; ++p) {
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + h * 256 + p * 32)));
        const __m512bh even = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(bytes, low_nibble), table);
        const __m512bh odd = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
        for (int m = 0; m < R; ++m) {
          uint32_t x_even, x_odd;  // the bf16 pairs of tile rows 2p and 2p + 1: k = 4p, 4p + 1 and 4p + 2, 4p + 3
          memcpy(&x_even, x + m * K + g * 32 + 4 * p, sizeof(x_even));
          memcpy(&x_odd, x + m * K + g * 32 + 4 * p + 2, sizeof(x_odd));
          part[m][2 * h] = _mm512_dpbf16_ps(part[m][2 * h], even, (__m512bh)_mm512_set1_epi32(x_even));
          part[m][2 * h + 1] = _mm512_dpbf16_ps(part[m][2 * h + 1], odd, (__m512bh)_mm512_set1_epi32(x_odd));
        }
      }
    }
    const __m512 s0 = bf16x16_to_f32(s), s1 = bf16x16_to_f32(s + 16);
    const __m512 z0 = bf16x16_to_f32(s + 32), z1 = bf16x16_to_f32(s + 48);
    for (int m = 0; m < R; ++m) {
      const __m512 sums = _mm512_set1_ps(xs[m * G + g]);
      acc[m][0] = _mm512_fmadd_ps(sums, z0, _mm512_fmadd_ps(_mm512_add_ps(part[m][0], part[m][1]), s0, acc[m][0]));
      acc[m][1] = _mm512_fmadd_ps(sums, z1, _mm512_fmadd_ps(_mm512_add_ps(part[m][2], part[m][3]), s1, acc[m][1]));
    }
  });
}

void vector_gemm(const uint16_t* x, int64_t M, int64_t K, int64_t N, const uint8_t* codes, const uint16_t* sz,
                 uint16_t* y) {
  const int64_t G = K / 32, NB = N / 32;
  float* xs = static_cast<float*>(aligned_alloc(64, ((M * G * 4 + 63) / 64) * 64));
  group_sums(x, M, K, xs);
  over_blocks(NB, [&](int64_t begin, int64_t end) {
    over_row_chunks<kMaxVectorRows>(M, [&](auto rows, int64_t m) {
      vector_blocks<decltype(rows)::value>(x + m * K, xs + m * G, K, N, codes, sz, y + m * N, begin, end);
    });
  });
  free(xs);
}

// ---------------------------------------------------------------------------------------------
// int8 rows (AVX512-VNNI), for CPUs without AMX tiles, at every row count. Each row is quantized
// per group of 32 as llama.cpp's Q8_0 blocks are: d = max |x| / 127, xq = round(x / d) in int8.
// vpdpbusd multiplies the 4-bit codes (u8) by xq (s8) four k at a time, exactly in int32, so
//   sum_{k in g} x (q - 8)  ~  d * (sum xq q - 8 sum xq),
// scaled by the group's scale in fp32; the zero term takes the exact fp32 sum of the bf16 row.
// The weights are the same values as on the other paths; the rows are rounded to 8 bits a
// group (the precision llama.cpp computes these products in), which is what makes the products
// 4.6x cheaper than vdpbf16ps's on a CPU without tiles (64 products in 0.46 ns against 32 in
// 1.05 ns a core, measured).
//
// The packing serves as it is: a tile row pair p holds, per column c, the bytes of k = 4p, 4p+1
// (low nibbles) and 4p+2, 4p+3 (high nibbles); widened to 32 bits a column, (v | v << 12) &
// 0x0F0F0F0F puts the four codes in k order in the lane, matching four bytes of xq.

// One row's groups: xq (K int8), and per group d and -8 d sum(xq) (the zero term's exact sums
// of x come from group_sums).
void quantize_row(const uint16_t* x, int64_t K, int8_t* xq, float* d, float* c8) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const __m512 v0 = bf16x16_to_f32(x + g * 32), v1 = bf16x16_to_f32(x + g * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    // A group whose largest |x| is under 1e-30 counts as zero in the codes' term (127 / amax
    // would overflow from 3.7e-37 down); NaN and inf rows stay non-finite through d.
    const bool tiny = amax < 1e-30f;
    const float scale = tiny ? 0.0f : amax / 127.0f, inverse = tiny ? 0.0f : 127.0f / amax;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inverse)));  // nearest, ties to even
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inverse)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * 32), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * 32 + 16), _mm512_cvtsepi32_epi8(q1));
    d[g] = scale;
    c8[g] = -8.0f * scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

// 64 codes of one tile row pair (32 bytes: 16 columns) -> the u8 operand of vpdpbusd.
inline __m512i codes_u8(const uint8_t* src) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x0F0F0F0F), 0xA8);  // (a | b) & c
}

template <int R>
void int8_blocks(const int8_t* xq, const float* d, const float* c8, const float* xs, int64_t K, int64_t N,
                 const uint8_t* codes, const uint16_t* sz, uint16_t* y, int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32;
  row_blocks<R>(G, N, codes, sz, y, nb_begin, nb_end, [&](__m512 (&acc)[R][2], const uint8_t* src, const uint16_t* s,
                                                          int64_t g) {
    for (int h = 0; h < 2; ++h) {
      __m512i w[8];
      for (int p = 0; p < 8; ++p) w[p] = codes_u8(src + h * 256 + p * 32);
      __m512i dot[R];
      for (int m = 0; m < R; ++m) dot[m] = _mm512_setzero_si512();
      for (int p = 0; p < 8; ++p) {
        for (int m = 0; m < R; ++m) {
          int32_t four;
          memcpy(&four, xq + m * K + g * 32 + 4 * p, sizeof(four));
          dot[m] = _mm512_dpbusd_epi32(dot[m], w[p], _mm512_set1_epi32(four));
        }
      }
      const __m512 scale = bf16x16_to_f32(s + h * 16), zero = bf16x16_to_f32(s + 32 + h * 16);
      for (int m = 0; m < R; ++m) {
        const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_set1_ps(d[m * G + g]),
                                         _mm512_set1_ps(c8[m * G + g]));
        acc[m][h] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * G + g]), zero, _mm512_fmadd_ps(t, scale, acc[m][h]));
      }
    }
  });
}

constexpr int kInt8Rows = 4;

void int8_gemm(const uint16_t* x, int64_t M, int64_t K, int64_t N, const uint8_t* codes, const uint16_t* sz,
               uint16_t* y) {
  const int64_t G = K / 32, NB = N / 32;
  int8_t* xq = static_cast<int8_t*>(aligned_alloc(64, ((M * K + 63) / 64) * 64));
  float* f = static_cast<float*>(aligned_alloc(64, ((3 * M * G * 4 + 63) / 64) * 64));
  float *d = f, *c8 = f + M * G, *xs = f + 2 * M * G;
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, xq + m * K, d + m * G, c8 + m * G);
  group_sums(x, M, K, xs);
  over_blocks(NB, [&](int64_t begin, int64_t end) {
    over_row_chunks<kInt8Rows>(M, [&](auto rows, int64_t m) {
      int8_blocks<decltype(rows)::value>(xq + m * K, d + m * G, c8 + m * G, xs + m * G, K, N, codes, sz, y + m * N,
                                         begin, end);
    });
  });
  free(xq);
  free(f);
}

at::Tensor mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_zeros, int64_t out_features,
              int64_t min_rows, bool int8_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "treeserve_q4::mm: x must be 2-D bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % 32 == 0 && N % 32 == 0 && codes.numel() * 2 == N * K && codes.is_contiguous() &&
                  scales_zeros.is_contiguous() && scales_zeros.scalar_type() == at::kBFloat16 &&
                  scales_zeros.numel() == N * (K / 32) * 2,
              "treeserve_q4::mm: the packing does not fit x");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* sp = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  if (int8_rows) {
    TORCH_CHECK(treeserve_amx::has_vnni, "treeserve_q4::mm: int8 rows need AVX512-VNNI, which this CPU lacks");
    int8_gemm(xp, M, K, N, codes.data_ptr<uint8_t>(), sp, yp);
  } else if (M < min_rows || !treeserve_amx::tiles_granted) {
    vector_gemm(xp, M, K, N, codes.data_ptr<uint8_t>(), sp, yp);
  } else {
    gemm(xp, M, K, N, codes.data_ptr<uint8_t>(), sp, yp);
  }
  return y;
}

// ---------------------------------------------------------------------------------------------
// codes8: signed 8-bit codes by group (GGUF's Q8_0, Q5_0, Q5_1, Q5_K and Q6_K as they are),
//   w[n, k] = scale[n, k / S] * code[n, k] + zero[n, k / 32]   (S = 32 or 16; zeros optional),
// on int8 rows as above (quantize_row): per group g of row m, with h the group's 32 k (S = 32)
// or its two halves of 16 (S = 16),
//   acc = fma(float(dot_h) * d[m, g], scale[n, h], acc) for each h, then acc = fma(s[m, g], zero[n, g], acc),
// s the quantized row's sum d * sum(xq) over the group (the rounded row times the weights; see
// kernels/codes8.py),
// dot_h the exact int32 sum of code * xq over h (under 2^19 in size, so float(dot_h) is exact).
// vpdpbusd multiplies u8 by s8, so the codes go in as u = code ^ 0x80 = code + 128 (one vpxord per
// 64 bytes, shared by the pass's rows) and each dot starts at -128 * sum_h(xq) (exact in int32).
// Every fp32 step is lane-wise in that order, whatever the row count, and in q_avx2.cpp's build
// too: its integer dots are the same integers, and the bf16 stores here round as its do
// (simd16's integer rounding: vcvtneps2bf16 would flush subnormal sums to zero, which it keeps).
// Against the q4_1 int8-row path on the default model's linears (2 threads): one row 0.9-1.2x
// its time with the weights in cache, 1.5-1.7x from memory (twice the bytes); 16 and 64 rows
// 0.7-0.9x (no nibbles to unpack).
//
// Layouts (built by treeserve.ops.kernels.codes8.pack):
//   codes  [N/16][K/32][8 quads][16 columns][4] int8: a quad is 4 consecutive k of a column, so
//          one 64-byte row of a quad is one vpdpbusd operand for 16 columns.
//   scales [N/16][K/S][16] fp32;  zeros [N/16][K/32][16] fp32, or none.
//   y      (M, N) bf16 (nearest even) or fp32.

using treeserve_cpu::kCodes8Bytes;
using treeserve_cpu::prefetch_codes8;
constexpr int kCodes8Rows = 4;  // rows a pass (six: no faster; eight: their sums spill, 1.6x slower)

// R rows (their xq, d, bias and xs offset to the first) for output blocks [nb_begin, nb_end) of
// 16 columns: each row's 16 sums in one fp32 register over the K / 32 groups, then stored.
// kHalves: S = 16; kZeros: the zero term. bias[(m * G + g) * 2 + h] = -128 * sum_h(xq).
template <int R, bool kHalves, bool kZeros>
void codes8_blocks(const int8_t* xq, const float* d, const int32_t* bias, const float* xs, int64_t K, int64_t N,
                   const int8_t* codes, const float* scales, const float* zeros, void* y, bool float_out,
                   int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32, scale_floats = kHalves ? 32 : 16;
  const __m512i flip = _mm512_set1_epi8(-128);
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    __m512 acc[R];
    for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* src = codes + (nb * G + g) * kCodes8Bytes;
      const float* s = scales + (nb * G + g) * scale_floats;
      const float* z = kZeros ? zeros + (nb * G + g) * 16 : nullptr;
      prefetch_codes8(src, s, scale_floats, z);
      __m512i u[8];
      for (int p = 0; p < 8; ++p) u[p] = _mm512_xor_si512(_mm512_loadu_si512(src + p * 64), flip);
      __m512i dot[R][2];  // quads 0-3 and 4-7 (the halves of 16 k): two chains a row
      for (int m = 0; m < R; ++m)
        for (int h = 0; h < 2; ++h) dot[m][h] = _mm512_set1_epi32(bias[(m * G + g) * 2 + h]);
      for (int p = 0; p < 8; ++p) {
        for (int m = 0; m < R; ++m) {
          int32_t four;
          memcpy(&four, xq + m * K + g * 32 + 4 * p, sizeof(four));
          dot[m][p / 4] = _mm512_dpbusd_epi32(dot[m][p / 4], u[p], _mm512_set1_epi32(four));
        }
      }
      for (int m = 0; m < R; ++m) {
        const __m512 dm = _mm512_set1_ps(d[m * G + g]);
        if constexpr (kHalves) {
          acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[m][0]), dm), _mm512_loadu_ps(s), acc[m]);
          acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[m][1]), dm), _mm512_loadu_ps(s + 16), acc[m]);
        } else {
          const __m512 dot32 = _mm512_cvtepi32_ps(_mm512_add_epi32(dot[m][0], dot[m][1]));
          acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dot32, dm), _mm512_loadu_ps(s), acc[m]);
        }
        if constexpr (kZeros) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * G + g]), _mm512_loadu_ps(z), acc[m]);
      }
    }
    for (int m = 0; m < R; ++m) {
      if (float_out) _mm512_storeu_ps(static_cast<float*>(y) + m * N + nb * 16, acc[m]);
      else simd16::vstore_bf16(static_cast<uint16_t*>(y) + m * N + nb * 16, {acc[m]}, 0xFFFF);
    }
  }
}

// Per row: xq and d (quantize_row), xs (group_sums), and the halves' biases -128 * sum_h(xq)
// (vpsadbw on xq ^ 0x80 sums 8 bytes of xq + 128). A group whose xs is not finite (a NaN or inf
// x) gets d = NaN, so its row's outputs are NaN with or without zeros (q_avx2.cpp does the same).
void codes8_rows(const uint16_t* x, int64_t M, int64_t K, int8_t* xq, float* d, float* xs, int32_t* bias) {
  const int64_t G = K / 32;
  float* c8 = static_cast<float*>(aligned_alloc(64, ((M * G * 4 + 63) / 64) * 64));  // quantize_row's -8 d sum(xq)
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, xq + m * K, d + m * G, c8 + m * G);
  group_sums(x, M, K, xs);
  const __m128i flip = _mm_set1_epi8(-128);
  for (int64_t i = 0; i < M * G * 2; ++i) {
    const __m128i sad = _mm_sad_epu8(_mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + i * 16)), flip),
                                     _mm_setzero_si128());
    const int32_t sum = _mm_cvtsi128_si32(sad) + _mm_extract_epi16(sad, 4) - 16 * 128;
    bias[i] = -128 * sum;
    if (i % 2 == 1 && !std::isfinite(xs[i / 2])) d[i / 2] = std::numeric_limits<float>::quiet_NaN();
  }
  // The zero term's factor: the group's quantized sum d * sum(xq) (exactly -c8 / 8), not the
  // exact sum, so that a weight's offset meets the same rounded row as its code does.
  for (int64_t i = 0; i < M * G; ++i) xs[i] = c8[i] * -0.125f;
  free(c8);
}

// offset >= 0: the codes are packed at five bits (codes5.h; offset: what a field less is its
// code), widened a block at a time by over_five_bit_blocks, so a packed weight gives the bits of
// its 8-bit layout.
template <bool kHalves, bool kZeros>
void codes8_gemm(const int8_t* xq, const float* d, const int32_t* bias, const float* xs, int64_t M, int64_t K,
                 int64_t N, const int8_t* codes, const float* scales, const float* zeros, void* y, bool float_out,
                 int offset) {
  const int64_t G = K / 32, scale_floats = kHalves ? 32 : 16;
  const int64_t out_bytes = float_out ? 4 : 2;
  const auto blocks = [&](const int8_t* c, const float* s, const float* z, char* out, int64_t begin, int64_t end) {
    over_row_chunks<kCodes8Rows>(M, [&](auto rows, int64_t m) {
      codes8_blocks<decltype(rows)::value, kHalves, kZeros>(xq + m * K, d + m * G, bias + m * G * 2, xs + m * G, K, N,
                                                            c, s, z, out + m * N * out_bytes, float_out, begin, end);
    });
  };
  over_blocks(N / 16, [&](int64_t begin, int64_t end) {
    if (offset < 0) return blocks(codes, scales, zeros, static_cast<char*>(y), begin, end);
    treeserve_cpu::over_five_bit_blocks(codes, scales, zeros, y, M, G, kCodes8Rows, scale_floats, out_bytes,
                                        static_cast<int8_t>(offset), begin, end,
                                        [&](const int8_t* c, const float* s, const float* z, char* out, int64_t n) {
                                          blocks(c, s, z, out, 0, n);
                                        });
  });
}

at::Tensor q8g_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                  int64_t out_features, bool float_out) {
  TORCH_CHECK(treeserve_amx::has_vnni, "treeserve_q4::q8g_mm needs AVX512-VNNI, which this CPU lacks");
  const auto [halves, with_zeros, five_bits, offset] =
      treeserve_cpu::check_codes8("treeserve_q4::q8g_mm", x, codes, scales, zeros, out_features);
  const int64_t M = x.size(0), K = x.size(1), N = out_features, G = K / 32;
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  int8_t* xq = static_cast<int8_t*>(aligned_alloc(64, ((M * K + 63) / 64) * 64));
  float* f = static_cast<float*>(aligned_alloc(64, ((4 * M * G * 4 + 63) / 64) * 64));
  float *d = f, *xs = f + M * G;
  int32_t* bias = reinterpret_cast<int32_t*>(f + 2 * M * G);
  codes8_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr()), M, K, xq, d, xs, bias);
  const auto* cp = static_cast<const int8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* zp = with_zeros ? zeros.data_ptr<float>() : nullptr;
  const int off = five_bits ? offset : -1;
  if (halves && with_zeros) codes8_gemm<true, true>(xq, d, bias, xs, M, K, N, cp, sp, zp, y.data_ptr(), float_out, off);
  else if (halves) codes8_gemm<true, false>(xq, d, bias, xs, M, K, N, cp, sp, zp, y.data_ptr(), float_out, off);
  else if (with_zeros) codes8_gemm<false, true>(xq, d, bias, xs, M, K, N, cp, sp, zp, y.data_ptr(), float_out, off);
  else codes8_gemm<false, false>(xq, d, bias, xs, M, K, N, cp, sp, zp, y.data_ptr(), float_out, off);
  free(xq);
  free(f);
  return y;
}

}  // namespace

TORCH_LIBRARY(treeserve_q4, m) {
  m.def("mm(Tensor x, Tensor codes, Tensor scales_zeros, int out_features, int min_rows, bool int8_rows) -> Tensor");
  m.def("q8g_mm(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int out_features, bool float_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(treeserve_q4, CPU, m) {
  m.impl("mm", mm);
  m.impl("q8g_mm", q8g_mm);
}

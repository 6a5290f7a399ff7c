// 8-bit group-32 weights (GGUF Q8_0 blocks) times rows of activations, for the int formats' LM head.
//
//   y[m, n] = sum_k x[m, k] * w[n, k],  w[n, k] = q[n, k] * d[n, g],  g = k / 32
//
// with q in -127..127 (int8) and d float16, as a Q8_0 block stores them; computed as
// sum_g d[n, g] * (sum_{k in g} x[m, k] * q[n, k]). x is bf16, so x * q is exact in fp32 (8 by
// 8 significant bits), each group's sum is accumulated in fp32 and then scaled in fp32: the
// kernel multiplies by the GGUF's own weight values, rounding none of them. y is fp32 logits.
//
// Two paths, one layout:
//   * fewer than min_rows rows: AVX-512 FMAs on the codes widened to fp32 (a matrix-vector
//     product that streams the codes once; its cost is their bytes);
//   * from min_rows rows on: AMX tiles, the codes widened to bf16 (exact) one group at a time,
//     as q4_amx.cpp does for 4-bit codes (where this process has no tiles: the AVX-512 path).
// Both prefetch the codes a few groups ahead.
//
// Layouts (built by treeserve.ops.kernels.q8_amx.pack):
//   x       (M, K) bf16, row-major
//   codes   [N/32][K/32][2 tiles][16 tile rows][32 lanes] int8. Tile h holds columns
//           h*16..h*16+15 of the 32-column block in the VNNI layout of a bf16 B tile: lane
//           2*c + j of tile row r is weight k = 2*r + j of column c.
//   scales  [N/32][K/32][32] float16: the 32 columns' d for the group.
//   y       (M, N) fp32, row-major.
// Requires K % 32 == 0 and N % 32 == 0. Threads: OpenMP (torch's own libgomp), torch's thread count.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"

namespace {

using treeserve_amx::bf16x16_to_f32;
using treeserve_amx::configure_tiles;
using treeserve_amx::pipelined_groups;
using treeserve_amx::load_b_tiles;
using treeserve_amx::over_blocks;

constexpr int64_t kBlockBytes = 2 * 16 * 32;  // codes of one 32-column block for one group
constexpr int kMaxVectorRows = 8;
// Codes are prefetched this many bytes (four groups) ahead: without it both paths read them at
// about half the bandwidth oneDNN streams a bf16 weight with (measured, 2 threads).
constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch_block(const int8_t* src) {
  for (int line = 0; line < kBlockBytes / 64; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes + line * 64), _MM_HINT_T0);
}

// 16 int8 codes -> 16 fp32.
inline __m512 codes_to_f32(const int8_t* src) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}

// Column sums of a tile's two pair-interleaved accumulators: lane 2c + j of lo (columns 0..7)
// and of hi (columns 8..15) -> the 16 columns' totals, in order.
inline __m512 pair_sums(__m512 lo, __m512 hi) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_add_ps(_mm512_permutex2var_ps(lo, even, hi), _mm512_permutex2var_ps(lo, odd, hi));
}

// R rows (R < kMaxVectorRows) for output blocks [nb_begin, nb_end), AVX-512 FMAs. xf: the rows
// widened to fp32.
template <int R>
void vector_blocks(const float* xf, int64_t K, int64_t N, const int8_t* codes, const uint16_t* scales, float* y,
                   int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32;
  // d of columns 0..15 -> lanes 2c + j of the lo (columns 0..7) and hi (8..15) accumulators.
  const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dup_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    __m512 acc[R][4];
    for (int m = 0; m < R; ++m)
      for (int a = 0; a < 4; ++a) acc[m][a] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* src = codes + (nb * G + g) * kBlockBytes;
      __m512 part[R][4];
      for (int m = 0; m < R; ++m)
        for (int a = 0; a < 4; ++a) part[m][a] = _mm512_setzero_ps();
      prefetch_block(src);
      for (int r = 0; r < 16; ++r) {
        const __m512 w0 = codes_to_f32(src + r * 32), w1 = codes_to_f32(src + r * 32 + 16);
        const __m512 w2 = codes_to_f32(src + 512 + r * 32), w3 = codes_to_f32(src + 512 + r * 32 + 16);
        for (int m = 0; m < R; ++m) {
          // (x[2r], x[2r + 1]) in every lane pair.
          double pair;
          memcpy(&pair, xf + m * K + g * 32 + 2 * r, sizeof(pair));
          const __m512 xb = _mm512_castpd_ps(_mm512_set1_pd(pair));
          part[m][0] = _mm512_fmadd_ps(w0, xb, part[m][0]);
          part[m][1] = _mm512_fmadd_ps(w1, xb, part[m][1]);
          part[m][2] = _mm512_fmadd_ps(w2, xb, part[m][2]);
          part[m][3] = _mm512_fmadd_ps(w3, xb, part[m][3]);
        }
      }
      const uint16_t* s = scales + (nb * G + g) * 32;
      const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16)));
      const __m512 d[4] = {_mm512_permutexvar_ps(dup_lo, d0), _mm512_permutexvar_ps(dup_hi, d0),
                           _mm512_permutexvar_ps(dup_lo, d1), _mm512_permutexvar_ps(dup_hi, d1)};
      for (int m = 0; m < R; ++m)
        for (int a = 0; a < 4; ++a) acc[m][a] = _mm512_fmadd_ps(part[m][a], d[a], acc[m][a]);
    }
    for (int m = 0; m < R; ++m) {
      _mm512_storeu_ps(y + m * N + nb * 32, pair_sums(acc[m][0], acc[m][1]));
      _mm512_storeu_ps(y + m * N + nb * 32 + 16, pair_sums(acc[m][2], acc[m][3]));
    }
  }
}

// One group's B tile (16 rows x 32 int8) -> 16 rows of 32 bf16, same VNNI order (exact).
inline void expand_tile(const int8_t* src, uint16_t* dst) {
  for (int r = 0; r < 16; ++r) {
    const __m512 lo = codes_to_f32(src + r * 32), hi = codes_to_f32(src + r * 32 + 16);
    _mm512_store_si512(dst + r * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// M rows (padded to whole tiles in xa) for output blocks [nb_begin, nb_end), AMX tiles, each
// block's groups software-pipelined by treeserve_amx::pipelined_groups.
void tile_blocks(const uint16_t* xa, int64_t M, int64_t K, int64_t N, const int8_t* codes, const uint16_t* scales,
                 float* y, int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32, MT = (M + 15) / 16;
  configure_tiles(8);
  alignas(64) uint16_t bbuf[2][2][16 * 32];
  // cbuf[g & 1][mt]: row tile mt's products of group g, its 32 columns as two 16 x 16 tiles.
  float* cbuf = static_cast<float*>(aligned_alloc(64, 2 * MT * 512 * 4));
  // The block's sums, contiguous, copied into y's rows (N apart) at the end: accumulating in y
  // itself took 10.5 ms a call at 64 rows against 7.1 ms so (measured).
  float* acc = static_cast<float*>(aligned_alloc(64, MT * 16 * 32 * 4));
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    memset(acc, 0, MT * 16 * 32 * 4);
    const int8_t* block = codes + nb * G * kBlockBytes;
    auto widen = [&](int64_t g) {
      prefetch_block(block + g * kBlockBytes);
      expand_tile(block + g * kBlockBytes, bbuf[g & 1][0]);
      expand_tile(block + g * kBlockBytes + 512, bbuf[g & 1][1]);
    };
    auto scale = [&](int64_t g) {
      const uint16_t* s = scales + (nb * G + g) * 32;
      const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16)));
      for (int64_t m = 0; m < M; ++m) {
        const float* c = cbuf + ((g & 1) * MT + m / 16) * 512 + (m % 16) * 16;
        float* out = acc + m * 32;
        _mm512_store_ps(out, _mm512_fmadd_ps(_mm512_load_ps(c), d0, _mm512_load_ps(out)));
        _mm512_store_ps(out + 16, _mm512_fmadd_ps(_mm512_load_ps(c + 256), d1, _mm512_load_ps(out + 16)));
      }
    };
    pipelined_groups(xa, K, MT, G, bbuf, cbuf, widen, scale);
    for (int64_t m = 0; m < M; ++m) memcpy(y + m * N + nb * 32, acc + m * 32, 32 * sizeof(float));
  }
  free(cbuf);
  free(acc);
  _tile_release();
}

template <int R>
void vector_gemm(const uint16_t* x, int64_t K, int64_t N, const int8_t* codes, const uint16_t* scales, float* y) {
  float* xf = static_cast<float*>(aligned_alloc(64, ((R * K * 4 + 63) / 64) * 64));
  for (int64_t i = 0; i < R * K; i += 16) _mm512_store_ps(xf + i, bf16x16_to_f32(x + i));
  over_blocks(N / 32, [&](int64_t begin, int64_t end) { vector_blocks<R>(xf, K, N, codes, scales, y, begin, end); });
  free(xf);
}

void vector_rows(const uint16_t* x, int64_t M, int64_t K, int64_t N, const int8_t* codes, const uint16_t* scales,
                 float* y) {
  switch (M) {
    case 1: return vector_gemm<1>(x, K, N, codes, scales, y);
    case 2: return vector_gemm<2>(x, K, N, codes, scales, y);
    case 3: return vector_gemm<3>(x, K, N, codes, scales, y);
    case 4: return vector_gemm<4>(x, K, N, codes, scales, y);
    case 5: return vector_gemm<5>(x, K, N, codes, scales, y);
    case 6: return vector_gemm<6>(x, K, N, codes, scales, y);
    default: return vector_gemm<7>(x, K, N, codes, scales, y);
  }
}

void tile_rows(const uint16_t* x, int64_t M, int64_t K, int64_t N, const int8_t* codes, const uint16_t* scales,
               float* y) {
  uint16_t* xa = treeserve_amx::padded_rows(x, M, K);
  over_blocks(N / 32, [&](int64_t begin, int64_t end) { tile_blocks(xa, M, K, N, codes, scales, y, begin, end); });
  free(xa);
}

at::Tensor mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t out_features,
              int64_t min_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "treeserve_q8::mm: x must be 2-D bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % 32 == 0 && N % 32 == 0 && codes.numel() == N * K && codes.scalar_type() == at::kChar &&
                  codes.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.numel() == N * (K / 32),
              "treeserve_q8::mm: the packing does not fit x");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* cp = codes.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  float* yp = y.data_ptr<float>();
  if (M >= min_rows && treeserve_amx::tiles_granted) {
    tile_rows(xp, M, K, N, cp, sp, yp);
  } else {
    for (int64_t m = 0; m < M; m += kMaxVectorRows - 1) {
      const int64_t rows = M - m < kMaxVectorRows - 1 ? M - m : kMaxVectorRows - 1;
      vector_rows(xp + m * K, rows, K, N, cp, sp, yp + m * N);
    }
  }
  return y;
}

}  // namespace

extern "C" {

// treeserve_amx::init's mask: 0 without AVX-512BW (the caller must not call the op); kVectors
// alone where this process has no AMX tiles (the AVX-512 path then runs at every row count).
int ts_q8_amx_init(void) { return treeserve_amx::init(false); }

}  // extern "C"

TORCH_LIBRARY(treeserve_q8, m) {
  m.def("mm(Tensor x, Tensor codes, Tensor scales, int out_features, int min_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(treeserve_q8, CPU, m) { m.impl("mm", mm); }

// The float32 format's linear on CPU, for CPUs with AVX-512 or AVX2 (16-lane vectors from
// simd16.h, one build per kind of CPU):
//
//   y = mm(x, weight, bias)
//
//   x       (M, K) float32, any M
//   weight  (N, K) float32, contiguous (the checkpoint's layout)
//   bias    (N,) float32, or an empty tensor for none
//   y       (M, N) float32
//
// Why not F.linear: torch's float32 product reads a one-row decode's weights on one thread
// (about 11 GB/s on the default model's head, whatever torch's thread count), and its sums
// change order with the row count. Here:
//
// * Every output's sum has one order at every row count and on both builds: 16 partial sums,
//   lane j taking k = j, j + 16, j + 32, ... in order by fused multiply-adds (a last partial
//   vector of K zero-filled), then folded as sum16 below. So a row's outputs are the same
//   bits alone, in a tree, in a batch or in a prefill, and on AVX-512 and AVX2 alike.
// * Work is handed out in units (32 outputs x a block of up to 64 rows) that the threads claim
//   as they come free, so a thread that shares its core with another process takes fewer.
// * Within a unit, a tile of R rows x C outputs keeps its R x C sums in registers and loads
//   each weight vector once for its R rows; the unit's weights stay in L1/L2 while its rows go by.
//
// Threads: OpenMP (torch's libgomp), torch's thread count.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cpu_blocks.h"
#include "embed_rows.h"
#include "simd16.h"

namespace {

using namespace simd16;

constexpr int64_t kUnitColumns = 32;  // outputs a unit
constexpr int64_t kUnitRows = 64;     // rows a unit (a prefill's rows come in blocks of this many)
#if defined(__AVX512F__)
constexpr int kRows = 4, kCols = 4;  // 16 sums, 4 weight vectors and a row vector: 21 of 32 zmm
#else
constexpr int kRows = 2, kCols = 2;  // 4 sums of two ymm halves, 2 weight vectors, a row: 14 of 16 ymm
#endif

// The sum of a vector's 16 lanes in one order on both builds: lane i + lane i + 8, then
// reduce_add8's halving.
inline float sum16(V16 a) {
#if defined(__AVX512F__)
  return reduce_add8(_mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1)));
#else
  return reduce_add8(_mm256_add_ps(a.lo, a.hi));
#endif
}

// Rows [0, R) of x times outputs [0, C) of w (rows of K floats), into y (row stride ldy).
template <int R, int C>
inline void tile(const float* x, const float* w, int64_t K, const float* bias, float* y, int64_t ldy) {
  V16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    V16 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vloadu(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const V16 xv = vloadu(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = vfmadd(xv, wv[c], acc[r][c]);
    }
  }
  if (k < K) {  // the last partial vector, zero-filled
    const Mask16 m = static_cast<Mask16>((1u << (K - k)) - 1);
    V16 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vmaskz_loadu(m, w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const V16 xv = vmaskz_loadu(m, x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = vfmadd(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * ldy + c] = sum16(acc[r][c]) + (bias != nullptr ? bias[c] : 0.0f);
}

// Rows [0, rows) of x times outputs [0, cols) of w: tiles of kRows x kCols, smaller at the edges.
void block(const float* x, int64_t rows, const float* w, int64_t cols, int64_t K, const float* bias, float* y,
           int64_t ldy) {
  int64_t n = 0;
  const auto columns = [&](auto C) {
    treeserve_cpu::over_row_chunks<kRows>(rows, [&](auto R, int64_t m) {
      tile<decltype(R)::value, decltype(C)::value>(x + m * K, w + n * K, K, bias != nullptr ? bias + n : nullptr,
                                                   y + m * ldy + n, ldy);
    });
  };
  for (; n + kCols <= cols; n += kCols) columns(std::integral_constant<int, kCols>{});
  for (; n < cols; ++n) columns(std::integral_constant<int, 1>{});
}

at::Tensor mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "treeserve_dense::mm: x must be 2-D float32");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "treeserve_dense::mm: weight must be a contiguous float32 (N, K) with x's K");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              "treeserve_dense::mm: bias must be empty or N float32");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.numel() != 0 ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t column_units = (N + kUnitColumns - 1) / kUnitColumns, row_blocks = (M + kUnitRows - 1) / kUnitRows;
  const int64_t units = column_units * row_blocks;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units)));
  std::atomic<int64_t> claimed{0};
#pragma omp parallel num_threads(threads)
  for (int64_t u = claimed.fetch_add(1, std::memory_order_relaxed); u < units;
       u = claimed.fetch_add(1, std::memory_order_relaxed)) {
    // Row block outermost: a prefill's row block stays in L2 while its units go by.
    const int64_t m0 = u / column_units * kUnitRows, n0 = u % column_units * kUnitColumns;
    block(xp + m0 * K, std::min(kUnitRows, M - m0), wp + n0 * K, std::min(kUnitColumns, N - n0), K,
          bp != nullptr ? bp + n0 : nullptr, yp + m0 * N + n0, N);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(treeserve_dense, m) {
  m.def("mm(Tensor x, Tensor weight, Tensor bias) -> Tensor");
  m.def("embed_rows(Tensor ids, Tensor codes, Tensor scales, Tensor zeros, int kind, int N, int K) -> Tensor");
}

TORCH_LIBRARY_IMPL(treeserve_dense, CPU, m) {
  m.impl("mm", mm);
  m.impl("embed_rows", embed_rows);
}

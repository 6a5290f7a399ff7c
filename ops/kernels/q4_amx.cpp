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
// the vector path at every row count); with int8_rows, the int8-row path (q4_amx_int8.h) at every row
// count, which the format asks for wherever the CPU has AVX512-VNNI (a row's sums are then the
// same bits at every row count). Both prefetch the codes a few groups ahead (without it a
// one-row step read them 1.2x slower, measured). treeserve_q4::q8g_mm (codes8, q4_amx_codes8.h) takes
// GGUF's 8-bit-code block types on the same int8 rows.
//
// The parts: q4_amx_groups.h (what every path shares), q4_amx_bf16.h (the tiles and the vector
// path), q4_amx_int8.h (int8 rows) and q4_amx_codes8.h (q8g_mm); here the CPU check, mm (which
// picks the path) and the ops' registration.

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
#include "q4_amx_groups.h"
#include "q4_amx_bf16.h"
#include "q4_amx_int8.h"
#include "q4_amx_codes8.h"

extern "C" {

// treeserve_amx::init's mask: 0 when this CPU lacks AVX512-BF16 (the caller must not call the
// op); kVectors alone where it has no AMX tiles for this process (the op then runs the vector
// path at every row count); kVectors | kTiles where both run; kVnni where the int8-row path may.
int ts_q4_amx_init(void) { return treeserve_amx::init(true); }

}  // extern "C"

namespace {

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

}  // namespace

TORCH_LIBRARY(treeserve_q4, m) {
  m.def("mm(Tensor x, Tensor codes, Tensor scales_zeros, int out_features, int min_rows, bool int8_rows) -> Tensor");
  m.def("q8g_mm(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int out_features, bool float_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(treeserve_q4, CPU, m) {
  m.impl("mm", mm);
  m.impl("q8g_mm", q8g_mm);
}

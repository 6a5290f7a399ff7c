// The int formats' kernels for CPUs with AVX2 but no AVX-512 (AMD's Zen 1-3, Intel's client
// cores before Ice Lake...): the same packings and the same weight values as q4_amx.cpp and
// q8_amx.cpp, which need AVX-512 (this file's ops are what runs where they cannot).
//
// q4_mm: the q4_1 format's linears, int8 rows at every row count, as q4_amx.cpp's int8-row path:
//   y[m, n] = sum_g scale[n, g] * d[m, g] * (sum_{k in g} xq[m, k] * (q[n, k] - 8)) + zero[n, g] * xs[m, g]
// with xq = round(x / d), d = max |x| / 127 per group of 32 (llama.cpp's Q8_0 blocks) and xs the
// exact fp32 sum of the group's bf16 x. vpmaddubsw multiplies the 4-bit codes (u8, 0..15) by xq
// (s8) in pairs into int16 (at most 2 * 15 * 127 = 3810 a pair, so a group's eight products
// add up in int16 without saturating: 30480, with vpaddw); vpmaddwd widens a group's sums to
// int32, exactly. Each running sum is pinned to a register (`pinned`): left free, GCC
// reassociated the adds, computed all 32 products of a 4-row pass first and spilled them. (The
// saturating vpaddsw, which it cannot reassociate, did the same job before, but on Zen 4 it
// shares the two multiply pipes: one vpmaddubsw a cycle beside it, against 1.6 beside vpaddw;
// a 16-row pass over the default model's linears went from 18.4 to 13.5 ms.)
//
// q8_mm: the LM head (Q8_0 codes, float16 d per 32), int16 rows: each group of 32 x as int16
// codes under a power-of-two scale (quantize_row16: exact for every x within 2^8 of the group's
// largest, which bf16's 8 significant bits make the common case; the rest off by at most 2^-15
// of the largest), vpmaddwd against the codes widened to int16 (exact int32 dots), then
// y += float(dot) * (d_w * d_x) in fp32 per group, d_w * d_x exact (quantize_row16 and
// q8_rows). vpmaddwd gives 16 products an instruction where an fp32 FMA gives 8, and an int8
// product of two signed codes would need vpsignb and a vpmaddwd after each vpmaddubsw: this is
// 1.5-1.9x the fp32 head it replaced from 2 rows on (16 rows 8.1 -> 4.5 ms, 64 rows 24.1 ->
// 16.3), and no slower at one row.
//
// q8g_mm: signed 8-bit codes by group (GGUF's Q8_0, Q5_0, Q5_1, Q5_K, Q6_K), q4_amx.cpp's codes8
// on int8 rows, the same bits (codes8, q_avx2_codes8.h).
//
// Layouts: as q4_amx.cpp (codes [N/32][K/32][2 tiles][8 row pairs][32 lanes] bytes, scales and
// zeros [N/32][K/32][2][32] bf16) and q8_amx.cpp (codes [N/32][K/32][2][16 tile rows][32 lanes]
// int8, scales [N/32][K/32][32] float16). q4_mm returns bf16 (M, N), q8_mm fp32 (M, N).
// Every row is computed by the same operations in the same order whatever the row count, so a
// row's result has the same bits in a batch of 1 and of 64. Threads: torch's (OpenMP).
//
// The parts: q_avx2_rows.h (what the products share: a row's int8 quantization), q_avx2_q4.h
// (q4_mm), q_avx2_q8.h (q8_mm) and q_avx2_codes8.h (q8g_mm); here the CPU check and the ops'
// registration.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "cpu_blocks.h"
#include "codes5.h"
#include "simd16.h"  // its AVX2 backend: this file is built without AVX-512
#include "q_avx2_rows.h"
#include "q_avx2_q4.h"
#include "q_avx2_q8.h"
#include "q_avx2_codes8.h"

extern "C" {

// 1 where this CPU has AVX2, FMA and F16C (what this file is compiled for), else 0 (the caller
// must not call the ops).
int ts_avx2_init(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const bool fma = (c >> 12) & 1, f16c = (c >> 29) & 1, osxsave = (c >> 27) & 1;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
  const bool avx2 = (b >> 5) & 1;
  return fma && f16c && osxsave && avx2 ? 1 : 0;
}

}  // extern "C"

TORCH_LIBRARY(treeserve_avx2, m) {
  m.def("q4_mm(Tensor x, Tensor codes, Tensor scales_zeros, int out_features) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor");
  m.def("q8g_mm(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int out_features, bool float_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(treeserve_avx2, CPU, m) {
  m.impl("q4_mm", q4_mm);
  m.impl("q8_mm", q8_mm);
  m.impl("q8g_mm", q8g_mm);
}

// How the CPU kernels (q4_amx.cpp, q8_amx.cpp, q_avx2.cpp) split their work: output blocks over
// torch's threads, and a block's rows into chunks whose row count is a template argument (so a
// chunk's sums stay in registers); and the checks their twin ops share. Header-only, no
// instruction-set code.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <omp.h>
#include <xmmintrin.h>  // _mm_prefetch (SSE: every x86-64 build)
#include <stdint.h>

#include <type_traits>

namespace treeserve_cpu {

// body(begin, end) on torch's threads, output blocks [0, NB) split evenly.
template <class Body>
void over_blocks(int64_t NB, Body body) {
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t chunk = (NB + nt - 1) / nt, begin = t * chunk, end = begin + chunk < NB ? begin + chunk : NB;
    if (begin < end) body(begin, end);
  }
}

// body(std::integral_constant<int, R>, m) for each chunk of at most Max rows of M: the row
// count as a template argument (1..Max).
template <int Max, int R = Max, class Body>
inline void over_row_chunks(int64_t M, Body body) {
  if constexpr (R == Max) {
    int64_t m = 0;
    for (; m + Max <= M; m += Max) body(std::integral_constant<int, Max>{}, m);
    if (m < M) over_row_chunks<Max, Max - 1>(M - m, [&](auto rows, int64_t offset) { body(rows, m + offset); });
  } else if constexpr (R >= 1) {
    if (M == R) body(std::integral_constant<int, R>{}, int64_t{0});
    else over_row_chunks<Max, R - 1>(M, body);
  }
}

// The arguments of an 8-bit-code product, q8g_mm (q4_amx.cpp and q_avx2.cpp build one each, see
// kernels/codes8.py), checked for ``op``: bf16 rows x (M, K), the packed codes of an (N, K)
// weight (int8, a byte each; or five bits each, int8 or uint8: codes5.h), float32 scales per 16
// or 32 weights, float32 zeros per 32 or none.
struct Codes8Layout {
  bool halves;      // scales per 16 weights (else per 32)
  bool with_zeros;  // a zero per 32 weights
  bool five_bits;   // codes packed at five bits (codes5.h), else one byte each
  int8_t offset;    // five bits: what a field less is its code (16 for int8 codes, 0 for uint8)
};

constexpr int64_t kCodes8Bytes = 8 * 16 * 4;  // the codes of one group of 32 k for one 16-column block
constexpr int64_t kCodes8PrefetchGroups = 8;   // as the q4 paths' kPrefetchGroups: codes read 4 KB ahead

// The codes, scales and zeros (z, or none) of the group kCodes8PrefetchGroups groups after
// (src, s, z) into L1; scale_floats: the floats of a group's scales (16, or 32 for scales per 16).
inline void prefetch_codes8(const int8_t* src, const float* s, int64_t scale_floats, const float* z) {
  for (int line = 0; line < kCodes8Bytes / 64; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(src + kCodes8PrefetchGroups * kCodes8Bytes + line * 64), _MM_HINT_T0);
  for (int64_t line = 0; line < scale_floats / 16; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(s + kCodes8PrefetchGroups * scale_floats + line * 16), _MM_HINT_T0);
  if (z != nullptr) _mm_prefetch(reinterpret_cast<const char*>(z + kCodes8PrefetchGroups * 16), _MM_HINT_T0);
}

inline Codes8Layout check_codes8(const char* op, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                 const at::Tensor& zeros, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be 2-D bfloat16");
  const int64_t K = x.size(1);
  const bool five_bits = codes.numel() * 8 == N * K * 5;
  TORCH_CHECK(K % 32 == 0 && N % 16 == 0 && (codes.numel() == N * K || five_bits) &&
                  (codes.scalar_type() == at::kChar || (five_bits && codes.scalar_type() == at::kByte)) &&
                  codes.is_contiguous() && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  zeros.scalar_type() == at::kFloat && zeros.is_contiguous(),
              op, ": the packing does not fit x");
  const bool halves = scales.numel() * 16 == N * K;
  TORCH_CHECK(halves || scales.numel() * 32 == N * K, op, ": scales must be per 32 or per 16 weights");
  const bool with_zeros = zeros.numel() != 0;
  TORCH_CHECK(!with_zeros || zeros.numel() * 32 == N * K, op, ": zeros must be per 32 weights");
  return {halves, with_zeros, five_bits, static_cast<int8_t>(codes.scalar_type() == at::kChar ? 16 : 0)};
}

}  // namespace treeserve_cpu

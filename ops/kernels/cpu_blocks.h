// How the CPU kernels (q4_amx.cpp, q8_amx.cpp, q_avx2.cpp) split their work: output blocks over
// torch's threads, and a block's rows into chunks whose row count is a template argument (so a
// chunk's sums stay in registers). Header-only, no instruction-set code.

#pragma once

#include <ATen/Parallel.h>
#include <omp.h>
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

}  // namespace treeserve_cpu

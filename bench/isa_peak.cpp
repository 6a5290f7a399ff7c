// Instruction throughput probes for bench/q4_kernel.py (x86 with AVX2 and FMA): the clock, and how
// many of the kernels' multiply instructions the cores retire a second, alone and beside the add
// that accumulates their products, so the kernels' rates can be read against this CPU's ceiling.
// Each loop body is inline assembly on registers only (no loads, no dependency between the
// multiplies), so nothing but the execution ports limits it.

#include <omp.h>

#include <chrono>

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Eight independent instructions `op` (into ymm0-7, from ymm10-15), and four vpmaddubsw each
// followed by `add` of its products into a running sum (ymm4-7).
#define EIGHT(op)                                                                                \
  op " %%ymm14, %%ymm15, %%ymm0\n" op " %%ymm13, %%ymm15, %%ymm1\n" op " %%ymm14, %%ymm12, %%ymm2\n" \
  op " %%ymm13, %%ymm12, %%ymm3\n" op " %%ymm14, %%ymm11, %%ymm4\n" op " %%ymm13, %%ymm11, %%ymm5\n" \
  op " %%ymm14, %%ymm10, %%ymm6\n" op " %%ymm13, %%ymm10, %%ymm7\n"
#define FOUR_ADDED(add)                                                                              \
  "vpmaddubsw %%ymm14, %%ymm15, %%ymm0\n vpmaddubsw %%ymm13, %%ymm15, %%ymm1\n"                     \
  "vpmaddubsw %%ymm14, %%ymm12, %%ymm2\n vpmaddubsw %%ymm13, %%ymm12, %%ymm3\n" add " %%ymm0, %%ymm4, %%ymm4\n" \
  add " %%ymm1, %%ymm5, %%ymm5\n" add " %%ymm2, %%ymm6, %%ymm6\n" add " %%ymm3, %%ymm7, %%ymm7\n"
#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7"

// Kinds 0, 3, 4: eight multiplies an iteration (an FMA accumulates into its destination: eight
// chains, enough for two a cycle at a latency of 4); kinds 1 and 2: FOUR_ADDED. One loop a kind,
// so no branch but the loop's own.
#define LOOP(body)                                           \
  for (long i = 0; i < n; ++i) asm volatile(body ::: CLOBBERS); \
  return

void loop(int kind, long n) {
  switch (kind) {
    case 0: LOOP(EIGHT("vpmaddubsw"));
    case 1: LOOP(FOUR_ADDED("vpaddsw"));
    case 2: LOOP(FOUR_ADDED("vpaddw"));
    case 3: LOOP(EIGHT("vpmaddwd"));
    default: LOOP(EIGHT("vfmadd231ps"));
  }
}

}  // namespace

extern "C" {

// The clock in GHz: eight dependent scalar adds an iteration retire one a cycle.
double ts_clock_ghz(long n) {
  const auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i)
    asm volatile("add $1, %%rax\n add $1, %%rax\n add $1, %%rax\n add $1, %%rax\n"
                 "add $1, %%rax\n add $1, %%rax\n add $1, %%rax\n add $1, %%rax\n" ::
                     : "rax");
  return 8.0 * n / seconds_since(start) / 1e9;
}

// Multiply instructions of `kind` (0: vpmaddubsw; 1: vpmaddubsw + vpaddsw; 2: vpmaddubsw +
// vpaddw; 3: vpmaddwd; 4: vfmadd231ps) retired a second by `threads` threads, n iterations each.
double ts_multiply_rate(int kind, long n, int threads) {
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  loop(kind, n);
  const double per_iteration = kind == 1 || kind == 2 ? 4.0 : 8.0;
  return per_iteration * n * threads / seconds_since(start);
}

}  // extern "C"

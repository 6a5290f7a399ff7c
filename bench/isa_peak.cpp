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

// Eight multiplies of one kind an iteration (kinds 0, 3, 4), or four vpmaddubsw each followed by
// the add of its products into a running sum (kinds 1 and 2).
void loop(int kind, long n) {
  for (long i = 0; i < n; ++i) {
    switch (kind) {
      case 0:
        asm volatile(
            "vpmaddubsw %%ymm14, %%ymm15, %%ymm0\n vpmaddubsw %%ymm13, %%ymm15, %%ymm1\n"
            "vpmaddubsw %%ymm14, %%ymm12, %%ymm2\n vpmaddubsw %%ymm13, %%ymm12, %%ymm3\n"
            "vpmaddubsw %%ymm14, %%ymm11, %%ymm4\n vpmaddubsw %%ymm13, %%ymm11, %%ymm5\n"
            "vpmaddubsw %%ymm14, %%ymm10, %%ymm6\n vpmaddubsw %%ymm13, %%ymm10, %%ymm7\n" ::
                : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7");
        break;
      case 1:
        asm volatile(
            "vpmaddubsw %%ymm14, %%ymm15, %%ymm0\n vpmaddubsw %%ymm13, %%ymm15, %%ymm1\n"
            "vpmaddubsw %%ymm14, %%ymm12, %%ymm2\n vpmaddubsw %%ymm13, %%ymm12, %%ymm3\n"
            "vpaddsw %%ymm0, %%ymm4, %%ymm4\n vpaddsw %%ymm1, %%ymm5, %%ymm5\n"
            "vpaddsw %%ymm2, %%ymm6, %%ymm6\n vpaddsw %%ymm3, %%ymm7, %%ymm7\n" ::
                : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7");
        break;
      case 2:
        asm volatile(
            "vpmaddubsw %%ymm14, %%ymm15, %%ymm0\n vpmaddubsw %%ymm13, %%ymm15, %%ymm1\n"
            "vpmaddubsw %%ymm14, %%ymm12, %%ymm2\n vpmaddubsw %%ymm13, %%ymm12, %%ymm3\n"
            "vpaddw %%ymm0, %%ymm4, %%ymm4\n vpaddw %%ymm1, %%ymm5, %%ymm5\n"
            "vpaddw %%ymm2, %%ymm6, %%ymm6\n vpaddw %%ymm3, %%ymm7, %%ymm7\n" ::
                : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7");
        break;
      case 3:
        asm volatile(
            "vpmaddwd %%ymm14, %%ymm15, %%ymm0\n vpmaddwd %%ymm13, %%ymm15, %%ymm1\n"
            "vpmaddwd %%ymm14, %%ymm12, %%ymm2\n vpmaddwd %%ymm13, %%ymm12, %%ymm3\n"
            "vpmaddwd %%ymm14, %%ymm11, %%ymm4\n vpmaddwd %%ymm13, %%ymm11, %%ymm5\n"
            "vpmaddwd %%ymm14, %%ymm10, %%ymm6\n vpmaddwd %%ymm13, %%ymm10, %%ymm7\n" ::
                : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7");
        break;
      default:  // eight independent FMA chains (latency 4, so two a cycle need eight)
        asm volatile(
            "vfmadd231ps %%ymm14, %%ymm15, %%ymm0\n vfmadd231ps %%ymm14, %%ymm15, %%ymm1\n"
            "vfmadd231ps %%ymm14, %%ymm15, %%ymm2\n vfmadd231ps %%ymm14, %%ymm15, %%ymm3\n"
            "vfmadd231ps %%ymm14, %%ymm15, %%ymm4\n vfmadd231ps %%ymm14, %%ymm15, %%ymm5\n"
            "vfmadd231ps %%ymm14, %%ymm15, %%ymm6\n vfmadd231ps %%ymm14, %%ymm15, %%ymm7\n" ::
                : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7");
    }
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

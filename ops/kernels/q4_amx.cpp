// 4-bit group-32 weight GEMM on AMX tiles for several rows at once (trees, batches, prefill).
//
//   y[m, n] = sum_k x[m, k] * w[n, k],  w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g],  g = k / 32
//
// computed as  sum_g scale[n, g] * (sum_{k in g} x[m, k] * (q[n, k] - 8)) + zero[n, g] * (sum_{k in g} x[m, k]).
// The codes q - 8 are small integers, exact in bf16, and one group of 32 is exactly the K depth of
// one bf16 AMX tile, so each tile product is a group's exact partial sum (accumulated in fp32),
// which is then scaled in fp32. The weight values are therefore the same real numbers that
// torch's _weight_int4pack_mm_for_cpu dequantizes (the one-row kernel of the q4_1 format); only
// the float summation order differs. Nothing here rounds a weight to bf16.
//
// Layouts (built by treeserve.ops.kernels.q4_amx.pack):
//   x      (M, K) bf16, row-major
//   codes  [N/32][K/32][2 tiles][8 row pairs][32 lanes] bytes. Tile h holds columns
//          h*16..h*16+15 of the 32-column block in the VNNI layout of a bf16 B tile: lane
//          2*c + j of tile row r is weight k = 2*r + j of column c. Byte (p, lane) carries tile
//          row 2p in its low nibble and row 2p+1 in its high nibble.
//   sz     [N/32][K/32][2][32] float32: the 32 columns' scales, then their zeros.
//   y      (M, N) bf16, row-major (fp32 accumulators rounded to nearest even).
// Requires K % 32 == 0 and N % 32 == 0. Threads: OpenMP (torch's own libgomp), torch's thread count.
//
// The op treeserve_q4::mm (registered below) is what the q4_1 format calls at every shape: under
// min_rows rows it runs torch's one-row kernel on that kernel's own packing of the same codes,
// scales and zeros; from min_rows rows on, the AMX tiles. Being a dispatcher op, it costs a
// compiled graph no more per call than the aten op it wraps.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
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

}  // namespace

extern "C" {

// 1 when this CPU has AMX-BF16 tiles and AVX512-BF16 and the kernel granted this process the
// tile state (Linux arch_prctl); 0 otherwise, and the caller must not call ts_q4_gemm.
int ts_q4_amx_init(void) { return treeserve_amx::init_amx() ? 1 : 0; }

}  // extern "C"

namespace {

// Output blocks [nb_begin, nb_end) of 32 columns, on one thread (arguments by value, so the
// compiler knows no store aliases them).
void gemm_blocks(const uint16_t* xa, const float* xs, const int64_t M, const int64_t K, const int64_t N,
                 const uint8_t* codes, const float* sz, uint16_t* y, const int64_t nb_begin, const int64_t nb_end) {
  const int64_t G = K / 32, MT = (M + 15) / 16, Mp = MT * 16;
  const __m512i table = code_table();
  configure_tiles();
  alignas(64) uint16_t bbuf[2][16 * 32];
  alignas(64) float cbuf[2][16 * 16];
  float* acc = static_cast<float*>(aligned_alloc(64, Mp * 32 * 4));
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    memset(acc, 0, Mp * 32 * 4);
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* src = codes + (nb * G + g) * 512;
      expand_tile(src, bbuf[0], table);
      expand_tile(src + 256, bbuf[1], table);
      _tile_loadd(3, bbuf[0], 64);
      _tile_loadd(4, bbuf[1], 64);
      const float* s = sz + (nb * G + g) * 64;
      const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
      const __m512 z0 = _mm512_loadu_ps(s + 32), z1 = _mm512_loadu_ps(s + 48);
      for (int64_t mt = 0; mt < MT; ++mt) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(2, xa + mt * 16 * K + g * 32, K * 2);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
        _tile_stored(0, cbuf[0], 64);
        _tile_stored(1, cbuf[1], 64);
        const int64_t valid = M - mt * 16 < 16 ? M - mt * 16 : 16;
        for (int64_t r = 0; r < valid; ++r) {
          const int64_t m = mt * 16 + r;
          float* a = acc + m * 32;
          const __m512 sums = _mm512_set1_ps(xs[m * G + g]);
          __m512 a0 = _mm512_fmadd_ps(_mm512_load_ps(cbuf[0] + r * 16), s0, _mm512_load_ps(a));
          __m512 a1 = _mm512_fmadd_ps(_mm512_load_ps(cbuf[1] + r * 16), s1, _mm512_load_ps(a + 16));
          _mm512_store_ps(a, _mm512_fmadd_ps(sums, z0, a0));
          _mm512_store_ps(a + 16, _mm512_fmadd_ps(sums, z1, a1));
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      uint16_t* out = y + m * N + nb * 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + m * 32)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + m * 32 + 16)));
    }
  }
  free(acc);
  _tile_release();
}

void gemm(const uint16_t* x, int64_t M, int64_t K, int64_t N, const uint8_t* codes, const float* sz, uint16_t* y) {
  const int64_t G = K / 32, NB = N / 32, MT = (M + 15) / 16, Mp = MT * 16;
  // Rows padded to whole tiles, and each row's per-group sums (the zero term's factor).
  uint16_t* xa = static_cast<uint16_t*>(aligned_alloc(64, ((Mp * K * 2 + 63) / 64) * 64));
  float* xs = static_cast<float*>(aligned_alloc(64, ((Mp * G * 4 + 63) / 64) * 64));
  memcpy(xa, x, M * K * 2);
  memset(xa + M * K, 0, (Mp - M) * K * 2);
  for (int64_t m = 0; m < Mp; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* row = xa + m * K + g * 32;
      xs[m * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(bf16x16_to_f32(row), bf16x16_to_f32(row + 16)));
    }
  }
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t chunk = (NB + nt - 1) / nt, begin = t * chunk, end = begin + chunk < NB ? begin + chunk : NB;
    if (begin < end) gemm_blocks(xa, xs, M, K, N, codes, sz, y, begin, end);
  }
  free(xa);
  free(xs);
}

at::Tensor mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_zeros, const at::Tensor& row_packed,
              const at::Tensor& row_scales_zeros, int64_t out_features, int64_t min_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "treeserve_q4::mm: x must be 2-D bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  if (M < min_rows) return at::_weight_int4pack_mm_for_cpu(x, row_packed, 32, row_scales_zeros);
  TORCH_CHECK(K % 32 == 0 && N % 32 == 0 && codes.numel() * 2 == N * K && codes.is_contiguous() &&
                  scales_zeros.is_contiguous() && scales_zeros.numel() == N * (K / 32) * 2,
              "treeserve_q4::mm: the AMX packing does not fit x");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  gemm(reinterpret_cast<const uint16_t*>(xc.data_ptr()), M, K, N, codes.data_ptr<uint8_t>(),
       scales_zeros.data_ptr<float>(), reinterpret_cast<uint16_t*>(y.data_ptr()));
  return y;
}

}  // namespace

TORCH_LIBRARY(treeserve_q4, m) {
  m.def("mm(Tensor x, Tensor codes, Tensor scales_zeros, Tensor row_packed, Tensor row_scales_zeros, "
        "int out_features, int min_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(treeserve_q4, CPU, m) { m.impl("mm", mm); }

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
// on int8 rows, the same bits (codes8, at the end).
//
// Layouts: as q4_amx.cpp (codes [N/32][K/32][2 tiles][8 row pairs][32 lanes] bytes, scales and
// zeros [N/32][K/32][2][32] bf16) and q8_amx.cpp (codes [N/32][K/32][2][16 tile rows][32 lanes]
// int8, scales [N/32][K/32][32] float16). q4_mm returns bf16 (M, N), q8_mm fp32 (M, N).
// Every row is computed by the same operations in the same order whatever the row count, so a
// row's result has the same bits in a batch of 1 and of 64. Threads: torch's (OpenMP).

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

namespace {

using treeserve_cpu::over_blocks;
using treeserve_cpu::over_row_chunks;

using simd16::bf16_round8;
using simd16::bf16x8;
using simd16::reduce_add8;
using simd16::reduce_max8;

// v, kept in a register as it is here: GCC may not reassociate a chain of integer adds through
// it (see the file's comment).
inline __m256i pinned(__m256i v) {
  asm("" : "+x"(v));
  return v;
}

inline int32_t reduce_add_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// ---------------------------------------------------------------------------------------------
// q4_1

constexpr int64_t kQ4BlockBytes = 2 * 8 * 32;  // codes of one 32-column block for one group
constexpr int64_t kPrefetchGroups = 8;
constexpr int kQ4Rows = 4;  // rows multiplied together (their int16 sums in registers)

// A group of 32 bf16 x widened to fp32 (v, exact), their largest |x| and their fp32 sum. max_ps
// drops a NaN operand in favour of the other, so only the sum is sure to carry a NaN (or inf).
inline void load_group(const uint16_t* x, __m256 v[4], float& amax, float& total) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) v[i] = bf16x8(x + i * 8);
  amax = reduce_max8(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
  total = reduce_add8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
}

// One row's groups, as q4_amx.cpp's quantize_row: xq (K int8), d, -8 d sum(xq), and xs (the
// exact sum of the group's x). A group whose largest |x| is under 1e-30 counts as zero in the
// codes' term; NaN and inf rows stay non-finite through d and xs.
void quantize_row(const uint16_t* x, int64_t K, int8_t* xq, float* d, float* c8, float* xs) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < K / 32; ++g) {
    __m256 v[4];
    float amax, total;
    load_group(x + g * 32, v, amax, total);
    const bool tiny = amax < 1e-30f;
    const float scale = tiny ? 0.0f : amax / 127.0f, inverse = tiny ? 0.0f : 127.0f / amax;
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));  // nearest even
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * 32), _mm256_permutevar8x32_epi32(bytes, order));
    const int32_t qsum = reduce_add_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    // A NaN or inf x: total is non-finite, and so is every output of the row (via xs * zero).
    d[g] = scale;
    c8[g] = -8.0f * scale * static_cast<float>(qsum);
    xs[g] = total;
  }
}

// 32 codes of 8 columns of one tile row pair (16 bytes) -> the u8 operand of vpmaddubsw, the
// four codes of a column in k order in its 32-bit lane (see q4_amx.cpp's codes_u8).
inline __m256i codes_u8(const uint8_t* src) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi32(v, 12)), _mm256_set1_epi32(0x0F0F0F0F));
}

// The codes and scales/zeros of the group kPrefetchGroups groups after (src, s), into L1.
inline void prefetch_q4_group(const uint8_t* src, const uint16_t* s) {
  for (int line = 0; line < kQ4BlockBytes / 64; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchGroups * kQ4BlockBytes + line * 64), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(s + kPrefetchGroups * 64), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(s + kPrefetchGroups * 64 + 32), _MM_HINT_T0);
}

void q4_blocks(const int8_t* xq, const float* d, const float* c8, const float* xs, int64_t M, int64_t K, int64_t N,
               const uint8_t* codes, const uint16_t* sz, uint16_t* y, int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  float* acc = static_cast<float*>(aligned_alloc(64, M * 32 * 4));
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    memset(acc, 0, M * 32 * 4);
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* src = codes + (nb * G + g) * kQ4BlockBytes;
      const uint16_t* s = sz + (nb * G + g) * 64;
      prefetch_q4_group(src, s);
      for (int quarter = 0; quarter < 4; ++quarter) {  // columns quarter*8 .. +7: tile quarter/2, half quarter%2
        const uint8_t* base = src + (quarter / 2) * 256 + (quarter % 2) * 16;
        __m256i w[8];
        for (int p = 0; p < 8; ++p) w[p] = codes_u8(base + p * 32);
        const __m256 scale = bf16x8(s + quarter * 8), zero = bf16x8(s + 32 + quarter * 8);
        over_row_chunks<kQ4Rows>(M, [&](auto rows, int64_t m0) {
          constexpr int R = decltype(rows)::value;
          __m256i dot[R];
          for (int m = 0; m < R; ++m) dot[m] = _mm256_setzero_si256();
          for (int p = 0; p < 8; ++p) {
            for (int m = 0; m < R; ++m) {
              int32_t four;
              memcpy(&four, xq + (m0 + m) * K + g * 32 + 4 * p, sizeof(four));
              dot[m] = pinned(_mm256_add_epi16(dot[m], _mm256_maddubs_epi16(w[p], _mm256_set1_epi32(four))));
            }
          }
          for (int m = 0; m < R; ++m) {
            const int64_t row = (m0 + m) * G + g;
            const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dot[m], ones)), _mm256_set1_ps(d[row]),
                                             _mm256_set1_ps(c8[row]));
            float* a = acc + (m0 + m) * 32 + quarter * 8;
            _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(xs[row]), zero, _mm256_fmadd_ps(t, scale, _mm256_load_ps(a))));
          }
        });
      }
    }
    for (int64_t m = 0; m < M; ++m)
      for (int q = 0; q < 4; ++q)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + m * N + nb * 32 + q * 8), bf16_round8(_mm256_load_ps(acc + m * 32 + q * 8)));
  }
  free(acc);
}

// A decode-sized step (at most kQ4Rows rows), the same sums with fewer instructions: a tile's
// 32-byte row of codes holds 16 columns' four codes each (byte 2c = k0 | k2 << 4, byte 2c + 1 =
// k1 | k3 << 4, column c's bytes), so one mask gives vpmaddubsw's u8 operand for (k0, k1) of
// all 16 columns and a shift and a mask the one for (k2, k3), against x's pairs (x[4p], x[4p + 1])
// and (x[4p + 2], x[4p + 3]) broadcast from the quantized row as they are needed (a buffer of
// pre-broadcast pairs is 32x the row and falls out of L1 at two rows: slower, measured).
// The two int16 sums of a column (each at most 8 * 3810 = 30480) are added in int32, so every
// column's integer dot is q4_blocks' exactly, and the fp32 operations after it are the same:
// the same bits as the row would get in a larger batch.
template <int R>
void q4_blocks_few(const int8_t* xq, const float* d, const float* c8, const float* xs, int64_t K, int64_t N,
                   const uint8_t* codes, const uint16_t* sz, uint16_t* y, int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    alignas(32) float acc[R][32];
    for (int m = 0; m < R; ++m)
      for (int q = 0; q < 4; ++q) _mm256_store_ps(acc[m] + q * 8, _mm256_setzero_ps());
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* src = codes + (nb * G + g) * kQ4BlockBytes;
      const uint16_t* s = sz + (nb * G + g) * 64;
      prefetch_q4_group(src, s);
      for (int tile = 0; tile < 2; ++tile) {  // columns tile*16 .. +15
        __m256i lo[R], hi[R];
        for (int m = 0; m < R; ++m) lo[m] = hi[m] = _mm256_setzero_si256();
        for (int p = 0; p < 8; ++p) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + tile * 256 + p * 32));
          const __m256i k01 = _mm256_and_si256(v, low), k23 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int m = 0; m < R; ++m) {
            const int8_t* x = xq + m * K + g * 32 + 4 * p;
            int16_t p01, p23;
            memcpy(&p01, x, 2);
            memcpy(&p23, x + 2, 2);
            lo[m] = pinned(_mm256_add_epi16(lo[m], _mm256_maddubs_epi16(k01, _mm256_set1_epi16(p01))));
            hi[m] = pinned(_mm256_add_epi16(hi[m], _mm256_maddubs_epi16(k23, _mm256_set1_epi16(p23))));
          }
        }
        for (int m = 0; m < R; ++m) {
          const __m256i a = _mm256_madd_epi16(_mm256_unpacklo_epi16(lo[m], hi[m]), ones);  // columns 0-3, 8-11
          const __m256i b = _mm256_madd_epi16(_mm256_unpackhi_epi16(lo[m], hi[m]), ones);  // columns 4-7, 12-15
          const __m256i dots[2] = {_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31)};
          const int64_t row = m * G + g;
          for (int h = 0; h < 2; ++h) {
            const int quarter = tile * 2 + h;
            const __m256 scale = bf16x8(s + quarter * 8), zero = bf16x8(s + 32 + quarter * 8);
            const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[h]), _mm256_set1_ps(d[row]), _mm256_set1_ps(c8[row]));
            float* out = acc[m] + quarter * 8;
            _mm256_store_ps(out, _mm256_fmadd_ps(_mm256_set1_ps(xs[row]), zero, _mm256_fmadd_ps(t, scale, _mm256_load_ps(out))));
          }
        }
      }
    }
    for (int m = 0; m < R; ++m)
      for (int q = 0; q < 4; ++q)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + m * N + nb * 32 + q * 8), bf16_round8(_mm256_load_ps(acc[m] + q * 8)));
  }
}

at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_zeros, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "treeserve_avx2::q4_mm: x must be 2-D bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, G = K / 32;
  TORCH_CHECK(K % 32 == 0 && N % 32 == 0 && codes.numel() * 2 == N * K && codes.is_contiguous() &&
                  scales_zeros.is_contiguous() && scales_zeros.scalar_type() == at::kBFloat16 &&
                  scales_zeros.numel() == N * G * 2,
              "treeserve_avx2::q4_mm: the packing does not fit x");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  int8_t* xq = static_cast<int8_t*>(aligned_alloc(64, ((M * K + 63) / 64) * 64));
  float* f = static_cast<float*>(aligned_alloc(64, ((3 * M * G * 4 + 63) / 64) * 64));
  float *d = f, *c8 = f + M * G, *xs = f + 2 * M * G;
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, xq + m * K, d + m * G, c8 + m * G, xs + m * G);
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  if (M <= kQ4Rows) {
    over_blocks(N / 32, [&](int64_t begin, int64_t end) {
      switch (M) {
        case 1: return q4_blocks_few<1>(xq, d, c8, xs, K, N, cp, sp, yp, begin, end);
        case 2: return q4_blocks_few<2>(xq, d, c8, xs, K, N, cp, sp, yp, begin, end);
        case 3: return q4_blocks_few<3>(xq, d, c8, xs, K, N, cp, sp, yp, begin, end);
        default: return q4_blocks_few<4>(xq, d, c8, xs, K, N, cp, sp, yp, begin, end);
      }
    });
  } else {
    over_blocks(N / 32, [&](int64_t begin, int64_t end) { q4_blocks(xq, d, c8, xs, M, K, N, cp, sp, yp, begin, end); });
  }
  free(xq);
  free(f);
  return y;
}

// ---------------------------------------------------------------------------------------------
// Q8_0 head

constexpr int64_t kQ8BlockBytes = 2 * 16 * 32;
constexpr int64_t kQ8PrefetchBytes = 4096;
constexpr int kQ8Rows = 2;  // rows a pass: their 2 x 4 int32 sums, the 4 widened code vectors and x fill 14 registers

// One row's groups as int16 codes with a power-of-two scale: d = 2^(e - 14) for the group's
// largest |x| in [2^e, 2^(e+1)), xq = round(x / d), so |xq| <= 32640 and every bf16 x within 2^8
// of the largest is exact (its 8 significant bits sit on the grid); smaller ones are off by at
// most d / 2 = 2^-15 of the largest's power of two. A group of zeros (largest |x| under 1e-30)
// has d = 0; a non-finite group has d = NaN, so its row's outputs are NaN.
void quantize_row16(const uint16_t* x, int64_t K, int16_t* xq, float* d) {
  for (int64_t g = 0; g < K / 32; ++g) {
    __m256 v[4];
    float amax, total;
    load_group(x + g * 32, v, amax, total);
    if (!std::isfinite(total) || !std::isfinite(amax) || amax < 1e-30f) {
      memset(xq + g * 32, 0, 32 * sizeof(int16_t));
      d[g] = std::isfinite(total) && std::isfinite(amax) ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const int e = std::ilogb(amax);
    const __m256 inverse = _mm256_set1_ps(std::ldexp(1.0f, 14 - e));
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // exact scaling, nearest even
    // packs works per 128-bit lane: [q0 lo, q1 lo, q0 hi, q1 hi] -> 0xD8 puts the quarters in order.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * 32), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * 32 + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
    d[g] = std::ldexp(1.0f, e - 14);
  }
}

// The 16 codes of 8 columns x 2 k (half h, tile row r, columns 8v .. 8v+7) as int16, the
// vpmaddwd operand: lane 2c + j is column c's code for k = 2r + j.
inline __m256i codes16(const int8_t* src, int h, int r, int v) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + h * 512 + r * 32 + v * 16)));
}

// Rows m0 .. m0+R-1 over one group of one 32-column block: the int32 dots of their int16 codes
// with the weights' (vpmaddwd, exact: at most 32 * 32640 * 127 < 2^31), then one fp32 step a
// column, acc += float(dot) * (dw * dx) (float(dot) rounds once above 2^24; dw * dx is exact,
// dx being a power of two). `codes(h, r, v)` gives the widened weights; every row count runs
// the same operations per row.
template <int R, class Codes>
inline void q8_rows(const int16_t* xq, const float* dx, int64_t K, int64_t G, int64_t g, const __m256* dw, float* acc,
                    int64_t m0, Codes codes) {
  __m256i dot[R][4];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < 4; ++c) dot[m][c] = _mm256_setzero_si256();
  for (int r = 0; r < 16; ++r) {
    __m256i w[4];
    for (int c = 0; c < 4; ++c) w[c] = codes(c / 2, r, c % 2);
    for (int m = 0; m < R; ++m) {
      int32_t pair;
      memcpy(&pair, xq + (m0 + m) * K + g * 32 + 2 * r, sizeof(pair));
      const __m256i xb = _mm256_set1_epi32(pair);
      for (int c = 0; c < 4; ++c) dot[m][c] = pinned(_mm256_add_epi32(dot[m][c], _mm256_madd_epi16(w[c], xb)));
    }
  }
  for (int m = 0; m < R; ++m) {
    const __m256 x_scale = _mm256_set1_ps(dx[(m0 + m) * G + g]);
    float* a = acc + (m0 + m) * 32;
    for (int c = 0; c < 4; ++c)
      _mm256_store_ps(a + c * 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][c]), _mm256_mul_ps(dw[c], x_scale),
                                                 _mm256_load_ps(a + c * 8)));
  }
}

void q8_blocks(const int16_t* xq, const float* dx, int64_t M, int64_t K, int64_t N, const int8_t* codes,
               const uint16_t* scales, float* y, int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32;
  alignas(64) int16_t wide[2][16][32];  // one group's codes as int16 (M > 1): half, tile row, lane
  float* acc = static_cast<float*>(aligned_alloc(64, M * 32 * 4));
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    memset(acc, 0, M * 32 * 4);
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* src = codes + (nb * G + g) * kQ8BlockBytes;
      for (int line = 0; line < kQ8BlockBytes / 64; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(src + kQ8PrefetchBytes + line * 64), _MM_HINT_T0);
      const uint16_t* s = scales + (nb * G + g) * 32;
      __m256 dw[4];  // columns 8c .. 8c+7
      for (int c = 0; c < 4; ++c) dw[c] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + c * 8)));
      if (M == 1) {  // a decode step: the codes widened in registers as they stream
        q8_rows<1>(xq, dx, K, G, g, dw, acc, 0, [&](int h, int r, int v) { return codes16(src, h, r, v); });
        continue;
      }
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < 16; ++r)
          for (int v = 0; v < 2; ++v)
            _mm256_store_si256(reinterpret_cast<__m256i*>(&wide[h][r][v * 16]), codes16(src, h, r, v));
      const auto widened = [&](int h, int r, int v) {
        return _mm256_load_si256(reinterpret_cast<const __m256i*>(&wide[h][r][v * 16]));
      };
      over_row_chunks<kQ8Rows>(M, [&](auto rows, int64_t m0) {
        q8_rows<decltype(rows)::value>(xq, dx, K, G, g, dw, acc, m0, widened);
      });
    }
    for (int64_t m = 0; m < M; ++m) memcpy(y + m * N + nb * 32, acc + m * 32, 32 * sizeof(float));
  }
  free(acc);
}

at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "treeserve_avx2::q8_mm: x must be 2-D bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, G = K / 32;
  TORCH_CHECK(K % 32 == 0 && N % 32 == 0 && codes.numel() == N * K && codes.scalar_type() == at::kChar &&
                  codes.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.numel() == N * G,
              "treeserve_avx2::q8_mm: the packing does not fit x");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  int16_t* xq = static_cast<int16_t*>(aligned_alloc(64, ((M * K * 2 + 63) / 64) * 64));
  float* dx = static_cast<float*>(aligned_alloc(64, ((M * G * 4 + 63) / 64) * 64));
  for (int64_t m = 0; m < M; ++m) quantize_row16(xp + m * K, K, xq + m * K, dx + m * G);
  const auto* cp = codes.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  float* yp = y.data_ptr<float>();
  over_blocks(N / 32, [&](int64_t begin, int64_t end) { q8_blocks(xq, dx, M, K, N, cp, sp, yp, begin, end); });
  free(xq);
  free(dx);
  return y;
}

// ---------------------------------------------------------------------------------------------
// codes8: signed 8-bit codes by group (GGUF's Q8_0, Q5_0, Q5_1, Q5_K, Q6_K), q4_amx.cpp's
// q8g_mm on AVX2 (see there for the format, the layout and the order of the fp32 steps, which
// this one follows lane for lane: the same bits). The integer dots: vpmaddubsw takes u8 x s8, and
// a code may be any int8, so it gets |code| and xq carrying the code's sign (vpsignb; llama.cpp's
// Q8_0 on AVX2): a pair of products is then at most 2 * 128 * 127 = 32512, no saturation, and
// vpmaddwd by ones widens each 4 k of a column to int32 (exact), summed in int32 (pinned, as q4's).
// Four instructions a 32 products a row (vpdpbusd: one a 64): against q4_mm (2 threads, the
// default model's linears in cache) 1.3-1.7x its time at one, 16 and 64 rows.

using treeserve_cpu::kCodes8Bytes;
using treeserve_cpu::prefetch_codes8;
constexpr int kCodes8Rows = 4;  // rows a pass: their 4 x 2 int32 sums, the quad's codes and x fill the 16 registers

// Output blocks [nb_begin, nb_end) of 16 columns for all M rows: a group's codes stay in L1 while
// the rows go through them kCodes8Rows at a time, each row's 16 fp32 sums in acc (memory).
template <bool kHalves, bool kZeros>
void codes8_blocks(const int8_t* xq, const float* d, const float* xs, int64_t M, int64_t K, int64_t N,
                   const int8_t* codes, const float* scales, const float* zeros, void* y, bool float_out,
                   int64_t nb_begin, int64_t nb_end) {
  const int64_t G = K / 32, scale_floats = kHalves ? 32 : 16;
  const __m256i ones = _mm256_set1_epi16(1);
  float* acc = static_cast<float*>(aligned_alloc(64, M * 16 * 4));
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    memset(acc, 0, M * 16 * 4);
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* src = codes + (nb * G + g) * kCodes8Bytes;
      const float* s = scales + (nb * G + g) * scale_floats;
      const float* z = kZeros ? zeros + (nb * G + g) * 16 : nullptr;
      prefetch_codes8(src, s, scale_floats, z);
      over_row_chunks<kCodes8Rows>(M, [&](auto rows, int64_t m0) {
        constexpr int R = decltype(rows)::value;
        __m256i dot[R][2];  // columns 0-7, 8-15
        for (int h = 0; h < 2; ++h) {  // k 0-15, 16-31: each a scale's group where kHalves
          if (h == 0 || kHalves)
            for (int m = 0; m < R; ++m) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
          for (int p = 4 * h; p < 4 * h + 4; ++p) {
            const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + p * 64));
            const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + p * 64 + 32));
            const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);  // |-128| = 128 as u8
            for (int m = 0; m < R; ++m) {
              int32_t four;
              memcpy(&four, xq + (m0 + m) * K + g * 32 + 4 * p, sizeof(four));
              const __m256i xb = _mm256_set1_epi32(four);
              dot[m][0] = pinned(_mm256_add_epi32(dot[m][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0)), ones)));
              dot[m][1] = pinned(_mm256_add_epi32(dot[m][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1)), ones)));
            }
          }
          if (!kHalves && h == 0) continue;
          for (int m = 0; m < R; ++m) {
            const int64_t row = (m0 + m) * G + g;
            const __m256 dm = _mm256_set1_ps(d[row]);
            float* a = acc + (m0 + m) * 16;
            for (int c = 0; c < 2; ++c) {
              const __m256 scale = _mm256_loadu_ps(s + (kHalves ? h * 16 : 0) + c * 8);
              __m256 t = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot[m][c]), dm), scale, _mm256_load_ps(a + c * 8));
              if constexpr (kZeros)  // once a group, after its scale groups' terms
                if (h == 1) t = _mm256_fmadd_ps(_mm256_set1_ps(xs[row]), _mm256_loadu_ps(z + c * 8), t);
              _mm256_store_ps(a + c * 8, t);
            }
          }
        }
      });
    }
    for (int64_t m = 0; m < M; ++m) {
      for (int c = 0; c < 2; ++c) {
        const __m256 v = _mm256_load_ps(acc + m * 16 + c * 8);
        if (float_out) _mm256_storeu_ps(static_cast<float*>(y) + m * N + nb * 16 + c * 8, v);
        else _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(y) + m * N + nb * 16 + c * 8), bf16_round8(v));
      }
    }
  }
  free(acc);
}

at::Tensor q8g_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                  int64_t out_features, bool float_out) {
  const auto [halves, with_zeros, five_bits, offset] =
      treeserve_cpu::check_codes8("treeserve_avx2::q8g_mm", x, codes, scales, zeros, out_features);
  const int64_t M = x.size(0), K = x.size(1), N = out_features, G = K / 32;
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  int8_t* xq = static_cast<int8_t*>(aligned_alloc(64, ((M * K + 63) / 64) * 64));
  float* f = static_cast<float*>(aligned_alloc(64, ((3 * M * G * 4 + 63) / 64) * 64));
  float *d = f, *c8 = f + M * G, *xs = f + 2 * M * G;  // c8: quantize_row's -8 d sum(xq)
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, xq + m * K, d + m * G, c8 + m * G, xs + m * G);
  // A group whose xs is not finite (a NaN or inf x): d = NaN, so its row's outputs are NaN with
  // or without zeros (q4_amx.cpp's codes8_rows does the same).
  // The zero term's factor: the group's quantized sum d * sum(xq) (exactly -c8 / 8), not the
  // exact sum, so that a weight's offset meets the same rounded row as its code does.
  for (int64_t i = 0; i < M * G; ++i) {
    if (!std::isfinite(xs[i])) d[i] = std::numeric_limits<float>::quiet_NaN();
    xs[i] = c8[i] * -0.125f;
  }
  const auto* cp = static_cast<const int8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* zp = with_zeros ? zeros.data_ptr<float>() : nullptr;
  const auto blocks = [&](const int8_t* c, const float* s, const float* z, void* out, int64_t begin, int64_t end) {
    if (halves && with_zeros) codes8_blocks<true, true>(xq, d, xs, M, K, N, c, s, z, out, float_out, begin, end);
    else if (halves) codes8_blocks<true, false>(xq, d, xs, M, K, N, c, s, z, out, float_out, begin, end);
    else if (with_zeros) codes8_blocks<false, true>(xq, d, xs, M, K, N, c, s, z, out, float_out, begin, end);
    else codes8_blocks<false, false>(xq, d, xs, M, K, N, c, s, z, out, float_out, begin, end);
  };
  over_blocks(N / 16, [&](int64_t begin, int64_t end) {
    if (!five_bits) return blocks(cp, sp, zp, y.data_ptr(), begin, end);
    // Five-bit codes: widened a block at a time (codes5.h), the same products.
    treeserve_cpu::over_five_bit_blocks(cp, sp, zp, y.data_ptr(), M, G, kCodes8Rows, halves ? 32 : 16,
                                        float_out ? 4 : 2, offset, begin, end,
                                        [&](const int8_t* c, const float* s, const float* z, char* out, int64_t n) {
                                          blocks(c, s, z, out, 0, n);
                                        });
  });
  free(xq);
  free(f);
  return y;
}

}  // namespace

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

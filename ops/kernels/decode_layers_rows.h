// decode_layers.cpp's row-by-row stages: RMS norms (the model's and Qwen3's per-head), RoPE,
// residual adds and the MLP's activation, each row on its own in a fixed order, in bf16
// activations with float32 inside a stage.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "simd16.h"

namespace {

using bf16 = c10::BFloat16;
using simd16::bf16_round8;
using simd16::bf16x8;
using simd16::reduce_add8;

constexpr int64_t kGrain = 4;  // rows a thread takes in the elementwise stages

inline const uint16_t* bits(const bf16* p) { return reinterpret_cast<const uint16_t*>(p); }
inline uint16_t* bits(bf16* p) { return reinterpret_cast<uint16_t*>(p); }
inline void store8(bf16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_round8(v)); }

// y = bf16(x * rsqrt(mean(x^2) + eps) * w) for one row of D (a multiple of 8); y may be x.
inline void rms_norm_row(const bf16* x, const float* w, int64_t D, double eps, bf16* y) {
  const uint16_t* xr = bits(x);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 v = bf16x8(xr + i);
    sum = _mm256_fmadd_ps(v, v, sum);
  }
  const float scale = 1.0f / std::sqrt(reduce_add8(sum) / static_cast<float>(D) + static_cast<float>(eps));
  for (int64_t i = 0; i < D; i += 8)
    store8(y + i, _mm256_mul_ps(_mm256_mul_ps(bf16x8(xr + i), _mm256_set1_ps(scale)), _mm256_loadu_ps(w + i)));
}

// rms_norm_row of every row of D.
void rms_norm(const bf16* x, const float* w, int64_t rows, int64_t D, double eps, bf16* y) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x + r * D, w, D, eps, y + r * D);
  });
}

// Qwen3's per-head norms, in place in each qkv row: rms_norm_row over each of the q heads (wq)
// and of the k heads (wk), each head of hd on its own.
void head_norms(bf16* qkv, int64_t width, int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd,
                const float* wq, const float* wk, double eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      bf16* row = qkv + r * width;
      for (int64_t h = 0; h < heads; ++h) rms_norm_row(row + h * hd, wq, hd, eps, row + h * hd);
      for (int64_t h = 0; h < kv_heads; ++h) rms_norm_row(row + (heads + h) * hd, wk, hd, eps, row + (heads + h) * hd);
    }
  });
}

// Rotate-half RoPE of `heads` heads of hd starting at column `first` of a qkv row, into out
// (rows, heads, hd): x * cos + rotate_half(x) * sin, cos/sin rounded to bf16 as the step does.
void rope(const bf16* qkv, int64_t width, int64_t first, int64_t heads, int64_t hd, const int64_t* positions,
          const float* cos_table, const float* sin_table, int64_t rows, bf16* out) {
  const int64_t half = hd / 2;
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> c(hd), s(hd);
    for (int64_t r = begin; r < end; ++r) {
      const float* cr = cos_table + positions[r] * hd;
      const float* sr = sin_table + positions[r] * hd;
      for (int64_t i = 0; i < hd; ++i) {
        c[i] = static_cast<float>(bf16(cr[i]));
        s[i] = static_cast<float>(bf16(sr[i]));
      }
      for (int64_t h = 0; h < heads; ++h) {
        const bf16* x = qkv + r * width + first + h * hd;
        bf16* y = out + (r * heads + h) * hd;
        for (int64_t i = 0; i < half; ++i) {
          const float lo = static_cast<float>(x[i]), hi = static_cast<float>(x[i + half]);
          y[i] = bf16(lo * c[i] - hi * s[i]);
          y[i + half] = bf16(hi * c[i + half] + lo * s[i + half]);
        }
      }
    }
  });
}

// h = bf16(h + delta), in place (n a multiple of 8).
void add_into(bf16* h, const bf16* delta, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store8(h + i, _mm256_add_ps(bf16x8(bits(h + i)), bf16x8(bits(delta + i))));
}

// out[r] = bf16(act(g) * u) for a row g | u of 2F (F a multiple of 16), with simd16's exp
// (clamped: a very negative argument gives g / 3.3e38, about 0): SiLU, g / (1 + exp(-g)), or
// (gelu) tanh GELU, 0.5 g (1 + tanh(c (g + 0.044715 g^3))) = g / (1 + exp(-2c (g + 0.044715 g^3))).
void act_mul(const bf16* gate_up, int64_t rows, int64_t F, bool gelu, bf16* out) {
  using simd16::V16;
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    const V16 one = simd16::vset1(1.0f);
    const V16 cubic = simd16::vset1(0.044715f), two_c = simd16::vset1(-1.5957691216057308f);  // -2 sqrt(2 / pi)
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* g = bits(gate_up + r * 2 * F);
      for (int64_t i = 0; i < F; i += 16) {
        const V16 gv = simd16::vload_bf16(g + i, 0xffff);
        const V16 arg = gelu ? simd16::vmul(two_c, simd16::vfmadd(simd16::vmul(cubic, gv), simd16::vmul(gv, gv), gv))
                             : simd16::vsub(simd16::vzero(), gv);
        const V16 silu = simd16::vdiv(gv, simd16::vadd(one, simd16::vexp(arg)));
        simd16::vstore_bf16(bits(out + r * F + i), simd16::vmul(silu, simd16::vload_bf16(g + F + i, 0xffff)), 0xffff);
      }
    }
  });
}

}  // namespace

// The decode step's transformer blocks in one call, for the q4_1 format on the AVX2 kernels:
// treeserve_layers::run(h, positions, tree_mask, lengths, keys, values, rope_cos, rope_sin,
//                       weights, num_heads, num_kv_heads, eps) -> hidden
//
// Why: at one row the compiled step's own work is about 4.5 ms, but the step took about 6.5.
// Its Python wrapper makes ~330 calls (a fused elementwise kernel or an extern op each, with
// their buffers) and its prologue reads ~130 tensor sizes; 1.5-2 ms a step on this project's
// 2-core AVX2 host (bench/RESULTS.md; this op runs the blocks 1.5-1.7x as fast at one row,
// bench/fused_step.py). Here one op runs every block: the matrix products and
// the attention are the same ops, called through the dispatcher without Python
// (treeserve_avx2::q4_mm, treeserve_attn::write_kv and tree_decode), and the small elementwise
// work between them is written out below.
//
// What it computes is decode_step.blocks_hidden's, in bf16 activations with float32 inside each
// elementwise stage, rounded to bf16 once per stage (as inductor's fused kernels do):
//   x = rms_norm(h) * w_in; q|k|v = q4_mm(x); q, k = rope(q), rope(k) (cos/sin rounded to bf16
//   first, as the step does); write k, v; a = tree_decode(q); h = bf16(h + q4_mm(a));
//   x = rms_norm(h) * w_post; g|u = q4_mm(x); h = bf16(h + q4_mm(silu(g) * u))
// and the final norm. The weights are the model's own buffers (the same values as every other
// path); h is (B, T, D) bf16, positions (B, T) long, tree_mask (B, T, T) bool, lengths (B,) long
// (committed lengths: K/V go to slots lengths[b] + t), keys/values the cache's per-layer
// (B, n_kv, C, hd) bf16 storage, rope_cos/rope_sin (P, hd) float32, and weights 10 a layer
// (w_in, qkv codes, qkv scales_zeros, o codes, o scales_zeros, w_post, gate_up codes,
// gate_up scales_zeros, down codes, down scales_zeros; the norms' weights float32) and the
// final norm's last.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "simd16.h"  // its AVX2 backend: this file is built without AVX-512

namespace {

using bf16 = c10::BFloat16;
using simd16::bf16_round8;
using simd16::bf16x8;
using simd16::reduce_add8;

constexpr int64_t kWeightsPerLayer = 10;
constexpr int64_t kGrain = 4;  // rows a thread takes in the elementwise stages

inline const uint16_t* bits(const bf16* p) { return reinterpret_cast<const uint16_t*>(p); }
inline uint16_t* bits(bf16* p) { return reinterpret_cast<uint16_t*>(p); }
inline void store8(bf16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_round8(v)); }

// y[r] = bf16(x[r] * rsqrt(mean(x[r]^2) + eps) * w), every row of D (a multiple of 8).
void rms_norm(const bf16* x, const float* w, int64_t rows, int64_t D, double eps, bf16* y) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* xr = bits(x + r * D);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8) {
        const __m256 v = bf16x8(xr + i);
        sum = _mm256_fmadd_ps(v, v, sum);
      }
      const float scale = 1.0f / std::sqrt(reduce_add8(sum) / static_cast<float>(D) + static_cast<float>(eps));
      for (int64_t i = 0; i < D; i += 8)
        store8(y + r * D + i, _mm256_mul_ps(_mm256_mul_ps(bf16x8(xr + i), _mm256_set1_ps(scale)), _mm256_loadu_ps(w + i)));
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

// out[r] = bf16(silu(g) * u) for a row g | u of 2F (F a multiple of 16): g / (1 + exp(-g)),
// with simd16's exp (clamped: a very negative g gives g / 3.3e38, about 0).
void silu_mul(const bf16* gate_up, int64_t rows, int64_t F, bf16* out) {
  using simd16::V16;
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    const V16 one = simd16::vset1(1.0f);
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* g = bits(gate_up + r * 2 * F);
      for (int64_t i = 0; i < F; i += 16) {
        const V16 gv = simd16::vload_bf16(g + i, 0xffff);
        const V16 silu = simd16::vdiv(gv, simd16::vadd(one, simd16::vexp(simd16::vsub(simd16::vzero(), gv))));
        simd16::vstore_bf16(bits(out + r * F + i), simd16::vmul(silu, simd16::vload_bf16(g + F + i, 0xffff)), 0xffff);
      }
    }
  });
}

at::Tensor run(const at::Tensor& h_in, const at::Tensor& positions_in, const at::Tensor& tree_mask,
               const at::Tensor& lengths, at::TensorList keys, at::TensorList values, const at::Tensor& rope_cos,
               const at::Tensor& rope_sin, at::TensorList weights, int64_t num_heads, int64_t num_kv_heads,
               double eps) {
  static auto q4_mm = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("treeserve_avx2::q4_mm", "")
                          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
  static auto write_kv = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("treeserve_attn::write_kv", "")
                             .typed<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&)>();
  static auto tree_decode = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("treeserve_attn::tree_decode", "")
                                .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const at::Tensor&)>();
  const int64_t num_layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(h_in.dim() == 3 && h_in.scalar_type() == at::kBFloat16, "treeserve_layers::run: h must be (B, T, D) bf16");
  TORCH_CHECK(values.size() == keys.size() && static_cast<int64_t>(weights.size()) == kWeightsPerLayer * num_layers + 1,
              "treeserve_layers::run: ", kWeightsPerLayer, " weights a layer and the final norm's, per cache layer");
  const int64_t B = h_in.size(0), T = h_in.size(1), D = h_in.size(2), rows = B * T;
  TORCH_CHECK(D % 32 == 0, "treeserve_layers::run: the model's width must be a multiple of 32");
  const int64_t hd = keys.empty() ? 0 : keys[0].size(3);
  const int64_t q_size = num_heads * hd, kv_size = num_kv_heads * hd, width = q_size + 2 * kv_size;
  TORCH_CHECK(positions_in.numel() == rows && rope_cos.scalar_type() == at::kFloat && rope_sin.scalar_type() == at::kFloat &&
                  rope_cos.is_contiguous() && rope_sin.is_contiguous() && rope_cos.size(1) == hd && hd % 2 == 0,
              "treeserve_layers::run: positions must be (B, T) and the rope tables (P, hd) float32");
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < rope_cos.size(0), "treeserve_layers::run: a position outside the rope tables");
  for (const at::Tensor& w : weights)
    TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "treeserve_layers::run: weights must be contiguous CPU tensors");

  at::Tensor h = h_in.contiguous().clone();
  at::Tensor x = at::empty({rows, D}, h.options());
  at::Tensor q = at::empty({B, T, num_heads, hd}, h.options());
  at::Tensor k = at::empty({B, T, num_kv_heads, hd}, h.options());
  auto* hp = reinterpret_cast<bf16*>(h.data_ptr());
  auto* xp = reinterpret_cast<bf16*>(x.data_ptr());
  const auto* cos_p = rope_cos.data_ptr<float>();
  const auto* sin_p = rope_sin.data_ptr<float>();
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    TORCH_CHECK(w[0].scalar_type() == at::kFloat && w[5].scalar_type() == at::kFloat && w[0].numel() == D &&
                    w[5].numel() == D && w[2].dim() == 4 && w[2].size(0) * 32 == width && w[4].size(0) * 32 == D &&
                    w[7].dim() == 4 && w[9].size(0) * 32 == D,
                "treeserve_layers::run: the norms' weights must be (D,) float32, and the linears' scales_zeros "
                "(N/32, K/32, 2, 32) of q|k|v, o, gate|up and down");
    rms_norm(hp, w[0].data_ptr<float>(), rows, D, eps, xp);
    const at::Tensor qkv = q4_mm.call(x, w[1], w[2], width);  // (rows, width)
    const auto* qkv_p = reinterpret_cast<const bf16*>(qkv.data_ptr());
    rope(qkv_p, width, 0, num_heads, hd, pos, cos_p, sin_p, rows, reinterpret_cast<bf16*>(q.data_ptr()));
    rope(qkv_p, width, q_size, num_kv_heads, hd, pos, cos_p, sin_p, rows, reinterpret_cast<bf16*>(k.data_ptr()));
    const at::Tensor v = qkv.view({B, T, width}).narrow(2, q_size + kv_size, kv_size).view({B, T, num_kv_heads, hd});
    at::Tensor layer_keys = keys[layer], layer_values = values[layer];
    write_kv.call(layer_keys, layer_values, k, v, lengths);
    const at::Tensor attended = tree_decode.call(q, layer_keys, layer_values, lengths, tree_mask);  // (B, T, H*hd)
    const at::Tensor o = q4_mm.call(attended.view({rows, q_size}), w[3], w[4], D);
    add_into(hp, reinterpret_cast<const bf16*>(o.data_ptr()), rows * D);
    rms_norm(hp, w[5].data_ptr<float>(), rows, D, eps, xp);
    const int64_t ffn = w[7].size(0) * 32 / 2;  // gate_up's scales_zeros: (2F/32, D/32, 2, 32)
    const at::Tensor gate_up = q4_mm.call(x, w[6], w[7], 2 * ffn);
    at::Tensor act = at::empty({rows, ffn}, h.options());
    silu_mul(reinterpret_cast<const bf16*>(gate_up.data_ptr()), rows, ffn, reinterpret_cast<bf16*>(act.data_ptr()));
    const at::Tensor down = q4_mm.call(act, w[8], w[9], D);
    add_into(hp, reinterpret_cast<const bf16*>(down.data_ptr()), rows * D);
  }
  const at::Tensor& final_norm = weights[weights.size() - 1];
  TORCH_CHECK(final_norm.scalar_type() == at::kFloat && final_norm.numel() == D,
              "treeserve_layers::run: the final norm's weight must be (D,) float32");
  at::Tensor out = at::empty({B, T, D}, h.options());
  rms_norm(hp, final_norm.data_ptr<float>(), rows, D, eps, reinterpret_cast<bf16*>(out.data_ptr()));
  return out;
}

}  // namespace

TORCH_LIBRARY(treeserve_layers, m) {
  m.def("run(Tensor h, Tensor positions, Tensor tree_mask, Tensor lengths, Tensor(a!)[] keys, Tensor(b!)[] values, "
        "Tensor rope_cos, Tensor rope_sin, Tensor[] weights, int num_heads, int num_kv_heads, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(treeserve_layers, CPU, m) { m.impl("run", run); }

// Every transformer block in one call, for the int formats of GGUF blocks (q4_1, gguf) on CPUs
// with AVX2: a decode step, a
// token tree, a batch of rows or a prefill of any length, each row computed the same way
// whatever else shares the call. Built for AVX-512 where the CPU has it, else for AVX2; the two
// builds compute the same bits (the attention's 16 lanes are one zmm register or two ymm
// halves, folded and summed alike).
// treeserve_layers::run(h, positions, tree_mask, lengths, keys, values, rope_cos, rope_sin,
//                       rope_cos_local, rope_sin_local, weights, windows, num_heads,
//                       num_kv_heads, ffn, eps, kernel, activation, attn_scale) -> hidden
//
// Why one op: at one row the compiled step's own work is about 4.5 ms, but the step took about
// 6.5. Its Python wrapper makes ~330 calls (a fused elementwise kernel or an extern op each,
// with their buffers) and its prologue reads ~130 tensor sizes; 1.5-2 ms a step on this
// project's 2-core AVX2 host (bench/RESULTS.md). Here one op runs every block: the matrix
// products are the formats' own ops, called through the dispatcher without Python (4-bit codes,
// kernel 0: treeserve_avx2::q4_mm, 1: treeserve_q4::mm on int8 rows, AVX512-VNNI; 8-bit codes,
// treeserve_avx2::q8g_mm or treeserve_q4::q8g_mm, each linear on its own kind), the new
// tokens' K/V are stored by treeserve_attn::write_kv, and the attention and the small
// elementwise work between them are written out in its headers (decode_layers_rows.h,
// decode_layers_attn.h).
//
// One answer per row. Nothing a row gets depends on the other rows, the number of new tokens,
// the tree, or the threads: the products quantize each row to int8 per group on its own and
// sum exact int32 dots, scaled in a fixed order; the norms, RoPE, SiLU and adds go row by row,
// element by element in a fixed order; and the attention (attend, decode_layers_attn.h) sums over each token's
// visible keys in an order fixed by their place in that token's own sequence. So a prefill's
// K/V equal the steps' K/V bit for bit, and a token's hidden state is the same in a step, a
// chain, a tree, a batch or a prefill.
//
// What it computes is decode_step.blocks_hidden's, in bf16 activations with float32 inside each
// elementwise stage, rounded to bf16 once per stage:
//   x = rms_norm(h) * w_in; q|k|v = q4_mm(x); q, k = rope(q), rope(k) (cos/sin rounded to bf16
//   first, as the step does); write k, v; a = attend(q); h = bf16(h + q4_mm(a));
//   x = rms_norm(h) * w_post; g|u = q4_mm(x); h = bf16(h + q4_mm(silu(g) * u))
// and the final norm. Gemma 3's parts, where a layer has them: a sliding window (windows[layer]
// > 0 keys, rotated by the local rope tables when they are given), scores times attn_scale
// (0: 1/sqrt(hd)), rms norms on the attention's and the MLP's outputs before each add (their
// weights, 17 and 18 of a layer, or empty), and tanh GELU for SiLU (activation 1). The weights are the model's own buffers (the same values as every other
// path); h is (B, T, D) bf16, positions (B, T) long, tree_mask (B, T, T) bool (or empty: a
// causal chain, as a prefill is), lengths (B,) long (committed lengths: K/V go to slots
// lengths[b] + t), keys/values the cache's per-layer contiguous (B, n_kv, C, hd) bf16 storage,
// rope_cos/rope_sin (P, hd) float32, and weights 19 a layer (w_in, qkv's three, qkv's bias (bf16,
// or empty: Qwen2's q/k/v biases, added as the eager step adds them, bf16(y + b)), the q and k
// head norms' weights (or empty: Qwen3's, each head normed before RoPE), o's three, w_post,
// gate_up's three, down's three, the attention's and the MLP's output norms (or empty); the
// norms' weights float32) and the final norm's last.
// A linear's three are (codes, scales_zeros bf16, empty) on the 4-bit kernel's packing or
// (codes, scales float32, zeros) on the 8-bit codes' (kernels/codes8.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "simd16.h"  // AVX-512 or AVX2, as the build flags (cpp_build.simd16_flags) choose
#include "decode_layers_rows.h"  // the norms, RoPE, adds and activation
#include "decode_layers_attn.h"  // the attention (its parts: decode_layers_attn_blocks.h)

namespace {

constexpr int64_t kWeightsPerLayer = 19;

using MatmulFn = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>;
using VnniFn = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                                   int64_t, bool)>;

// The q4_1 product of the kernel this CPU runs: 0, q_avx2.cpp's q4_mm; 1, q4_amx.cpp's mm on int8
// rows (AVX512-VNNI). Both quantize each row on its own and sum exact int32 dots per group.
at::Tensor q4_mm(int64_t kernel, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_zeros,
                 int64_t out_features) {
  if (kernel == 0) {
    static MatmulFn op = c10::Dispatcher::singleton().findSchemaOrThrow("treeserve_avx2::q4_mm", "").typed<
        at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
    return op.call(x, codes, scales_zeros, out_features);
  }
  static VnniFn op = c10::Dispatcher::singleton().findSchemaOrThrow("treeserve_q4::mm", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool)>();
  return op.call(x, codes, scales_zeros, out_features, 2, true);
}

using Codes8Fn = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, int64_t, bool)>;

// One linear of a layer, w its three weights: the 4-bit kernel's packing (scales_zeros bf16) or
// the 8-bit codes' (scales float32), on this CPU's kernel of that kind.
at::Tensor linear(int64_t kernel, const at::Tensor& x, const at::Tensor* w, int64_t out_features) {
  if (w[1].scalar_type() == at::kBFloat16) return q4_mm(kernel, x, w[0], w[1], out_features);
  TORCH_CHECK(w[1].scalar_type() == at::kFloat &&
                  (w[0].numel() == out_features * x.size(1) || w[0].numel() * 8 == out_features * x.size(1) * 5),
              "treeserve_layers::run: a linear's weights must be the 4-bit or the 8-bit codes' packing");
  static Codes8Fn avx2 = c10::Dispatcher::singleton().findSchemaOrThrow("treeserve_avx2::q8g_mm", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool)>();
  if (kernel == 0) return avx2.call(x, w[0], w[1], w[2], out_features, false);
  static Codes8Fn vnni = c10::Dispatcher::singleton().findSchemaOrThrow("treeserve_q4::q8g_mm", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool)>();
  return vnni.call(x, w[0], w[1], w[2], out_features, false);
}

at::Tensor run(const at::Tensor& h_in, const at::Tensor& positions_in, const at::Tensor& tree_mask_in,
               const at::Tensor& lengths_in, at::TensorList keys, at::TensorList values, const at::Tensor& rope_cos,
               const at::Tensor& rope_sin, const at::Tensor& rope_cos_local, const at::Tensor& rope_sin_local,
               at::TensorList weights, at::IntArrayRef windows, int64_t num_heads, int64_t num_kv_heads, int64_t ffn,
               double eps, int64_t kernel, int64_t activation, double attn_scale) {
  static auto write_kv = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("treeserve_attn::write_kv", "")
                             .typed<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&)>();
  const int64_t num_layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(h_in.dim() == 3 && h_in.scalar_type() == at::kBFloat16, "treeserve_layers::run: h must be (B, T, D) bf16");
  TORCH_CHECK(kernel == 0 || kernel == 1, "treeserve_layers::run: kernel must be 0 (AVX2) or 1 (AVX512-VNNI)");
  TORCH_CHECK(activation == 0 || activation == 1, "treeserve_layers::run: activation must be 0 (SiLU) or 1 (tanh GELU)");
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == static_cast<int64_t>(keys.size()),
              "treeserve_layers::run: one window a layer (0: none)");
  TORCH_CHECK(values.size() == keys.size() && static_cast<int64_t>(weights.size()) == kWeightsPerLayer * num_layers + 1,
              "treeserve_layers::run: ", kWeightsPerLayer, " weights a layer and the final norm's, per cache layer");
  const int64_t B = h_in.size(0), T = h_in.size(1), D = h_in.size(2), rows = B * T;
  TORCH_CHECK(D % 32 == 0, "treeserve_layers::run: the model's width must be a multiple of 32");
  TORCH_CHECK(ffn > 0 && ffn % 16 == 0, "treeserve_layers::run: the MLP's width must be a positive multiple of 16");
  TORCH_CHECK(num_layers > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= kMaxGroup,
              "treeserve_layers::run: at most ", kMaxGroup, " query heads per KV head");
  const int64_t hd = keys[0].size(3), capacity = keys[0].size(2);
  TORCH_CHECK(hd % 16 == 0 && hd <= kMaxHeadDim, "treeserve_layers::run: the head size must be a multiple of 16, at most ",
              kMaxHeadDim);
  const int64_t q_size = num_heads * hd, kv_size = num_kv_heads * hd, width = q_size + 2 * kv_size;
  TORCH_CHECK(positions_in.numel() == rows && rope_cos.scalar_type() == at::kFloat && rope_sin.scalar_type() == at::kFloat &&
                  rope_cos.is_contiguous() && rope_sin.is_contiguous() && rope_cos.size(1) == hd && hd % 2 == 0,
              "treeserve_layers::run: positions must be (B, T) and the rope tables (P, hd) float32");
  const bool causal = tree_mask_in.numel() == 0;
  TORCH_CHECK(causal || (tree_mask_in.scalar_type() == at::kBool && tree_mask_in.numel() == B * T * T),
              "treeserve_layers::run: tree_mask must be (B, T, T) bool, or empty for a causal chain");
  const at::Tensor tree_mask = causal ? tree_mask_in : tree_mask_in.contiguous();
  const at::Tensor lengths = lengths_in.to(at::kLong).contiguous();
  const int64_t* len = lengths.data_ptr<int64_t>();
  TORCH_CHECK(lengths.numel() == B, "treeserve_layers::run: lengths must be (B,)");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(len[b] >= 0 && len[b] + T <= capacity, "treeserve_layers::run: a row's new tokens overflow the cache");
  for (int64_t layer = 0; layer < num_layers; ++layer)
    TORCH_CHECK(keys[layer].scalar_type() == at::kBFloat16 && values[layer].scalar_type() == at::kBFloat16 &&
                    keys[layer].is_contiguous() && values[layer].is_contiguous() && keys[layer].dim() == 4 &&
                    keys[layer].size(0) == B && keys[layer].size(1) == num_kv_heads && keys[layer].size(2) == capacity &&
                    keys[layer].size(3) == hd && values[layer].sizes() == keys[layer].sizes(),
                "treeserve_layers::run: each layer's keys and values must be contiguous (B, n_kv, C, hd) bf16");
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < rope_cos.size(0), "treeserve_layers::run: a position outside the rope tables");
  const bool local_rope = rope_cos_local.numel() != 0;
  TORCH_CHECK(!local_rope || (rope_cos_local.scalar_type() == at::kFloat && rope_sin_local.scalar_type() == at::kFloat &&
                              rope_cos_local.is_contiguous() && rope_sin_local.is_contiguous() &&
                              rope_cos_local.sizes() == rope_cos.sizes() && rope_sin_local.sizes() == rope_cos.sizes()),
              "treeserve_layers::run: the local rope tables must be empty or as the others");
  for (const at::Tensor& w : weights)
    TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "treeserve_layers::run: weights must be contiguous CPU tensors");

  const AttnShape shape{B, T, num_heads, num_kv_heads, capacity, hd};
  const bool* mask = causal ? nullptr : tree_mask.data_ptr<bool>();
  at::Tensor h = h_in.contiguous().clone();
  at::Tensor x = at::empty({rows, D}, h.options());
  at::Tensor q = at::empty({B, T, num_heads, hd}, h.options());
  at::Tensor k = at::empty({B, T, num_kv_heads, hd}, h.options());
  at::Tensor attended = at::empty({rows, q_size}, h.options());
  auto* hp = reinterpret_cast<bf16*>(h.data_ptr());
  auto* xp = reinterpret_cast<bf16*>(x.data_ptr());
  const float scale = attn_scale > 0 ? static_cast<float>(attn_scale) : 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    const bool local = local_rope && windows[layer] > 0;
    const auto* cos_p = (local ? rope_cos_local : rope_cos).data_ptr<float>();
    const auto* sin_p = (local ? rope_sin_local : rope_sin).data_ptr<float>();
    for (int64_t i : {17, 18})
      TORCH_CHECK(w[i].numel() == 0 || (w[i].scalar_type() == at::kFloat && w[i].numel() == D),
                  "treeserve_layers::run: the output norms' weights must be (D,) float32, or empty");
    TORCH_CHECK(w[0].scalar_type() == at::kFloat && w[10].scalar_type() == at::kFloat && w[0].numel() == D &&
                    w[10].numel() == D,
                "treeserve_layers::run: the norms' weights must be (D,) float32");
    const bool head_normed = w[5].numel() != 0;
    TORCH_CHECK(!head_normed || (w[5].scalar_type() == at::kFloat && w[6].scalar_type() == at::kFloat &&
                                 w[5].numel() == hd && w[6].numel() == hd),
                "treeserve_layers::run: the head norms' weights must be (hd,) float32, or empty");
    TORCH_CHECK(w[4].numel() == 0 || (w[4].scalar_type() == at::kBFloat16 && w[4].numel() == width),
                "treeserve_layers::run: the q|k|v bias must be (width,) bfloat16, or empty");
    rms_norm(hp, w[0].data_ptr<float>(), rows, D, eps, xp);
    const at::Tensor qkv = linear(kernel, x, w + 1, width);  // (rows, width)
    if (w[4].numel() != 0) {
      auto* qkv_rows = reinterpret_cast<bf16*>(qkv.data_ptr());
      const auto* bias = reinterpret_cast<const bf16*>(w[4].data_ptr());
      at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) add_into(qkv_rows + r * width, bias, width);
      });
    }
    if (head_normed)
      head_norms(reinterpret_cast<bf16*>(qkv.data_ptr()), width, rows, num_heads, num_kv_heads, hd,
                 w[5].data_ptr<float>(), w[6].data_ptr<float>(), eps);
    const auto* qkv_p = reinterpret_cast<const bf16*>(qkv.data_ptr());
    rope(qkv_p, width, 0, num_heads, hd, pos, cos_p, sin_p, rows, reinterpret_cast<bf16*>(q.data_ptr()));
    rope(qkv_p, width, q_size, num_kv_heads, hd, pos, cos_p, sin_p, rows, reinterpret_cast<bf16*>(k.data_ptr()));
    const at::Tensor v = qkv.view({B, T, width}).narrow(2, q_size + kv_size, kv_size).view({B, T, num_kv_heads, hd});
    at::Tensor layer_keys = keys[layer], layer_values = values[layer];
    write_kv.call(layer_keys, layer_values, k, v, lengths);
    attend(bits(reinterpret_cast<const bf16*>(q.data_ptr())), bits(reinterpret_cast<const bf16*>(layer_keys.data_ptr())),
           bits(reinterpret_cast<const bf16*>(layer_values.data_ptr())), len, mask, shape, windows[layer], scale,
           bits(reinterpret_cast<bf16*>(attended.data_ptr())));
    const at::Tensor o = linear(kernel, attended, w + 7, D);
    if (w[17].numel() != 0) rms_norm(reinterpret_cast<bf16*>(o.data_ptr()), w[17].data_ptr<float>(), rows, D, eps,
                                     reinterpret_cast<bf16*>(o.data_ptr()));
    add_into(hp, reinterpret_cast<const bf16*>(o.data_ptr()), rows * D);
    rms_norm(hp, w[10].data_ptr<float>(), rows, D, eps, xp);
    const at::Tensor gate_up = linear(kernel, x, w + 11, 2 * ffn);
    at::Tensor act = at::empty({rows, ffn}, h.options());
    act_mul(reinterpret_cast<const bf16*>(gate_up.data_ptr()), rows, ffn, activation == 1,
            reinterpret_cast<bf16*>(act.data_ptr()));
    const at::Tensor down = linear(kernel, act, w + 14, D);
    if (w[18].numel() != 0) rms_norm(reinterpret_cast<bf16*>(down.data_ptr()), w[18].data_ptr<float>(), rows, D, eps,
                                     reinterpret_cast<bf16*>(down.data_ptr()));
    add_into(hp, reinterpret_cast<const bf16*>(down.data_ptr()), rows * D);
  }
  const at::Tensor& final_norm = weights[weights.size() - 1];
  TORCH_CHECK(final_norm.scalar_type() == at::kFloat && final_norm.numel() == D,
              "treeserve_layers::run: the final norm's weight must be (D,) float32");
  at::Tensor out = at::empty({B, T, D}, h.options());
  rms_norm(hp, final_norm.data_ptr<float>(), rows, D, eps, reinterpret_cast<bf16*>(out.data_ptr()));
  return out;
}

// One layer's attention alone, as run() calls it (for the tests and bench/attention_kernel.py):
// q (B, T, H, hd) bf16; keys/values (B, n_kv, C, hd) bf16 with the new tokens' rows written at
// lengths[b] + t; tree_mask (B, T, T) bool, or empty for a causal chain. Returns (B, T, H * hd).
at::Tensor attend_op(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& lengths_in,
                     const at::Tensor& tree_mask_in, int64_t window, double scale) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.scalar_type() == at::kBFloat16, "treeserve_layers::attend: q must be (B, T, H, hd) bf16");
  const at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3);
  TORCH_CHECK(keys.dim() == 4 && keys.scalar_type() == at::kBFloat16 && keys.is_contiguous() && keys.size(0) == B &&
                  keys.size(3) == hd && values.sizes() == keys.sizes() && values.scalar_type() == at::kBFloat16 &&
                  values.is_contiguous(),
              "treeserve_layers::attend: keys and values must be contiguous (B, n_kv, C, hd) bf16");
  const int64_t n_kv = keys.size(1), C = keys.size(2);
  TORCH_CHECK(hd % 16 == 0 && hd <= kMaxHeadDim && H % n_kv == 0 && H / n_kv <= kMaxGroup,
              "treeserve_layers::attend: the head size must be a multiple of 16 (at most ", kMaxHeadDim, "), at most ",
              kMaxGroup, " query heads per KV head");
  const at::Tensor lengths = lengths_in.to(at::kLong).contiguous();
  TORCH_CHECK(lengths.numel() == B, "treeserve_layers::attend: lengths must be (B,)");
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(len[b] >= 0 && len[b] + T <= C, "treeserve_layers::attend: a row's new tokens overflow the cache");
  const bool causal = tree_mask_in.numel() == 0;
  TORCH_CHECK(causal || (tree_mask_in.scalar_type() == at::kBool && tree_mask_in.numel() == B * T * T),
              "treeserve_layers::attend: tree_mask must be (B, T, T) bool, or empty for a causal chain");
  const at::Tensor tree_mask = causal ? tree_mask_in : tree_mask_in.contiguous();
  at::Tensor out = at::empty({B, T, H * hd}, q.options());
  attend(bits(reinterpret_cast<const bf16*>(q.data_ptr())), bits(reinterpret_cast<const bf16*>(keys.data_ptr())),
         bits(reinterpret_cast<const bf16*>(values.data_ptr())), len, causal ? nullptr : tree_mask.data_ptr<bool>(),
         AttnShape{B, T, H, n_kv, C, hd}, window, static_cast<float>(scale), bits(reinterpret_cast<bf16*>(out.data_ptr())));
  return out;
}

}  // namespace

TORCH_LIBRARY(treeserve_layers, m) {
  m.def("attend(Tensor q, Tensor keys, Tensor values, Tensor lengths, Tensor tree_mask, int window, float scale) -> Tensor");
  m.def("run(Tensor h, Tensor positions, Tensor tree_mask, Tensor lengths, Tensor(a!)[] keys, Tensor(b!)[] values, "
        "Tensor rope_cos, Tensor rope_sin, Tensor rope_cos_local, Tensor rope_sin_local, Tensor[] weights, "
        "int[] windows, int num_heads, int num_kv_heads, int ffn, float eps, int kernel, int activation, float attn_scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(treeserve_layers, CPU, m) {
  m.impl("run", run);
  m.impl("attend", attend_op);
}

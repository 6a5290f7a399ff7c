// Attention of a verify step's new tokens (a decode token, a chain or a token tree) over a KV
// cache, for CPUs with AVX-512 or AVX2 (16-lane vectors from simd16.h, one build per kind of CPU):
// the CPU twin of the CUDA tree-mask kernel.
//
//   out = tree_decode(q, keys, values, lengths, tree_mask)
//
//   q          (B, T, H, hd)  the new tokens' queries (after RoPE), float32 or bfloat16
//   keys       (B, n_kv, C, hd) the cache, same dtype; values alike
//   lengths    (B,) int64     row b's committed prefix: slots [0, lengths[b])
//   tree_mask  (B, T, T) bool new token t sees new token s (at slot lengths[b] + s) iff set
//   out        (B, T, H * hd) same dtype as q, ready for the output projection
//
// Token t of row b attends to slots [0, lengths[b]) and to the tree-visible slots among
// [lengths[b], lengths[b] + T); nothing else is read. So the dense (B, 1, T, S) mask of the
// eager path is never built, and each row reads only its own committed length, not the longest.
//
// Work is split into items (row b, KV head g, a chunk of new tokens): the chunk's queries of all
// H / n_kv heads that share head g (GQA: K/V never expanded) are at most kMaxRows rows, and the
// item reads each of its keys and values once, in blocks, under an online softmax (flash
// style: no score matrix over all slots). When there are fewer items than a few per thread (a
// one-row decode has one per KV head), each item's slots are split into segments of whole key
// blocks, attended apart and merged (flash-decoding's split over the keys). Scores, softmax and
// the weighted sum are in float32; bfloat16 inputs are widened exactly and the output is
// rounded to nearest even.
//
// write_kv(keys, values, new_keys, new_values, lengths) stores the new tokens' K/V (B, T, n_kv, hd)
// at slots lengths[b] + t of the cache, in place.
//
// Threads: OpenMP (torch's libgomp), torch's thread count, items handed out round robin (so each
// thread knows its next item and, on the bf16 path, prefetches its rows into L2 meanwhile).
//
// The parts: tree_attention_common.h (what every path shares), tree_attention_item.h (the
// float32 vector item), tree_attention_bf16.h (the AVX512-BF16 item), tree_attention_tiles.h
// (AMX tiles); here the vector items' driver (attend), the ops and their registration.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "tree_attention_common.h"
#include "tree_attention_item.h"
#include "tree_attention_bf16.h"
#include "tree_attention_tiles.h"  // empty unless built with AMX-BF16

namespace {

template <typename T, int NV>
void attend(const T* q, const T* keys, const T* values, const int64_t* lengths, const bool* tree_mask, const Shape& s,
            T* out) {
  const int64_t group = s.heads / s.kv_heads;
  const int64_t per_chunk = std::max<int64_t>(1, kMaxRows / group);
  const int64_t chunks = (s.num_new + per_chunk - 1) / per_chunk;
  const int64_t tc = (s.num_new + chunks - 1) / chunks;  // balanced chunks
  const int64_t items = s.batch * s.kv_heads * chunks;
  const int64_t work = items * tc * group * (lengths[0] + s.num_new);
  const int threads = work < (1 << 11) ? 1 : at::get_num_threads();  // tiny steps: no fork
  // Fewer items than a few per thread (a one-row decode has one per KV head): each item's slots
  // are split into segments of whole key blocks, attended apart and merged (flash-decoding).
  int64_t longest = 0;
  for (int64_t b = 0; b < s.batch; ++b) longest = std::max(longest, lengths[b] + s.num_new);
  const int64_t block = kBlockKeys(NV);
  const int64_t wanted = threads == 1 || items >= 4 * threads ? 1 : (4 * threads + items - 1) / items;
  const int64_t segment = std::max<int64_t>(1, (longest + wanted * block - 1) / (wanted * block)) * block;
  const int64_t segments = (longest + segment - 1) / segment;
  std::vector<PartialRow> parts(segments > 1 ? items * segments * kMaxRows : 0);
#pragma omp parallel num_threads(threads)
  {
    // kt also holds attend_item_bf16's transposed key pairs (64 keys x NV * 8 pairs).
    alignas(64) float kt[kBlockKeys(NV) * NV * 16 > 64 * NV * 8 ? kBlockKeys(NV) * NV * 16 : 64 * NV * 8],
        vbuf[kBlockKeys(NV) * NV * 16];
    // Round robin: a thread's next unit is known (unit + threads), so its rows can be prefetched.
    const int64_t stride = omp_get_num_threads();
    auto unit_slots = [&](int64_t unit, int64_t& b, int64_t& g, int64_t& j_begin, int64_t& j_end) {
      const int64_t item = unit / segments, k = unit % segments;
      b = item / (s.kv_heads * chunks);
      g = item / chunks % s.kv_heads;
      j_begin = k * segment;
      j_end = std::min(lengths[b] + s.num_new, j_begin + segment);
    };
#pragma omp for schedule(static, 1)
    for (int64_t unit = 0; unit < items * segments; ++unit) {
      const int64_t item = unit / segments, k = unit % segments, c = item % chunks;
      int64_t b, g, j_begin, j_end;
      unit_slots(unit, b, g, j_begin, j_end);
      const int64_t t0 = c * tc, count = std::min(tc, s.num_new - t0);
      if (count <= 0) continue;
      PartialRow* partial = segments > 1 ? parts.data() + (item * segments + k) * kMaxRows : nullptr;
      if (j_begin >= j_end) {  // this row is shorter than the longest: an empty segment
        for (int64_t r = 0; r < count * group; ++r) {
          partial[r].max = -std::numeric_limits<float>::infinity();
          partial[r].sum = 0.0f;
        }
        continue;
      }
      NextRows next;
      if (unit + stride < items * segments) {
        int64_t nb, ng, nj_begin, nj_end;
        unit_slots(unit + stride, nb, ng, nj_begin, nj_end);
        const int64_t offset = ((nb * s.kv_heads + ng) * s.capacity + nj_begin) * s.head_dim;
        next = {reinterpret_cast<const char*>(keys + offset), reinterpret_cast<const char*>(values + offset),
                std::max<int64_t>(0, nj_end - nj_begin), s.head_dim * int64_t(sizeof(T))};
      }
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, uint16_t> && NV % 2 == 0) {
        if (s.head_dim == NV * 16) {  // a multiple of 32
          attend_item_bf16<NV * 16>(q, keys, values, tree_mask, lengths[b], s, b, g, t0, count, j_begin, j_end, out,
                                    partial, reinterpret_cast<uint32_t*>(kt), next);
          continue;
        }
      }
#endif
      attend_item<T, NV>(q, keys, values, tree_mask, lengths[b], s, b, g, t0, count, j_begin, j_end, out, partial, kt, vbuf,
                         next);
    }
  }
  if (segments > 1) {
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / (s.kv_heads * chunks), g = item / chunks % s.kv_heads, c = item % chunks;
      const int64_t t0 = c * tc, count = std::min(tc, s.num_new - t0);
      if (count > 0) merge_partials<T, NV>(parts.data() + item * segments * kMaxRows, segments, count * group, s, b, g, t0, out);
    }
  }
}

template <typename T>
void dispatch(const T* q, const T* keys, const T* values, const int64_t* lengths, const bool* tree_mask, const Shape& s,
              T* out) {
  switch ((s.head_dim + 15) / 16) {
    case 1: return attend<T, 1>(q, keys, values, lengths, tree_mask, s, out);
    case 2: return attend<T, 2>(q, keys, values, lengths, tree_mask, s, out);
    case 3: return attend<T, 3>(q, keys, values, lengths, tree_mask, s, out);
    case 4: return attend<T, 4>(q, keys, values, lengths, tree_mask, s, out);
    case 5: return attend<T, 5>(q, keys, values, lengths, tree_mask, s, out);
    case 6: return attend<T, 6>(q, keys, values, lengths, tree_mask, s, out);
    case 7: return attend<T, 7>(q, keys, values, lengths, tree_mask, s, out);
    case 8: return attend<T, 8>(q, keys, values, lengths, tree_mask, s, out);
    default: TORCH_CHECK(false, "treeserve_attn::tree_decode: head_dim must be at most 128");
  }
}

at::Tensor tree_decode(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values,
                       const at::Tensor& lengths_in, const at::Tensor& tree_mask_in) {
  TORCH_CHECK(q_in.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "treeserve_attn::tree_decode: q must be (B, T, H, hd) and keys/values (B, n_kv, C, hd)");
  TORCH_CHECK(q_in.scalar_type() == keys.scalar_type() && values.scalar_type() == keys.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16),
              "treeserve_attn::tree_decode: q, keys and values must all be float32 or all bfloat16");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "treeserve_attn::tree_decode: the cache must be contiguous");
  const Shape s{q_in.size(0), q_in.size(1), q_in.size(2), keys.size(1), keys.size(2), q_in.size(3)};
  TORCH_CHECK(keys.size(0) == s.batch && keys.size(3) == s.head_dim && s.heads % s.kv_heads == 0,
              "treeserve_attn::tree_decode: q and the cache disagree on batch, head_dim or heads");
  TORCH_CHECK(s.num_new >= 1 && s.head_dim <= 128 && s.heads / s.kv_heads <= kMaxRows,
              "treeserve_attn::tree_decode: needs T >= 1, head_dim <= 128 and at most 16 query heads per KV head");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor lengths = lengths_in.to(at::kLong).contiguous();
  const at::Tensor tree_mask = tree_mask_in.to(at::kBool).contiguous();
  TORCH_CHECK(lengths.numel() == s.batch && tree_mask.numel() == s.batch * s.num_new * s.num_new,
              "treeserve_attn::tree_decode: lengths must be (B,) and tree_mask (B, T, T)");
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < s.batch; ++b) {
    TORCH_CHECK(len[b] >= 0 && len[b] + s.num_new <= s.capacity, "treeserve_attn::tree_decode: row ", b, " holds ",
                len[b], " tokens, and ", s.num_new, " more do not fit its ", s.capacity, " slots");
  }
  at::Tensor out = at::empty({s.batch, s.num_new, s.heads * s.head_dim}, q.options());
  const bool* mask = tree_mask.data_ptr<bool>();
  if (keys.scalar_type() == at::kFloat) {
    dispatch<float>(q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), len, mask, s,
                    out.data_ptr<float>());
  } else {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (use_tiles(s)) {
      attend_tiles(reinterpret_cast<const uint16_t*>(q.data_ptr()), reinterpret_cast<const uint16_t*>(keys.data_ptr()),
                   reinterpret_cast<const uint16_t*>(values.data_ptr()), len, mask, s,
                   reinterpret_cast<uint16_t*>(out.data_ptr()));
      return out;
    }
#endif
    dispatch<uint16_t>(reinterpret_cast<const uint16_t*>(q.data_ptr()), reinterpret_cast<const uint16_t*>(keys.data_ptr()),
                       reinterpret_cast<const uint16_t*>(values.data_ptr()), len, mask, s,
                       reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
  return out;
}

// keys[b, :, lengths[b] + t] = new_keys[b, t] (and values alike), in place: in a compiled graph
// an indexed store into the cache is functionalized into a copy of the whole cache per step
// (measured: a 64-row step took 90 ms on a 260-slot cache and 311 ms on a 1256-slot one).
void write_kv(at::Tensor& keys, at::Tensor& values, const at::Tensor& new_keys_in, const at::Tensor& new_values_in,
              const at::Tensor& lengths_in) {
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.is_contiguous() && values.is_contiguous(),
              "treeserve_attn::write_kv: keys/values must be contiguous (B, n_kv, C, hd)");
  TORCH_CHECK(new_keys_in.dim() == 4 && new_values_in.sizes() == new_keys_in.sizes() &&
                  new_keys_in.scalar_type() == keys.scalar_type() && new_values_in.scalar_type() == keys.scalar_type(),
              "treeserve_attn::write_kv: new keys/values must be (B, T, n_kv, hd) in the cache's dtype");
  const int64_t batch = keys.size(0), kv_heads = keys.size(1), capacity = keys.size(2), head_dim = keys.size(3);
  const int64_t num_new = new_keys_in.size(1);
  TORCH_CHECK(new_keys_in.size(0) == batch && new_keys_in.size(2) == kv_heads && new_keys_in.size(3) == head_dim,
              "treeserve_attn::write_kv: new keys/values do not match the cache's shape");
  // Strided new keys and values are read in place (the step's values are a slice of the fused
  // QKV output, and a copy of them cost a clone per layer); only the head dim must be dense.
  const at::Tensor new_keys = new_keys_in.stride(3) == 1 ? new_keys_in : new_keys_in.contiguous();
  const at::Tensor new_values = new_values_in.stride(3) == 1 ? new_values_in : new_values_in.contiguous();
  const at::Tensor lengths = lengths_in.to(at::kLong).contiguous();
  TORCH_CHECK(lengths.numel() == batch, "treeserve_attn::write_kv: lengths must be (B,)");
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t elem = keys.element_size(), row_bytes = head_dim * elem;
  auto* kc = static_cast<char*>(keys.data_ptr());
  auto* vc = static_cast<char*>(values.data_ptr());
  const auto* kn = static_cast<const char*>(new_keys.data_ptr());
  const auto* vn = static_cast<const char*>(new_values.data_ptr());
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len[b] >= 0 && len[b] + num_new <= capacity, "treeserve_attn::write_kv: row ", b, " holds ", len[b],
                " tokens, and ", num_new, " more do not fit its ", capacity, " slots");
    for (int64_t t = 0; t < num_new; ++t) {
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t to = ((b * kv_heads + g) * capacity + len[b] + t) * row_bytes;
        const int64_t key_from = (b * new_keys.stride(0) + t * new_keys.stride(1) + g * new_keys.stride(2)) * elem;
        const int64_t value_from = (b * new_values.stride(0) + t * new_values.stride(1) + g * new_values.stride(2)) * elem;
        std::memcpy(kc + to, kn + key_from, row_bytes);
        std::memcpy(vc + to, vn + value_from, row_bytes);
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY(treeserve_attn, m) {
  m.def("tree_decode(Tensor q, Tensor keys, Tensor values, Tensor lengths, Tensor tree_mask) -> Tensor");
  m.def("write_kv(Tensor(a!) keys, Tensor(b!) values, Tensor new_keys, Tensor new_values, Tensor lengths) -> ()");
}

TORCH_LIBRARY_IMPL(treeserve_attn, CPU, m) {
  m.impl("tree_decode", tree_decode);
  m.impl("write_kv", write_kv);
}

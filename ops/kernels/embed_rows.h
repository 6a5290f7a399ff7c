// dense_cpu.cpp's embed_rows: rows of a token embedding read out of packed codes, an LM head's or
// an untied embedding's own (treeserve.ops.embedding.PackedEmbedding), w = scale * code (+ zero)
// in float32, rounded to bf16 to nearest even: the file's dequantization of those rows, as the
// bf16 table held them.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <stdint.h>

#include "codes5.h"

namespace {

// kind 0: q8_amx's packing, codes (nb, g, h, r, c, j) of row n = nb*32 + h*16 + c and column
//   k = g*32 + r*2 + j, scales (nb, g, 32) float16 (kernels/q8_amx.py).
// kind 1: codes8's packing, codes [N/16][G][8 quads][16 columns][4] at a byte a code or at five
//   bits (codes5.h), scales [N/16][K/S][16] float32, zeros [N/16][G][16] float32 or empty
//   (kernels/codes8.py).
at::Tensor embed_rows(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales,
                      const at::Tensor& zeros, int64_t kind, int64_t N, int64_t K) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              "treeserve_dense::embed_rows: ids must be (T,) int64");
  const bool five_bits = kind == 1 && codes.numel() * 8 == N * K * 5;
  TORCH_CHECK((kind == 0 || kind == 1) && N % 32 == 0 && K % 32 == 0 &&
                  (codes.scalar_type() == at::kChar || (five_bits && codes.scalar_type() == at::kByte)) &&
                  (codes.numel() == N * K || five_bits) && codes.is_contiguous() && scales.is_contiguous(),
              "treeserve_dense::embed_rows: codes must be N * K int8 (or codes8's five bits) in a known packing");
  TORCH_CHECK(kind == 0 ? scales.scalar_type() == at::kHalf && scales.numel() == N * K / 32
                        : scales.scalar_type() == at::kFloat && (scales.numel() == N * K / 32 || scales.numel() == N * K / 16),
              "treeserve_dense::embed_rows: scales do not fit the packing");
  const bool with_zeros = zeros.numel() != 0;
  TORCH_CHECK(!with_zeros || (kind == 1 && zeros.scalar_type() == at::kFloat && zeros.numel() == N * K / 32 &&
                              zeros.is_contiguous()),
              "treeserve_dense::embed_rows: zeros must be empty or N * K / 32 float32 (codes8 only)");
  const int64_t T = ids.numel(), G = K / 32;
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(idp[t] >= 0 && idp[t] < N, "treeserve_dense::embed_rows: id out of range");
  at::Tensor out = at::empty({T, K}, ids.options().dtype(at::kBFloat16));
  const auto* cp = static_cast<const int8_t*>(codes.data_ptr());
  const auto* bp = static_cast<const uint8_t*>(codes.data_ptr());
  const int8_t offset = codes.scalar_type() == at::kChar ? 16 : 0;  // five bits: a field less its code
  auto* op = reinterpret_cast<c10::BFloat16*>(out.data_ptr());
  const auto* hp = reinterpret_cast<const c10::Half*>(scales.data_ptr());
  const float* sp = kind == 1 ? scales.data_ptr<float>() : nullptr;
  const float* zp = with_zeros ? zeros.data_ptr<float>() : nullptr;
  const int64_t S = scales.numel() == N * K / 32 ? 32 : 16;
  // Each row on its own (rows in grains of 16 over torch's threads): the same bits at any T.
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = idp[t];
      c10::BFloat16* row = op + t * K;
      if (kind == 0) {
        const int64_t nb = n / 32, h = (n % 32) / 16, c = n % 16;
        for (int64_t g = 0; g < G; ++g) {
          const float s = static_cast<float>(hp[(nb * G + g) * 32 + n % 32]);
          const int8_t* block = cp + (((nb * G + g) * 2 + h) * 16 * 16 + c) * 2;  // r = 0, j = 0
          for (int64_t r = 0; r < 16; ++r)
            for (int64_t j = 0; j < 2; ++j) row[g * 32 + r * 2 + j] = c10::BFloat16(s * static_cast<float>(block[r * 32 + j]));
        }
        continue;
      }
      const int64_t nb = n / 16, c = n % 16;
      alignas(64) int8_t wide[512];
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* group = cp + (nb * G + g) * 512;  // the group's 512 codes in the byte layout
        if (five_bits) {  // widened to that layout by codes5.h's own unpacking
          treeserve_cpu::unpack_codes5(bp + (nb * G + g) * treeserve_cpu::kCodes5Bytes, 1, offset, wide);
          group = wide;
        }
        for (int64_t k = g * 32; k < g * 32 + 32; ++k) {
          const int64_t quad = (k % 32) / 4;  // of the group's 8; k % 4 within it
          float v = sp[(nb * (K / S) + k / S) * 16 + c] * static_cast<float>(group[(quad * 16 + c) * 4 + k % 4]);
          if (with_zeros) v = v + zp[(nb * G + g) * 16 + c];
          row[k] = c10::BFloat16(v);
        }
      }
    }
  });
  return out;
}

}  // namespace

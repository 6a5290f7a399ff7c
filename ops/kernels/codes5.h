// The 5-bit packing of the 8-bit-code kernels (kernels/codes8.py): a group's 512 codes (16
// columns x 32 k, in the codes8 order) as 5-bit fields, 256 bytes of nibble pairs (byte t holds
// field t in its low nibble and field t + 256 in its high one) and a 64-byte bitmap of the fields'
// fifth bits (bit t, little-endian, is field t's). A field is code + 16 (int8 codes, -16..15:
// Q5_0) or the code itself (uint8, 0..31: Q5_1, Q5_K). q4_amx.cpp and q_avx2.cpp widen a
// 16-column block's groups back to int8 codes with unpack_codes5 before their products, so a
// packed weight gives exactly the bits of its 8-bit layout. AVX2 code (both of those files'
// builds have it), or AVX512-BW code where the build has that.

#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace treeserve_cpu {

constexpr int64_t kCodes5Bytes = 320;  // one group's 512 codes at five bits

// Byte i of the result: 0xFF where bit i of `bits` is set, else 0.
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte i: byte i / 8 of bits (each 128-bit lane holds them all)
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));  // byte i: bit i % 8
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}

// `groups` packed groups at src -> their int8 codes at out (512 a group, the codes8 layout):
// field - offset (16 for int8 codes, 0 for uint8 ones). With AVX512-BW the fifth bits are masks
// (64 codes a register); otherwise each 32 of them is spread to bytes. The same bytes either way.
#if defined(__AVX512BW__)
inline void unpack_codes5(const uint8_t* src, int64_t groups, int8_t offset, int8_t* out) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10), off = _mm512_set1_epi8(offset);
  for (int64_t g = 0; g < groups; ++g, src += kCodes5Bytes, out += 512) {
    const uint8_t* bitmap = src + 256;
    for (int k = 0; k < 4; ++k) {
      const __m512i pairs = _mm512_loadu_si512(src + 64 * k);
      const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(pairs, nibble), off);
      const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(pairs, 4), nibble), off);
      uint64_t first, second;
      std::memcpy(&first, bitmap + 8 * k, sizeof(first));
      std::memcpy(&second, bitmap + 32 + 8 * k, sizeof(second));
      _mm512_storeu_si512(out + 64 * k, _mm512_mask_add_epi8(lo, _cvtu64_mask64(first), lo, fifth));
      _mm512_storeu_si512(out + 256 + 64 * k, _mm512_mask_add_epi8(hi, _cvtu64_mask64(second), hi, fifth));
    }
  }
}
#else
inline void unpack_codes5(const uint8_t* src, int64_t groups, int8_t offset, int8_t* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10), off = _mm256_set1_epi8(offset);
  for (int64_t g = 0; g < groups; ++g, src += kCodes5Bytes, out += 512) {
    const uint8_t* bitmap = src + 256;
    for (int k = 0; k < 8; ++k) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * k));
      uint32_t first, second;
      std::memcpy(&first, bitmap + 4 * k, sizeof(first));
      std::memcpy(&second, bitmap + 32 + 4 * k, sizeof(second));
      const __m256i lo = _mm256_or_si256(_mm256_and_si256(pairs, nibble), _mm256_and_si256(bits_to_bytes(first), fifth));
      const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(pairs, 4), nibble),
                                         _mm256_and_si256(bits_to_bytes(second), fifth));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * k), _mm256_sub_epi8(lo, off));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 256 + 32 * k), _mm256_sub_epi8(hi, off));
    }
  }
}
#endif

// A thread's buffer of at least `bytes` widened codes (64-byte aligned), kept between calls: a
// fresh allocation of a block range's codes (hundreds of KB) would be new pages, faulted in and
// zeroed by the kernel, at every product.
inline int8_t* wide_buffer(int64_t bytes) {
  struct Buffer {
    int8_t* data = nullptr;
    int64_t size = 0;
    ~Buffer() { free(data); }
  };
  static thread_local Buffer buffer;
  if (buffer.size < bytes) {
    free(buffer.data);
    buffer.data = static_cast<int8_t*>(aligned_alloc(64, (bytes + 63) / 64 * 64));
    buffer.size = bytes;
  }
  return buffer.data;
}

// A thread's 16-column blocks [begin, end) of a five-bit weight (`codes`, groups of G per block;
// `scale_floats` scales and 16 zeros a group; `out_bytes` an output element), each block widened
// to int8 codes and then run by `blocks(codes, scales, zeros, out, n)` as the first n blocks of a
// weight of their own (its scales, zeros and output columns offset alike), so a packed weight
// gives the bits of its 8-bit layout. Up to `chunk_rows` rows of x: block by block, each
// widened into L1 just before its products. More rows: the thread's blocks widened at once
// (into L2), then the products as for a byte-a-code weight, each row chunk reading them there.
template <class Blocks>
inline void over_five_bit_blocks(const void* codes, const float* scales, const float* zeros, void* out, int64_t M,
                                 int64_t G, int64_t chunk_rows, int64_t scale_floats, int64_t out_bytes, int8_t offset,
                                 int64_t begin, int64_t end, Blocks blocks) {
  const int64_t span = M <= chunk_rows ? 1 : end - begin;
  int8_t* wide = wide_buffer(span * G * 512);  // 512 codes a group
  for (int64_t nb = begin; nb < end; nb += span) {
    const int64_t n = std::min(span, end - nb);
    unpack_codes5(static_cast<const uint8_t*>(codes) + nb * G * kCodes5Bytes, n * G, offset, wide);
    blocks(static_cast<const int8_t*>(wide), scales + nb * G * scale_floats, zeros ? zeros + nb * G * 16 : nullptr,
           static_cast<char*>(out) + nb * 16 * out_bytes, n);
  }
}

}  // namespace treeserve_cpu

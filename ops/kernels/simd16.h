// Sixteen float32 lanes for tree_attention_cpu.cpp (and decode_layers.cpp's SiLU), on AVX-512 (one zmm register) or on AVX2
// (two ymm halves), whichever the file is compiled for (cpp_build picks the flags by CPU). The
// kernel is written once against these operations; the AVX-512 backend is the intrinsics it
// was first written with, one for one.
//
// Masks are lane bit masks (bit i: lane i). On AVX2 a masked load or store of bf16 lanes goes
// through a 16-lane buffer: the kernel only masks the last vector of a head dimension that is
// not a multiple of 16 (never at the default model's 64).

#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace simd16 {

// Eight-lane pieces (AVX2 instructions, on both backends): the AVX2 backend's V16 is built of
// them, and q_avx2.cpp and decode_layers.cpp use them directly.
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// 8 bf16 -> 8 fp32 (exact).
inline __m256 bf16x8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
// 8 fp32 -> 8 bf16, nearest even (NaN stays a quiet NaN).
inline __m128i bf16_round8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000)), nan);
  const __m256i high = _mm256_srli_epi32(rounded, 16);  // < 65536: packs without saturating
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08));
}
#if defined(__AVX512F__)

using Mask16 = __mmask16;
struct V16 {
  __m512 v;
};

inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vset1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 vload(const float* p) { return {_mm512_load_ps(p)}; }  // 64-byte aligned
inline V16 vloadu(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V16 a) { _mm512_store_ps(p, a.v); }
inline void vstoreu(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 vmin(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V16 vdiv(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 vfmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }    // a * b + c
inline V16 vfnmadd(V16 a, V16 b, V16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a * b
inline V16 vmaskz_loadu(Mask16 m, const float* p) { return {_mm512_maskz_loadu_ps(m, p)}; }
inline void vmask_storeu(float* p, Mask16 m, V16 a) { _mm512_mask_storeu_ps(p, m, a.v); }
inline V16 vmaskz_mov(Mask16 m, V16 a) { return {_mm512_maskz_mov_ps(m, a.v)}; }
// Lanes of m: max(a, b); the others: src.
inline V16 vmask_max(V16 src, Mask16 m, V16 a, V16 b) { return {_mm512_mask_max_ps(src.v, m, a.v, b.v)}; }
inline Mask16 vmask_unord(Mask16 m, V16 a) { return _mm512_mask_cmp_ps_mask(m, a.v, a.v, _CMP_UNORD_Q); }  // NaN lanes
inline Mask16 vmask_neq(Mask16 m, V16 a, V16 b) { return _mm512_mask_cmp_ps_mask(m, a.v, b.v, _CMP_NEQ_OQ); }
inline float vreduce_add(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline float vreduce_max(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline V16 vround(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// a * 2^n for integral n (the kernel's n lie in [-126, 0]).
inline V16 vmul_pow2(V16 a, V16 n) { return {_mm512_scalef_ps(a.v, n.v)}; }

// bf16 lanes of m widened to float32 (exact); the others 0.
inline V16 vload_bf16(const uint16_t* p, Mask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
// Lanes of m rounded to bf16, nearest even (NaN stays a quiet NaN), stored.
inline void vstore_bf16(uint16_t* p, V16 a, Mask16 m) {
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// In-register transpose of a 16 x 16 float32 tile: rows r[i] become columns.
inline void transpose16(V16 t[16]) {
  __m512 r[16], a[16], b[16];
  for (int i = 0; i < 16; ++i) r[i] = t[i].v;
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a0 = _mm512_castps_pd(a[4 * i]), a1 = _mm512_castps_pd(a[4 * i + 1]);
    const __m512d a2 = _mm512_castps_pd(a[4 * i + 2]), a3 = _mm512_castps_pd(a[4 * i + 3]);
    b[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
    b[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
    b[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
    b[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
  }
  for (int k = 0; k < 4; ++k) {  // b[4 i + k]: column 4 L + k of rows 4 i .. 4 i + 3, in 128-bit lane L
    const __m512 x_lo = _mm512_shuffle_f32x4(b[k], b[4 + k], 0x44), x_hi = _mm512_shuffle_f32x4(b[k], b[4 + k], 0xEE);
    const __m512 y_lo = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0x44), y_hi = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0xEE);
    t[k].v = _mm512_shuffle_f32x4(x_lo, y_lo, 0x88);
    t[4 + k].v = _mm512_shuffle_f32x4(x_lo, y_lo, 0xDD);
    t[8 + k].v = _mm512_shuffle_f32x4(x_hi, y_hi, 0x88);
    t[12 + k].v = _mm512_shuffle_f32x4(x_hi, y_hi, 0xDD);
  }
}

#else  // AVX2 + FMA

using Mask16 = uint32_t;
struct V16 {
  __m256 lo, hi;  // lanes 0..7, 8..15
};

// The 8 lanes of bits (bit i: lane i) as a ymm mask (all ones where set).
inline __m256 lane_mask(uint32_t bits) {
  const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(bits & 0xff)), select), select));
}
inline Mask16 bits_of(__m256 lo, __m256 hi) {
  return Mask16(_mm256_movemask_ps(lo)) | (Mask16(_mm256_movemask_ps(hi)) << 8);
}

inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 vload(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
inline V16 vloadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V16 a) {
  _mm256_store_ps(p, a.lo);
  _mm256_store_ps(p + 8, a.hi);
}
inline void vstoreu(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 vmin(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V16 vdiv(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 vfmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 vfnmadd(V16 a, V16 b, V16 c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
// All 16 lanes (the common case, a whole block) take the plain instructions: vmaskmovps costs
// several times a load or store (its store most, on AMD's cores).
inline V16 vmaskz_loadu(Mask16 m, const float* p) {
  if ((m & 0xffff) == 0xffff) return vloadu(p);
  return {_mm256_maskload_ps(p, _mm256_castps_si256(lane_mask(m))), _mm256_maskload_ps(p + 8, _mm256_castps_si256(lane_mask(m >> 8)))};
}
inline void vmask_storeu(float* p, Mask16 m, V16 a) {
  if ((m & 0xffff) == 0xffff) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
    return;
  }
  _mm256_maskstore_ps(p, _mm256_castps_si256(lane_mask(m)), a.lo);
  _mm256_maskstore_ps(p + 8, _mm256_castps_si256(lane_mask(m >> 8)), a.hi);
}
inline V16 vmaskz_mov(Mask16 m, V16 a) {
  if ((m & 0xffff) == 0xffff) return a;
  return {_mm256_and_ps(a.lo, lane_mask(m)), _mm256_and_ps(a.hi, lane_mask(m >> 8))};
}
inline V16 vmask_max(V16 src, Mask16 m, V16 a, V16 b) {
  if ((m & 0xffff) == 0xffff) return vmax(a, b);
  return {_mm256_blendv_ps(src.lo, _mm256_max_ps(a.lo, b.lo), lane_mask(m)),
          _mm256_blendv_ps(src.hi, _mm256_max_ps(a.hi, b.hi), lane_mask(m >> 8))};
}
inline Mask16 vmask_unord(Mask16 m, V16 a) {
  return m & bits_of(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q));
}
inline Mask16 vmask_neq(Mask16 m, V16 a, V16 b) {
  return m & bits_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_NEQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_NEQ_OQ));
}
inline float vreduce_add(V16 a) { return reduce_add8(_mm256_add_ps(a.lo, a.hi)); }
inline float vreduce_max(V16 a) { return reduce_max8(_mm256_max_ps(a.lo, a.hi)); }
inline V16 vround(V16 a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// a * 2^n for integral n in [-126, 127]: 2^n built from its exponent bits.
inline __m256 pow2(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V16 vmul_pow2(V16 a, V16 n) { return {_mm256_mul_ps(a.lo, pow2(n.lo)), _mm256_mul_ps(a.hi, pow2(n.hi))}; }

inline V16 vload_bf16(const uint16_t* p, Mask16 m) {
  if ((m & 0xffff) == 0xffff) return {bf16x8(p), bf16x8(p + 8)};
  alignas(32) uint16_t lanes[16] = {0};
  for (int i = 0; i < 16; ++i) {
    if (m >> i & 1) lanes[i] = p[i];
  }
  return {bf16x8(lanes), bf16x8(lanes + 8)};
}
inline void vstore_bf16(uint16_t* p, V16 a, Mask16 m) {
  alignas(32) uint16_t lanes[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), bf16_round8(a.lo));
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes + 8), bf16_round8(a.hi));
  if ((m & 0xffff) == 0xffff) {
    memcpy(p, lanes, sizeof(lanes));
    return;
  }
  for (int i = 0; i < 16; ++i) {
    if (m >> i & 1) p[i] = lanes[i];
  }
}

// 8 x 8 transpose of r[0..7] in place.
inline void transpose8(__m256 r[8]) {
  __m256 a[8], b[8];
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    b[4 * i] = _mm256_shuffle_ps(a[4 * i], a[4 * i + 2], 0x44);
    b[4 * i + 1] = _mm256_shuffle_ps(a[4 * i], a[4 * i + 2], 0xEE);
    b[4 * i + 2] = _mm256_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0x44);
    b[4 * i + 3] = _mm256_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(b[k], b[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(b[k], b[4 + k], 0x31);
  }
}

// In-register transpose of a 16 x 16 float32 tile: its quarters transposed, the two off the
// diagonal swapped.
inline void transpose16(V16 t[16]) {
  __m256 a[8], b[8], c[8], d[8];  // rows 0-7 columns 0-7, rows 0-7 columns 8-15, rows 8-15 ...
  for (int i = 0; i < 8; ++i) {
    a[i] = t[i].lo;
    b[i] = t[i].hi;
    c[i] = t[8 + i].lo;
    d[i] = t[8 + i].hi;
  }
  transpose8(a);
  transpose8(b);
  transpose8(c);
  transpose8(d);
  for (int i = 0; i < 8; ++i) {
    t[i] = {a[i], c[i]};
    t[8 + i] = {b[i], d[i]};
  }
}

#endif

// exp(x) with x clamped to [-87, 88.7] (about 1.6e-38 to 3.3e38, so never 0 or inf): x = n ln2 + r,
// |r| <= ln2 / 2, a degree-7 Taylor polynomial for exp(r) (relative error below 1e-8), then
// scaled by 2^n. The attention's softmax weights (scores minus their running maximum, <= 0) and
// the decode step's SiLU use it.
inline V16 vexp(V16 x) {
  x = vmin(vmax(x, vset1(-87.0f)), vset1(88.7f));
  const V16 n = vround(vmul(x, vset1(1.44269504088896341f)));
  V16 r = vfnmadd(n, vset1(0.693145751953125f), x);  // ln2, split in two
  r = vfnmadd(n, vset1(1.428606765330187e-06f), r);
  V16 p = vset1(1.0f / 5040);
  p = vfmadd(p, r, vset1(1.0f / 720));
  p = vfmadd(p, r, vset1(1.0f / 120));
  p = vfmadd(p, r, vset1(1.0f / 24));
  p = vfmadd(p, r, vset1(1.0f / 6));
  p = vfmadd(p, r, vset1(0.5f));
  p = vfmadd(p, r, vset1(1.0f));
  p = vfmadd(p, r, vset1(1.0f));
  return vmul_pow2(p, n);
}

}  // namespace simd16

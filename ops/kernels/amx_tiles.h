// What the AMX kernels (q4_amx.cpp, q8_amx.cpp) share: the CPU and OS checks (init: vector
// paths everywhere with AVX-512, tiles only where AMX is granted), the one tile
// configuration they use, one group's tile products, bf16 widening, row padding (and, from
// cpu_blocks.h, the split of output blocks over torch's threads). Header-only; cpp_build keys every kernel's build
// on this directory's headers too.
//
// Tiles (palette 1): tmm0, tmm1 and tmm5, tmm6 C (16 x 16 fp32); tmm2 and tmm7 A (16 rows x 32
// bf16); tmm3, tmm4 B (16 row pairs x 16 columns x 2, the VNNI layout). One tile product is then
// one group of 32 along K, which is what both weight formats' scales are per.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <cpuid.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_blocks.h"

namespace treeserve_amx {

constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Loads the configuration above on the calling thread (each OpenMP thread calls it): tiles
// 0..count-1, each 16 rows x 64 bytes (the tree-attention kernel asks for all 8).
inline void configure_tiles(int count = 5) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < count; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// What a kernel's init reports (a bit mask): its vector paths may run (the CPU has AVX-512BW,
// and AVX512-BF16 where the kernel asks for it), its tile paths may run too (AMX-BF16 tiles,
// which Linux granted this process with arch_prctl), and the CPU has AVX512-VNNI.
constexpr int kVectors = 1;
constexpr int kTiles = 2;
constexpr int kVnni = 4;  // AVX512-VNNI: the int8-row path of q4_amx may run

// Whether this process may run tile instructions, set once by init(); every tile path checks
// it, so a kernel loaded on a CPU (or a VM) without AMX runs its vector paths at every shape.
inline bool tiles_granted = false;
inline bool has_vnni = false;  // likewise for the paths that need AVX512-VNNI

inline int init(bool needs_avx512_bf16) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
  const bool avx512bw = (b >> 30) & 1, amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
  const bool avx512_vnni = (c >> 11) & 1;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
  const bool avx512_bf16 = (a >> 5) & 1;
  if (!avx512bw || (needs_avx512_bf16 && !avx512_bf16)) return 0;
  tiles_granted = amx_bf16 && amx_tile && avx512_bf16 &&
                  syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  has_vnni = avx512_vnni;
  return kVectors | (tiles_granted ? kTiles : 0) | (has_vnni ? kVnni : 0);
}

// 16 bf16 values -> 16 fp32 (exact).
inline __m512 bf16x16_to_f32(const uint16_t* src) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// The B tiles (tmm3, tmm4) from one group's two expanded 16 x 32 bf16 tiles.
inline void load_b_tiles(const uint16_t* b0, const uint16_t* b1) {
  _tile_loadd(3, b0, 64);
  _tile_loadd(4, b1, 64);
}

// One group's products for a row tile of 16 rows (A: 16 rows of 32 bf16 at a, row stride
// stride_bytes) times the loaded B tiles (tmm3, tmm4: configure_tiles(8)), on C pair P: tmm0,
// tmm1 with A in tmm2, or tmm5, tmm6 with A in tmm7. Two row tiles alternate, so one's products
// run while the other's are stored (store_row_tile: columns 0..15 at c, 16..31 at c + 256).
template <int P>
inline void issue_row_tile(const uint16_t* a, int64_t stride_bytes) {
  if constexpr (P == 0) {  // the tile intrinsics take literal tile numbers
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, a, stride_bytes);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  } else {
    _tile_zero(5);
    _tile_zero(6);
    _tile_loadd(7, a, stride_bytes);
    _tile_dpbf16ps(5, 7, 3);
    _tile_dpbf16ps(6, 7, 4);
  }
}

template <int P>
inline void store_row_tile(float* c) {
  if constexpr (P == 0) {
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
  } else {
    _tile_stored(5, c, 64);
    _tile_stored(6, c + 256, 64);
  }
}

// The groups of one 32-column block, software-pipelined: group g's tile products are issued on
// every row tile (B tiles from b[g & 1], filled by widen(g)), then widen(g + 1) and scale(g - 1)
// run while they do, then they are stored. Row tile mt's products of group g land in
// c + ((g & 1) * MT + mt) * 512: columns 0..15 as 16 rows of 16 fp32, then columns 16..31;
// scale(g) reads them from there (it runs before the same half is stored again). Against
// widening, multiplying and scaling each group in turn: the 4-bit products of a decode step's
// 120 weights at 16 rows 8.15 against 9.02 ms (median of three alternating rounds), 64 rows
// unchanged.
constexpr int64_t kTileElems = 16 * 32;  // bf16 of one B tile (16 row pairs x 32 lanes)

template <class Widen, class Scale>
inline void pipelined_groups(const uint16_t* xa, int64_t K, int64_t MT, int64_t G, uint16_t (*b)[2][kTileElems],
                             float* c, Widen&& widen, Scale&& scale) {
  widen(int64_t{0});
  for (int64_t g = 0; g < G; ++g) {
    load_b_tiles(b[g & 1][0], b[g & 1][1]);
    float* cg = c + (g & 1) * MT * 512;
    for (int64_t mt = 0; mt < MT; ++mt) {  // row tile mt - 1 is stored while mt multiplies
      if (mt % 2 == 0) {
        issue_row_tile<0>(xa + mt * 16 * K + g * 32, K * 2);
        if (mt > 0) store_row_tile<1>(cg + (mt - 1) * 512);
      } else {
        issue_row_tile<1>(xa + mt * 16 * K + g * 32, K * 2);
        store_row_tile<0>(cg + (mt - 1) * 512);
      }
    }
    if (g + 1 < G) widen(g + 1);
    if (g > 0) scale(g - 1);
    if ((MT - 1) % 2 == 0) store_row_tile<0>(cg + (MT - 1) * 512);
    else store_row_tile<1>(cg + (MT - 1) * 512);
  }
  scale(G - 1);
}

// x (M, K) bf16 copied to whole tiles of 16 rows, the padding zero (free() it).
inline uint16_t* padded_rows(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t Mp = (M + 15) / 16 * 16;
  uint16_t* xa = static_cast<uint16_t*>(aligned_alloc(64, ((Mp * K * 2 + 63) / 64) * 64));
  memcpy(xa, x, M * K * 2);
  memset(xa + M * K, 0, (Mp - M) * K * 2);
  return xa;
}

using treeserve_cpu::over_blocks;

}  // namespace treeserve_amx

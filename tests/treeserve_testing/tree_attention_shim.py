"""The CUDA tree-attention kernels' source, compiled for the CPU with g++ and run with emulated
threads: the tests' launcher for :func:`treeserve.ops.kernels.tree_attention_cuda.run_tree_attention`.

A small C++20 shim maps ``blockIdx``/``threadIdx`` to thread-local variables, runs one
``std::thread`` per CUDA thread of a block (the same threads walk every block in turn),
``__syncthreads()`` to a ``std::barrier``, and the block's dynamic shared memory to one static
buffer (one block runs at a time: a barrier ends each block). The kernels therefore run as
written, block size included, barriers and shared memory shared by the block's threads.
"""

from __future__ import annotations

import ctypes
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treeserve.ops.kernels.tree_attention_cuda import F32, I32, I64, KERNEL_NAMES, KERNEL_SOURCE, PTR, Launch

SHARED_DECLARATION = "extern __shared__ __align__(16) unsigned char smem_raw[];"

SHIM_HEAD = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
using std::min;
struct dim3_ { int x, y, z; };
static thread_local dim3_ threadIdx, blockIdx;
static dim3_ blockDim, gridDim;
static std::barrier<>* g_barrier;
alignas(16) static unsigned char g_smem[1 << 18];
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __align__(n) alignas(n)
#define __syncthreads() g_barrier->arrive_and_wait()
static inline float __uint_as_float(unsigned int x) { float f; std::memcpy(&f, &x, sizeof f); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int x; std::memcpy(&x, &f, sizeof x); return x; }
using std::rintf;

// Every thread walks every block in order; a barrier ends each block, so shared memory is
// never touched by two blocks at once.
static void run_grid(int gx, int gy, int gz, int nt, const std::function<void()>& body) {
  blockDim = {nt, 1, 1};
  gridDim = {gx, gy, gz};
  std::barrier<> barrier(nt);
  g_barrier = &barrier;
  std::vector<std::thread> threads;
  for (int i = 0; i < nt; ++i) threads.emplace_back([&, i] {
    threadIdx = {i, 0, 0};
    for (int z = 0; z < gz; ++z) for (int y = 0; y < gy; ++y) for (int x = 0; x < gx; ++x) {
      blockIdx = {x, y, z};
      body();
      barrier.arrive_and_wait();
    }
  });
  for (auto& t : threads) t.join();
}
"""

TILE_WRAPPER = r"""
extern "C" void launch_NAME(int gx, int gy, int gz, int nt, void* q, void* k, void* v, void* lengths, void* bits,
                            void* out, void* pacc, void* pml, long long a0, long long a1, long long a2,
                            long long a3, long long a4, long long a5, int H, int KVH, int T, int D, int tps, int ns,
                            float scale, int vec) {
  run_grid(gx, gy, gz, nt, [&] {
    NAME((const LOAD::T*)q, (const LOAD::T*)k, (const LOAD::T*)v, (const long long*)lengths,
         (const unsigned long long*)bits, (LOAD::T*)out, (float*)pacc, (float*)pml, a0, a1, a2, a3, a4, a5,
         H, KVH, T, D, tps, ns, scale, vec);
  });
}
"""

COMBINE_WRAPPER = r"""
extern "C" void launch_NAME(int gx, int gy, int gz, int nt, void* pacc, void* pml, void* out,
                            int H, int T, int D, int ns, long long total) {
  run_grid(gx, gy, gz, nt, [&] {
    NAME((const float*)pacc, (const float*)pml, (LOAD::T*)out, H, T, D, ns, total);
  });
}
"""

CONVERSIONS = r"""
extern "C" void convert_16_bits(const unsigned short* in, float* out, int n, int kind) {
  for (int i = 0; i < n; ++i) out[i] = kind == 0 ? bf16_bits_to_float(in[i]) : half_bits_to_float(in[i]);
}

extern "C" void store_16_bits(const float* in, unsigned short* out, int n, int kind) {
  for (int i = 0; i < n; ++i) out[i] = kind == 0 ? float_to_bf16_bits(in[i]) : float_to_half_bits(in[i]);
}
"""

LOAD_OF = {"f32": "LoadF32", "bf16": "LoadBF16", "f16": "LoadF16"}
LOADS = {name: LOAD_OF[name.split("_")[2]] for name in KERNEL_NAMES if "_combine_" not in name}
COMBINES = {name: LOAD_OF[name.split("_")[3]] for name in KERNEL_NAMES if "_combine_" in name}
CTYPES = {PTR: ctypes.c_void_p, I32: ctypes.c_int, I64: ctypes.c_longlong, F32: ctypes.c_float}


def shim_source(kernel_source: str = KERNEL_SOURCE) -> str:
    """The C++ translation unit: shim, kernel source (shared memory mapped to the static
    buffer), one ``launch_<kernel>`` per kernel, ``convert_16_bits(in, out, n, kind)`` (the kernel's bf16
    (kind 0) and fp16 (kind 1) loads over ``n`` bit patterns) and ``store_16_bits(in, out, n,
    kind)`` (its stores of ``n`` floats)."""
    if SHARED_DECLARATION not in kernel_source:
        raise ValueError(f"the kernel source no longer declares {SHARED_DECLARATION!r}: update the shim")
    body = kernel_source.replace(SHARED_DECLARATION, "unsigned char* smem_raw = g_smem;")
    wrappers = "".join(TILE_WRAPPER.replace("NAME", name).replace("LOAD", load) for name, load in LOADS.items())
    wrappers += "".join(COMBINE_WRAPPER.replace("NAME", name).replace("LOAD", load) for name, load in COMBINES.items())
    return SHIM_HEAD + body + wrappers + CONVERSIONS


def build(folder: Path, kernel_source: str = KERNEL_SOURCE) -> ctypes.CDLL:
    """Compile the shim with ``g++ -std=c++20`` into ``folder`` and load it; ``RuntimeError``
    with the compiler's output on failure."""
    source = folder / "kernel.cpp"
    source.write_text(shim_source(kernel_source))
    library = folder / "kernel.so"
    done = subprocess.run(
        ["g++", "-std=c++20", "-O2", "-fno-strict-aliasing", "-shared", "-fPIC", "-pthread", str(source), "-o", str(library)],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    return ctypes.CDLL(str(library))


def launcher(library: ctypes.CDLL, calls: list[str] | None = None) -> Launch:
    """A :data:`~treeserve.ops.kernels.tree_attention_cuda.Launch` that runs the kernels in
    ``library`` on CPU tensors; appends each kernel's name to ``calls`` when given."""

    def launch(name: str, grid: tuple[int, int, int], threads: int, shared_bytes: int,
               args: Sequence[tuple[str, Any]]) -> None:
        assert name in KERNEL_NAMES and shared_bytes <= 1 << 18
        if calls is not None:
            calls.append(name)
        values = [ctypes.c_void_p(value.data_ptr()) if kind == PTR else CTYPES[kind](value) for kind, value in args]
        getattr(library, f"launch_{name}")(*grid, threads, *values)

    return launch

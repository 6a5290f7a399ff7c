"""The CUDA tree-attention kernel's source, compiled for the CPU and run with emulated threads.

No GPU is needed: a small C++20 shim maps ``blockIdx``/``threadIdx`` to loops and
``std::thread``s and ``__syncthreads()`` to a ``std::barrier``, so the kernel's masking,
reductions and output pass run exactly as written (several block sizes, including the real
one). Results must match the float64 reference of the CPU twin test. Skips without ``g++``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from treeserve.ops.kernels.tree_attention_cuda import KERNEL_SOURCE, THREADS_PER_BLOCK

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to emulate the kernel")

SHIM_HEAD = r"""
#include <barrier>
#include <cmath>
#include <thread>
#include <vector>
struct dim3_ { int x, y, z; };
static thread_local dim3_ threadIdx;
static dim3_ blockIdx, blockDim;
static std::barrier<>* g_barrier;
static float g_smem[1 << 16];
#define __global__
#define __shared__
#define __syncthreads() g_barrier->arrive_and_wait()
"""
SHIM_TAIL = r"""
extern "C" void launch(int gx, int gy, int gz, int nt, const float* q, const float* k, const float* v,
                       const int* pl, const int* par, float* scratch, float* out,
                       int H, int KVH, int T, int S, int D, float scale) {
  blockDim = {nt, 1, 1};
  for (int z = 0; z < gz; ++z) for (int y = 0; y < gy; ++y) for (int x = 0; x < gx; ++x) {
    blockIdx = {x, y, z};
    std::barrier<> barrier(nt);
    g_barrier = &barrier;
    std::vector<std::thread> threads;
    for (int i = 0; i < nt; ++i) threads.emplace_back([=] {
      threadIdx = {i, 0, 0};
      tree_attention_fwd(q, k, v, pl, par, scratch, out, H, KVH, T, S, D, scale);
    });
    for (auto& t : threads) t.join();
  }
}
"""


@pytest.fixture(scope="module")
def emulated_kernel(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    folder = tmp_path_factory.mktemp("kernel")
    body = KERNEL_SOURCE.replace("extern __shared__ float smem[];", "float* smem = g_smem;")
    source = folder / "kernel.cpp"
    source.write_text(SHIM_HEAD + body + SHIM_TAIL)
    library = folder / "kernel.so"
    done = subprocess.run(
        ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", str(source), "-o", str(library)],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0 and "barrier" in done.stderr:
        pytest.skip("g++ lacks C++20 <barrier>")
    assert done.returncode == 0, done.stderr
    return ctypes.CDLL(str(library))


def twin_module():  # type: ignore[no-untyped-def]
    """The CPU twin test module, for its inputs and float64 reference."""
    spec = importlib.util.spec_from_file_location("tree_attention_twin", Path(__file__).with_name("test_tree_attention.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


# The real block size once (it spawns 128 OS threads per block), smaller ones for both inputs.
@pytest.mark.parametrize(("threads", "seed"), [(1, 0), (8, 0), (8, 1), (THREADS_PER_BLOCK, 1)])
def test_kernel_source_matches_reference(emulated_kernel: ctypes.CDLL, threads: int, seed: int) -> None:
    twin = twin_module()
    q, k, v, prefix_lengths, parents_rows = twin.make_inputs(seed)
    batch, heads, num_new, head_dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    parents = torch.tensor(parents_rows, dtype=torch.int32)
    lengths = prefix_lengths.to(torch.int32)
    scratch = torch.empty(batch, heads, num_new, slots)
    out = torch.empty_like(q)
    ptr = ctypes.c_void_p
    emulated_kernel.launch(
        num_new, heads, batch, threads,
        ptr(q.data_ptr()), ptr(k.data_ptr()), ptr(v.data_ptr()), ptr(lengths.data_ptr()), ptr(parents.data_ptr()),
        ptr(scratch.data_ptr()), ptr(out.data_ptr()),
        heads, kv_heads, num_new, slots, head_dim, ctypes.c_float(head_dim**-0.5),
    )
    expected = twin.reference_attention(q, k, v, prefix_lengths, parents_rows)
    assert (out.double() - expected).abs().max().item() < 1e-5
    # A wrong tree (a chain) gives different outputs through the same kernel: the check can fail.
    chain = torch.arange(-1, num_new - 1, dtype=torch.int32).repeat(batch, 1)
    emulated_kernel.launch(
        num_new, heads, batch, threads,
        ptr(q.data_ptr()), ptr(k.data_ptr()), ptr(v.data_ptr()), ptr(lengths.data_ptr()), ptr(chain.data_ptr()),
        ptr(scratch.data_ptr()), ptr(out.data_ptr()),
        heads, kv_heads, num_new, slots, head_dim, ctypes.c_float(head_dim**-0.5),
    )
    assert (out.double() - expected).abs().max().item() > 1e-2

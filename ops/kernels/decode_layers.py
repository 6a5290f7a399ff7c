"""Every transformer block in one C++ op (``decode_layers.cpp``): the forward of the formats of
GGUF blocks (q4_1, and gguf's mix of 4-bit and 8-bit codes) on CPUs with AVX2, for every shape serving runs (a decode step, a token tree, a batch of rows, a
prefill of any length), with one answer per row.

``torch.ops.treeserve_layers.run`` computes each row of its input the same way whatever else
shares the call: the products (4-bit or 8-bit codes, each linear on its own kernel) quantize
each row on its own and sum exact int32 dots per group (the AVX2 kernels, or those of
``q4_amx.cpp`` on AVX512-VNNI: :func:`~treeserve.ops.fused_step.kernel_of`); the norms,
RoPE, SiLU and residual adds work row by row in a fixed order; and the attention sums over each
token's visible keys in an order fixed by their place in its own sequence (see
``decode_layers_attn_blocks.h``). So a token's logits are the same bits in a one-token step, a
chain, a tree, a batch of 64 rows or a prefill, and speculation, batching and prefill chunking
never change a greedy answer (``tests/ops/test_row_invariance.py``). The op has two builds,
AVX-512 (on hosts with it) and AVX2 (:func:`flags`), which compute the same bits (a test
compares them); its products are those of the host's kernel (each path's invariance is tested,
not their agreement with each other).

``torch.ops.treeserve_layers.attend`` runs one layer's attention alone, as ``run`` does (for
``tests/ops/test_decode_layers_attention.py`` and ``bench/attention_kernel.py``).

It also spares the compiled step's Python wrapper (~330 calls a step), so q4_1 needs neither
Python per op nor compiling. :func:`~treeserve.ops.fused_step.fits` says whether a model can
take it: every block's
linears on the ``q4_amx`` packing with one of the two int8-row kernels or on ``codes8``'s (on the
same CPU's kernels), without biases but Q/K/V's (Qwen2's), without hooks
(a tensor-parallel shard's all-reduce keeps the compiled step), bf16 activations, a head size
that is a multiple of 16 (at most 256) and at most 16 query heads per KV head; Gemma 3's sliding
windows, local rope, output norms, GELU and attention scale are the op's too.
:mod:`~treeserve.ops.fused_step` holds what reads a model for the op (this module knows no
model: the kernels are a leaf).

Built once per machine (:mod:`cpp_build`) after the ops it calls are loaded.
"""

from __future__ import annotations

from pathlib import Path

from treeserve.ops.kernels import avx2, cpp_build, tree_attention_cpu

SOURCE = Path(__file__).with_name("decode_layers.cpp")
AVX2_FLAGS = (*avx2.FLAGS, "-ffp-contract=off")
AVX512_FLAGS = (*cpp_build.AVX512, "-mfma", "-mf16c", "-ffp-contract=off")
"""The op's two builds: its attention's 16-lane vectors are two ymm halves or one zmm register,
added in the same order either way, so both compute the same bits; no contraction of scalar
multiply-adds into FMAs at the compiler's choice (its vector FMAs are written out)."""
MAX_HEAD_DIM = 256
MAX_GROUP = 16
"""The op's limits: the head size (a multiple of 16) and the query heads per KV head."""


def flags() -> tuple[str, ...]:
    """The build this CPU runs (as :func:`cpp_build.simd16_flags` picks it: ``TREESERVE_ISA=avx2``
    picks the AVX2 build on an AVX-512 host)."""
    return AVX512_FLAGS if cpp_build.simd16_flags() == cpp_build.AVX512 else AVX2_FLAGS


def available() -> bool:
    """True when the op is built and loaded here (a CPU with AVX2, FMA and F16C, where the AVX2
    matrix kernel and the CPU tree-attention kernel, whose ``write_kv`` it calls, load, and a
    C++ compiler)."""
    return cpp_build.load_ops(SOURCE, _flags)


def _flags() -> tuple[str, ...] | None:
    return flags() if avx2.loaded() and tree_attention_cpu.available() else None

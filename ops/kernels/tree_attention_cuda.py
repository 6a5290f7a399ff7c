"""The verify step's attention on CUDA: a CuPy ``RawModule`` over the committed prefix and a
token tree given as ancestor bitmasks (FlexFlow Serve's layout).

Contract (the CPU twin is :func:`treeserve.ops.tree_attention.tree_attention_from_bits`):

* ``q`` ``(B, H, T, hd)``, any strides with ``hd`` contiguous (the model passes its
  ``(B, T, H, hd)`` projection transposed, read in place);
* ``k``, ``v`` ``(B, n_kv, C, hd)``, the cache's own storage (``hd`` contiguous, one set of
  strides for both): row ``b``'s committed prefix is slots ``[0, prefix_lengths[b])`` and its
  ``T`` new tokens follow it; ``H`` a multiple of ``n_kv`` (GQA: each KV head is read once per
  tile for all its query heads, never expanded);
* ``ancestor_bits`` ``(B, T)`` int64 read as uint64: bit ``j`` of word ``t`` is set iff new
  token ``t`` sees new token ``j`` (itself and its ancestors; at most 64 nodes). Bit ``t`` of
  word ``t`` must be set, so that every row has a visible key;
* ``prefix_lengths`` ``(B,)`` int64 (the cache's own lengths: nothing to convert per layer);
* float32, bfloat16 or float16, one dtype for all three; scores, the softmax and the sums in
  float32; returns ``(B, H, T, hd)`` in that dtype, rounded to nearest even by the kernel itself
  (a transposed view of ``(B, T, H, hd)``).

Design (flash-decoding for trees):

* A block owns one KV head of one row, 16 or 32 query rows (a query row is one new token under
  one of the KV head's ``H / n_kv`` query heads; 32 for wide trees, :func:`rows_per_block`) and
  one *split*, a run of the row's keys. It walks its keys in tiles of ``KEYS``: loads the
  tile's K and V into shared memory as float32 (16 bytes a load where the cache is aligned),
  scores four query rows against one key an item (float4 reads of shared memory), hides a key
  ``L + j`` from token ``t`` unless bit ``j`` of ``ancestor_bits[t]`` is set, and folds the tile
  into running (max, sum, accumulator) state with the online softmax's rescale, two rows by
  four dims an item. Nothing of size ``S`` is ever written.
* With one split the block writes the normalised output. With several (a long prefix and
  few blocks: the host picks splits until the grid holds :data:`BLOCKS_PER_SM` blocks per
  multiprocessor) each writes its unnormalised state, and ``tree_attention_combine_*``
  merges the splits' states per output element.
* Any ``blockDim.x`` works (every loop strides by it, and barriers are the only
  synchronisation: no warp shuffles), so a CPU shim can run this source with emulated
  threads (``tests/ops/test_tree_attention_emulated.py``).

:func:`run_tree_attention` is the host side with the launcher left open (the driver or CuPy
here, the CPU shim in the tests), so the plan, strides, workspace and combine are the same code
in both. ``cupy`` is imported only when a kernel runs on CUDA. At a verify step's sizes a call
is bound by its host time, so the host side keeps to one allocation and one or two launches
(bench/RESULTS.md, "On a GPU", has the figures from one H200).
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ROWS = 16
"""Query rows per block by default (the kernel source's ``ROWS``; :data:`ROW_VARIANTS` are built)."""
KEYS = 32
"""Keys per shared-memory tile (the kernel source's ``KEYS``)."""
KPAD = 4
"""Floats of padding per key row of the K tile (the kernel source's ``KPAD``)."""
VEC_BYTES = 16
"""K/V tiles load this many bytes at a time where rows are aligned to it."""
THREADS_PER_ROW = 8
"""Threads per block per query row: a block of 16 rows runs 128 threads, one item each in the
score and weighted-value loops at head dim 64."""
BLOCKS_PER_SM = 4
"""Splits are added until the grid holds about this many blocks per multiprocessor (on one H200:
64-node trees over 2048/8192 keys took 0.058/0.180 ms at 2, 0.044/0.146 at 4; 16-node ones the
same or better)."""
WIDE_ROWS_FROM = 128
"""Query rows per KV head from which a block takes 32 rows instead of 16: on one H200, a 64-node
tree at GQA 3 (192 rows) took 0.041/0.107 ms against 0.044/0.146 over 2048/8192 keys, and a
16-node one (48 rows) 0.030/0.055 against 0.027/0.048."""
MAX_TREE_NODES = 64
"""New tokens per row: one 64-bit ancestor word each."""
MAX_HEAD_DIM = 256
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
MIN_TILES_PER_SPLIT = 4
"""A split walks at least this many key tiles, so its state write and the combine stay small
against its work."""

KERNEL_SOURCE = Path(__file__).with_name("tree_attention.cu").read_text(encoding="utf-8")
"""The kernels' CUDA C (``tree_attention.cu``, beside this file), compiled by NVRTC through CuPy."""


ROW_VARIANTS = (16, 32)
"""Query rows a block, one kernel build each (the source's ``ROWS``)."""
KERNEL_NAMES = tuple(f"tree_attention_{dtype}_r{rows}" for rows in ROW_VARIANTS for dtype in DTYPES.values()) + tuple(
    f"tree_attention_combine_{dtype}" for dtype in DTYPES.values())

PTR, I32, I64, F32 = "ptr", "i32", "i64", "f32"
TILE_SIGNATURE = (PTR,) * 8 + (I64,) * 6 + (I32,) * 6 + (F32, I32)
COMBINE_SIGNATURE = (PTR,) * 3 + (I32,) * 4 + (I64,)
COMBINE_THREADS = 256

Launch = Callable[[str, tuple[int, int, int], int, int, Sequence[tuple[str, Any]]], None]
"""``launch(kernel_name, grid, threads_per_block, shared_bytes, args)``, args as ``(kind, value)``
pairs: a kind of :data:`PTR` takes a tensor (its ``data_ptr``), the others a number."""


@dataclass(frozen=True)
class LaunchPlan:
    """How one call is cut into blocks: ``row_tiles`` blocks of ``rows`` query rows per KV head
    and row, each of ``num_splits`` splits walking ``tiles_per_split`` key tiles."""

    rows: int
    row_tiles: int
    num_splits: int
    tiles_per_split: int

    def grid(self, batch: int, kv_heads: int) -> tuple[int, int, int]:
        return (self.num_splits, self.row_tiles * kv_heads, batch)


def plan_launch(batch: int, heads: int, kv_heads: int, num_new: int, max_keys: int, *, num_sms: int,
                num_splits: int | None = None, rows: int = ROWS, blocks_per_sm: int = BLOCKS_PER_SM) -> LaunchPlan:
    """The launch for rows of up to ``max_keys`` keys (longest prefix + ``num_new``) in blocks of
    ``rows`` query rows: splits keys until the grid holds about ``blocks_per_sm`` blocks per
    multiprocessor (``num_sms``), each split walking at least :data:`MIN_TILES_PER_SPLIT`
    tiles; ``num_splits`` forces a count (tests)."""
    if rows not in ROW_VARIANTS:
        raise ValueError(f"blocks of {rows} query rows are not built; the kernels take {ROW_VARIANTS}")
    row_tiles = -(-(heads // kv_heads) * num_new // rows)
    num_tiles = -(-max_keys // KEYS)
    if num_splits is None:
        blocks = row_tiles * kv_heads * batch
        wanted = -(-blocks_per_sm * num_sms // blocks)
        num_splits = max(1, min(wanted, num_tiles // MIN_TILES_PER_SPLIT))
    num_splits = max(1, min(num_splits, num_tiles))
    tiles_per_split = -(-num_tiles // num_splits)
    num_splits = -(-num_tiles // tiles_per_split)  # no split left without a tile
    return LaunchPlan(rows, row_tiles, num_splits, tiles_per_split)


def rows_per_block(query_rows: int) -> int:
    """The block's query rows for ``query_rows`` rows per KV head (new tokens x query heads per
    KV head): 32 from :data:`WIDE_ROWS_FROM` on, else :data:`ROWS`."""
    return max(ROW_VARIANTS) if query_rows >= WIDE_ROWS_FROM else ROWS


def tile_smem_bytes(head_dim: int, rows: int = ROWS) -> int:
    """Dynamic shared memory of one tile kernel block of ``rows`` query rows (the kernel's layout)."""
    floats = rows * head_dim + KEYS * (head_dim + KPAD) + KEYS * head_dim + rows * KEYS + rows * head_dim + 3 * rows
    return rows * 8 + rows * 4 + floats * 4


def loads_vectors(k: Tensor, v: Tensor) -> bool:
    """Whether the kernel can load K/V :data:`VEC_BYTES` at a time: both start aligned to it
    and every row, head and batch stride (and the head dim) is a whole number of such loads."""
    per_load = VEC_BYTES // k.element_size()
    return (k.data_ptr() % VEC_BYTES == 0 and v.data_ptr() % VEC_BYTES == 0
            and all(n % per_load == 0 for n in (k.shape[3], k.stride(0), k.stride(1), k.stride(2))))


def check_inputs(q: Tensor, k: Tensor, v: Tensor, prefix_lengths: Tensor, ancestor_bits: Tensor) -> None:
    """``ValueError`` for shapes, dtypes or layouts the kernel does not take."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q must be (B, H, T, hd) and k, v (B, n_kv, C, hd) alike, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    batch, heads, num_new, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit q {tuple(q.shape)}")
    if heads % k.shape[1]:
        raise ValueError(f"num_heads {heads} must be a multiple of num_kv_heads {k.shape[1]}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype of {sorted(map(str, DTYPES))}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 1 <= num_new <= MAX_TREE_NODES:
        raise ValueError(f"the kernel takes 1 to {MAX_TREE_NODES} new tokens per row, got {num_new}")
    if head_dim > MAX_HEAD_DIM or head_dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4 and <= {MAX_HEAD_DIM}, got {head_dim}")
    if q.stride(3) != 1 or k.stride(3) != 1 or k.stride() != v.stride():
        raise ValueError("q, k and v need a contiguous head dim, and k and v one set of strides")
    if ancestor_bits.shape != (batch, num_new) or ancestor_bits.dtype != torch.int64:
        raise ValueError(f"ancestor_bits must be int64 (B, T) = {(batch, num_new)}, got "
                         f"{ancestor_bits.dtype} {tuple(ancestor_bits.shape)}")
    if prefix_lengths.shape != (batch,):
        raise ValueError(f"prefix_lengths must be (B,) = ({batch},), got {tuple(prefix_lengths.shape)}")


def run_tree_attention(
    q: Tensor, k: Tensor, v: Tensor, prefix_lengths: Tensor, ancestor_bits: Tensor, *, launch: Launch,
    num_sms: int, max_prefix_length: int | None = None, num_splits: int | None = None, rows: int | None = None,
    blocks_per_sm: int = BLOCKS_PER_SM, threads_per_block: int | None = None,
) -> Tensor:
    """The host side of the kernel on ``launch`` (the CUDA launcher, or the tests' CPU shim):
    checks, plan, workspace, the tile kernel and, with several splits, the combine. See the
    module docstring for the contract. ``max_prefix_length`` (the longest ``prefix_lengths``,
    when the caller knows it) spares a device-to-host read; ``rows`` (default
    :func:`rows_per_block`), ``blocks_per_sm`` and ``threads_per_block`` (default
    :data:`THREADS_PER_ROW` a row) shape the launch."""
    check_inputs(q, k, v, prefix_lengths, ancestor_bits)
    batch, heads, num_new, head_dim = q.shape
    kv_heads, capacity = k.shape[1], k.shape[2]
    if max_prefix_length is None:
        max_prefix_length = int(prefix_lengths.max())
    if max_prefix_length + num_new > capacity:
        raise ValueError(f"k/v hold {capacity} slots but a prefix of {max_prefix_length} and {num_new} new tokens need more")
    if rows is None:
        rows = rows_per_block(heads // kv_heads * num_new)
    plan = plan_launch(batch, heads, kv_heads, num_new, max_prefix_length + num_new, num_sms=num_sms,
                       num_splits=num_splits, rows=rows, blocks_per_sm=blocks_per_sm)
    lengths = prefix_lengths.to(device=q.device, dtype=torch.int64).contiguous()  # the cache's own: no copy
    bits = ancestor_bits.to(q.device).contiguous()
    out = torch.empty((batch, num_new, heads, head_dim), dtype=q.dtype, device=q.device)  # (B, T, H, hd)
    many = plan.num_splits > 1
    if many:
        states = batch * heads * num_new * plan.num_splits
        partial_acc = torch.empty((states * head_dim,), dtype=torch.float32, device=q.device)
        partial_ml = torch.empty((states * 2,), dtype=torch.float32, device=q.device)
    else:
        partial_acc = partial_ml = out  # not read or written with one split
    values = (q, k, v, lengths, bits, out, partial_acc, partial_ml,
              q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
              heads, kv_heads, num_new, head_dim, plan.tiles_per_split, plan.num_splits,
              head_dim ** -0.5 * math.log2(math.e), int(loads_vectors(k, v)))
    launch(f"tree_attention_{DTYPES[q.dtype]}_r{rows}", plan.grid(batch, kv_heads),
           threads_per_block or THREADS_PER_ROW * rows, tile_smem_bytes(head_dim, rows), tuple(zip(TILE_SIGNATURE, values)))
    if many:
        total = batch * num_new * heads * head_dim
        blocks = min(-(-total // COMBINE_THREADS), 4 * num_sms)
        launch(f"tree_attention_combine_{DTYPES[q.dtype]}", (blocks, 1, 1), COMBINE_THREADS, 0, tuple(zip(
            COMBINE_SIGNATURE, (partial_acc, partial_ml, out, heads, num_new, head_dim, plan.num_splits, total))))
    return out.transpose(1, 2)  # (B, H, T, hd)


@functools.lru_cache(maxsize=None)
def _cupy_kernels(device_index: int) -> dict[str, Any]:
    """The compiled kernels on one device (CuPy also caches the binary on disk)."""
    import cupy

    with cupy.cuda.Device(device_index):  # compiled by NVRTC on first use, per device
        module = cupy.RawModule(code=KERNEL_SOURCE)
        return {name: module.get_function(name) for name in KERNEL_NAMES}


LAUNCHES = {"driver": 0, "cupy": 0}
"""Kernel launches so far in this process, by path (what the GPU check reports)."""
PACKING = {PTR: "Q", I32: "i", I64: "q", F32: "f"}
"""``struct`` codes of the kernels' parameters: native alignment lays them out as CUDA does."""


@functools.lru_cache(maxsize=None)
def driver_launch() -> Callable[..., int] | None:
    """``cuLaunchKernel`` from the driver library, or None where it cannot be loaded."""
    import ctypes

    try:
        function = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    function.restype = ctypes.c_int
    return function


def _function_handle(kernel: Any) -> int | None:
    """The ``CUfunction`` of a CuPy kernel (a ``RawKernel`` holds it in ``.kernel``; a
    ``Function`` is it), or None where this CuPy does not show it."""
    for candidate in (kernel, getattr(kernel, "kernel", None)):
        ptr = getattr(candidate, "ptr", None)
        if isinstance(ptr, int) and ptr:
            return ptr
    return None


def _current_stream(device_index: int) -> int:
    """The handle of torch's current stream on a device (the raw getter inductor's code calls,
    where this torch has it)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return int(raw(device_index)) if raw is not None else int(torch.cuda.current_stream(device_index).cuda_stream)


@functools.lru_cache(maxsize=None)
def cupy_launch(device_index: int) -> Launch:
    """The launcher of one device (kept: the model calls it once per layer, and at these sizes
    what a call costs on the host is most of what it costs). CuPy compiles and loads the
    kernels; the launch itself goes straight to the driver with the parameters packed into one
    buffer (``CU_LAUNCH_PARAM_BUFFER_POINTER``), which costs a few microseconds against the tens
    that CuPy's per-argument conversion takes. Without the driver library, CuPy launches."""
    import ctypes
    import struct

    import cupy
    import numpy

    kernels = _cupy_kernels(device_index)
    device = cupy.cuda.Device(device_index)
    launch_kernel = driver_launch()
    handles = {name: _function_handle(kernel) for name, kernel in kernels.items()}
    packers = {signature: struct.Struct("@" + "".join(PACKING[kind] for kind in signature))
               for signature in (TILE_SIGNATURE, COMBINE_SIGNATURE)}
    packer_of = {name: packers[COMBINE_SIGNATURE if "_combine_" in name else TILE_SIGNATURE] for name in kernels}
    streams: dict[int, Any] = {}  # torch's stream handle -> its CuPy wrapper (the CuPy path)
    converters: dict[str, Callable[[Any], Any]] = {
        PTR: lambda tensor: numpy.uint64(tensor.data_ptr()), I32: numpy.int32, I64: numpy.int64, F32: numpy.float32}

    def launch(name: str, grid: tuple[int, int, int], threads: int, shared_bytes: int,
               args: Sequence[tuple[str, Any]]) -> None:
        kernel = kernels[name]
        if shared_bytes > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_bytes:
            with device:
                kernel.max_dynamic_shared_size_bytes = shared_bytes  # opt in above the default 48 KiB
        handle = _current_stream(device_index)
        function = handles[name]
        if launch_kernel is not None and function is not None:
            params = ctypes.create_string_buffer(packer_of[name].pack(
                *(value.data_ptr() if kind == PTR else value for kind, value in args)))
            size = ctypes.c_size_t(ctypes.sizeof(params) - 1)  # without create_string_buffer's NUL
            extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(params), 2, ctypes.addressof(size), 0)
            status = launch_kernel(function, *grid, threads, 1, 1, shared_bytes, handle, None, extra)
            if status == 0:
                LAUNCHES["driver"] += 1
                return
            # Refused before it ran (a driver that does not take this launch form): warn once
            # and let CuPy launch this kernel from now on.
            warnings.warn(f"cuLaunchKernel({name}) returned CUresult {status}; CuPy launches it instead",
                          RuntimeWarning, stacklevel=2)
            handles[name] = None
        LAUNCHES["cupy"] += 1
        stream = streams.get(handle)
        if stream is None:
            stream = streams[handle] = cupy.cuda.ExternalStream(handle)
        with device, stream:
            kernel(grid, (threads,), tuple(converters[kind](value) for kind, value in args), shared_mem=shared_bytes)

    return launch


@functools.lru_cache(maxsize=None)
def num_sms_of(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def tree_attention_cuda(q: Tensor, k: Tensor, v: Tensor, prefix_lengths: Tensor, ancestor_bits: Tensor, *,
                        max_prefix_length: int | None = None, num_splits: int | None = None) -> Tensor:
    """Tree attention on CUDA tensors with the CuPy kernels; see the module docstring."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        raise ValueError("tree_attention_cuda needs CUDA tensors")
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return run_tree_attention(q, k, v, prefix_lengths, ancestor_bits, launch=cupy_launch(index), num_sms=num_sms_of(index),
                              max_prefix_length=max_prefix_length, num_splits=num_splits)

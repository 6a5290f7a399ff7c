"""Preallocated per-layer key/value cache with committed lengths and pending tree slots.

Each row of the batch owns a contiguous run of committed slots ``[0, lengths[row])``. A
forward pass writes its ``T`` new tokens of row ``b`` to the *pending* slots
``[lengths[b], lengths[b] + T)`` without advancing ``lengths``. After verification the caller
keeps an accepted path with :meth:`KVCache.commit`, which compacts the kept pending slots
right after the committed prefix; everything else pending lies beyond ``lengths`` and is
overwritten by the next forward, so rejected branches leave no trace.

Padding in a batch: every row of one forward has the same number ``T`` of new tokens. A row
with fewer real tokens is padded by the caller with any valid token id whose ``tree_mask`` row
lets it attend to itself (so attention is well defined) and which no real token attends to;
its pending slots are simply never kept by ``commit``. A row that should not move at all can
be padded the same way and committed with ``keep=[]``. The cache must have room for
``lengths[b] + T`` slots in every row, padding included.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def write_pending(keys: Tensor, values: Tensor, new_keys: Tensor, new_values: Tensor, lengths: Tensor) -> None:
    """Store new tokens' ``new_keys``/``new_values`` ``(B, T, n_kv, hd)`` at slots
    ``lengths[b] + t`` of one layer's ``keys``/``values`` ``(B, n_kv, C, hd)``, in place.

    Under ``torch.compile`` this is an opaque op (``treeserve::write_pending``): there, the same
    indexed store is functionalized into a copy of the whole cache layer per step (a 64-row
    decode step took 90 ms on a 260-slot cache and 311 ms on a 1,256-slot one). Eagerly it
    stores directly (a custom op's first eager call imports torch._dynamo, 1.7 s).
    ``kernels.tree_attention_cpu.write_kv`` is its C++ twin.
    """
    if torch.compiler.is_compiling():
        _write_pending_op(keys, values, new_keys, new_values, lengths)
    else:
        _store(keys, values, new_keys, new_values, lengths)


def _store(keys: Tensor, values: Tensor, new_keys: Tensor, new_values: Tensor, lengths: Tensor) -> None:
    rows = torch.arange(keys.shape[0], device=keys.device)[:, None]  # (B, 1)
    slots = lengths[:, None] + torch.arange(new_keys.shape[1], device=keys.device)  # (B, T)
    keys[rows, :, slots] = new_keys  # indexed (B, T) -> (B, T, n_kv, hd)
    values[rows, :, slots] = new_values


@torch.library.custom_op("treeserve::write_pending", mutates_args=("keys", "values"))
def _write_pending_op(keys: Tensor, values: Tensor, new_keys: Tensor, new_values: Tensor, lengths: Tensor) -> None:
    _store(keys, values, new_keys, new_values, lengths)


@_write_pending_op.register_fake
def _write_pending_shape(keys: Tensor, values: Tensor, new_keys: Tensor, new_values: Tensor, lengths: Tensor) -> None:
    return None


class CacheCapacityError(ValueError):
    """Raised when a write or commit would go beyond the cache's preallocated capacity."""


class KVCache:
    """Key/value storage for ``num_layers`` layers of shape ``(B, num_kv_heads, capacity, head_dim)``.

    ``lengths`` (LongTensor ``(B,)``) holds each row's committed length. ``num_pending[row]``
    is how many slots the last forward wrote after ``lengths[row]``; :meth:`commit` may keep
    only those. The tensors are in the model's dtype and device. Not thread-safe.

    ``headroom`` slots past ``capacity`` are storage that nothing commits into: a captured
    step (:mod:`~treeserve.ops.graph_step`) writes its padding there, so that a forward padded
    to a fixed shape never needs the lengths on the host to stay in bounds.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        headroom: int = 0,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("capacity", capacity),
        ):
            if value <= 0:
                raise ValueError(f"KVCache {name} must be positive, got {value}")
        if headroom < 0:
            raise ValueError(f"KVCache headroom must be >= 0, got {headroom}")
        self.num_layers = num_layers
        self.batch_size = batch_size
        self.capacity = capacity
        self.headroom = headroom
        shape = (batch_size, num_kv_heads, capacity + headroom, head_dim)
        self.keys: list[Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values: list[Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths: Tensor = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.num_pending: list[int] = [0] * batch_size

    # ------------------------------------------------------------------ writes by the model
    def begin_write(self, num_new: int) -> list[int]:
        """Check room for ``num_new`` pending tokens in every row, mark them pending, return lengths.

        Called once per forward by the model, before any layer writes. Returns the committed
        lengths as Python ints (one host read per forward, not per layer).
        """
        lengths = [int(x) for x in self.lengths.tolist()]
        worst = max(lengths) + num_new
        if worst > self.capacity:
            raise CacheCapacityError(
                f"KV cache full: a row with {max(lengths)} committed tokens cannot take {num_new} "
                f"new ones (capacity {self.capacity}); truncate or reset the row, or make a bigger cache"
            )
        self.mark_pending(num_new)
        return lengths

    def mark_pending(self, num_new: int) -> None:
        """Mark ``num_new`` pending slots in every row without reading the lengths: for a
        caller that checked the rows' room itself (:meth:`begin_write` checks and marks)."""
        self.num_pending = [num_new] * self.batch_size

    def write(self, layer: int, k_new: Tensor, v_new: Tensor, lengths: Sequence[int]) -> None:
        """Store new keys/values ``(B, n_kv, T, hd)`` for ``layer`` at slots ``[lengths[b], lengths[b]+T)``."""
        num_new = k_new.shape[2]
        kc, vc = self.keys[layer], self.values[layer]
        first = lengths[0]
        if all(length == first for length in lengths):
            # Common case (batch 1, or rows in lockstep): one strided copy, no index tensors.
            kc[:, :, first : first + num_new] = k_new
            vc[:, :, first : first + num_new] = v_new
            return
        for b, length in enumerate(lengths):
            kc[b, :, length : length + num_new] = k_new[b]
            vc[b, :, length : length + num_new] = v_new[b]

    # ------------------------------------------------------------------ bookkeeping by the caller
    def commit(self, row: int, keep: Sequence[int]) -> None:
        """Keep the pending slots at relative indices ``keep`` of ``row`` and advance its length.

        ``keep`` must be strictly ascending (an ancestors-first root-to-leaf accepted path) and
        index the slots the last forward wrote. They are compacted into
        ``[lengths[row], lengths[row] + len(keep))``; all other pending slots are discarded.
        """
        self._check_row(row)
        keep = [int(i) for i in keep]
        pending = self.num_pending[row]
        if any(i < 0 or i >= pending for i in keep):
            raise ValueError(f"commit keep={keep} outside the {pending} pending slots of row {row}")
        if any(b <= a for a, b in zip(keep, keep[1:])):
            raise ValueError(f"commit keep={keep} must be strictly ascending (root-to-leaf order)")
        length = int(self.lengths[row])
        if length + len(keep) > self.capacity:  # cannot happen after a checked write; kept for safety
            raise CacheCapacityError(f"commit of {len(keep)} slots overflows capacity {self.capacity}")
        if keep and keep != list(range(len(keep))):
            src = torch.tensor(keep, dtype=torch.long, device=self.lengths.device) + length
            dst = slice(length, length + len(keep))
            for kc, vc in zip(self.keys, self.values):
                # index_select copies first, so overlapping source/destination slots are safe.
                kc[row, :, dst] = kc[row].index_select(1, src)
                vc[row, :, dst] = vc[row].index_select(1, src)
        self.lengths[row] = length + len(keep)
        self.num_pending[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        """Move ``src``'s committed keys and values (and its length) to the empty row ``dst``;
        ``src`` is left empty. Only the committed slots are copied, so a move costs the row's
        length, not the capacity. A scheduler that parks a preempted request moves it out of
        the rows its steps run, and back when it resumes: the forward then reads exactly the
        keys and values it would have read had the request never left."""
        self._check_row(src)
        self._check_row(dst)
        if src == dst:
            raise ValueError(f"move_row needs two different rows, got {src} twice")
        if int(self.lengths[dst]) or self.num_pending[dst]:
            raise ValueError(f"move_row's destination row {dst} holds {int(self.lengths[dst])} tokens; reset it first")
        length = int(self.lengths[src])
        for kc, vc in zip(self.keys, self.values):
            kc[dst, :, :length] = kc[src, :, :length]
            vc[dst, :, :length] = vc[src, :, :length]
        self.lengths[dst] = length
        self.num_pending[dst] = 0
        self.reset_row(src)

    def reset_row(self, row: int) -> None:
        """Forget everything in ``row`` (committed and pending); its slots will be overwritten."""
        self.truncate(row, 0)

    def truncate(self, row: int, length: int) -> None:
        """Shrink ``row``'s committed length to ``length`` (<= current) and drop its pending slots."""
        self._check_row(row)
        current = int(self.lengths[row])
        if not 0 <= length <= current:
            raise ValueError(f"truncate length must be in [0, {current}] for row {row}, got {length}")
        self.lengths[row] = length
        self.num_pending[row] = 0

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.batch_size:
            raise IndexError(f"row {row} out of range for a KV cache of batch size {self.batch_size}")

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype (the model's dtype)."""
        return self.keys[0].dtype

    @property
    def device(self) -> torch.device:
        """The storage device."""
        return self.keys[0].device

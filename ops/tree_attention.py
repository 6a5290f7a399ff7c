"""Attention of a batch of new tokens (a token tree) over a committed KV prefix.

Conventions shared by every function here (and by the CUDA twin in
``treeserve.ops.kernels.tree_attention_cuda``):

* ``q``: ``(B, H, T, hd)`` queries of the ``T`` new tokens.
* ``k``, ``v``: ``(B, n_kv, S, hd)`` cache slots; row ``b``'s committed prefix is
  ``[0, prefix_lengths[b])`` and its new tokens sit at ``[prefix_lengths[b], prefix_lengths[b]+T)``
  (so ``S >= max(prefix_lengths) + T``). ``H`` must be a multiple of ``n_kv`` (GQA).
* ``tree_mask``: ``(B, T, T)`` bool, ``tree_mask[b, t, s]`` = new token ``t`` may attend to new
  token ``s``. Every token must at least see itself or a non-empty prefix.
* ``parents``: ``(T,)`` or ``(B, T)`` long, the array form of a token tree: ``parents[i]`` is the
  index of node ``i``'s parent among the new tokens, or ``-1`` for a root (a node whose parent
  is the last committed token). Nodes are topologically ordered: ``parents[i] < i``.
* ``ancestor_bits``: ``(B, T)`` int64 read as uint64 words, FlexFlow Serve's form of the tree
  mask for at most 64 nodes: bit ``s`` of word ``t`` is ``tree_mask[b, t, s]``.

On CUDA (with cupy) a tree runs the CuPy kernel of
:mod:`treeserve.ops.kernels.tree_attention_cuda` on ancestor bits, and no dense mask is built
(:func:`uses_tree_kernel` is the rule the model follows); elsewhere, and for chains and plain
decode everywhere, torch's SDPA runs under the mask of :func:`build_attention_mask`.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor


def tree_mask_from_parents(parents: Tensor) -> Tensor:
    """Return the ancestor mask ``(T, T)`` (or ``(B, T, T)``) of a token tree given as parents.

    ``mask[i, j]`` is True iff ``j == i`` or ``j`` is an ancestor of ``i``. ``parents`` uses ``-1``
    for roots and must satisfy ``parents[i] < i``; a ``ValueError`` says which node breaks it.
    """
    if parents.dim() not in (1, 2):
        raise ValueError(f"parents must be (T,) or (B, T), got shape {tuple(parents.shape)}")
    squeeze = parents.dim() == 1
    par = parents.view(1, -1) if squeeze else parents  # (B, T)
    num_rows, num_nodes = par.shape
    index = torch.arange(num_nodes, device=par.device)
    bad = (par >= index) | (par < -1)
    if bool(bad.any()):
        node = int(bad.nonzero()[0, -1])
        raise ValueError(f"parents[{node}] must be -1 or an earlier node index (< {node}); got {par[bad][0].item()}")
    mask = torch.eye(num_nodes, dtype=torch.bool, device=par.device).expand(num_rows, -1, -1).clone()
    rows = torch.arange(num_rows, device=par.device)
    # Parents precede children, so each parent's row is final before its children copy it.
    for i in range(1, num_nodes):
        p = par[:, i]
        has_parent = p >= 0
        inherited = mask[rows, p.clamp(min=0)] & has_parent[:, None]  # (B, T)
        mask[:, i] |= inherited
    return mask[0] if squeeze else mask


def build_attention_mask(prefix_lengths: Tensor, tree_mask: Tensor | None, num_new: int, num_slots: int) -> Tensor:
    """Full slot mask ``(B, 1, T, S)`` (True = attend) for new tokens over ``S`` cache slots.

    Token ``t`` of row ``b`` sees slots ``[0, prefix_lengths[b])`` and new slot
    ``prefix_lengths[b] + s`` iff ``tree_mask[b, t, s]`` (``None``: causal among new tokens).
    Slots beyond ``prefix_lengths[b] + T`` are hidden. The model builds it once per forward.
    """
    device = prefix_lengths.device
    slots = torch.arange(num_slots, device=device)  # (S,)
    committed = slots[None, :] < prefix_lengths[:, None]  # (B, S)
    rel = slots[None, :] - prefix_lengths[:, None]  # (B, S) index among new tokens
    is_new = (rel >= 0) & (rel < num_new)  # (B, S)
    if tree_mask is None:
        t_index = torch.arange(num_new, device=device)
        new_part = (rel[:, None, :] <= t_index[None, :, None]) & is_new[:, None, :]  # (B, T, S)
    else:
        batch = prefix_lengths.shape[0]
        gather_index = rel.clamp(0, num_new - 1)[:, None, :].expand(batch, num_new, num_slots)
        new_part = tree_mask.gather(2, gather_index) & is_new[:, None, :]  # (B, T, S)
    return (committed[:, None, :] | new_part)[:, None]  # (B, 1, T, S)


def window_mask(prefix_lengths: Tensor, positions: Tensor, num_slots: int, window: int) -> Tensor:
    """The slots ``(B, 1, T, S)`` inside each new token's sliding window of ``window`` keys
    (True = within): a key at position ``k`` is within the window of a token at position ``p``
    iff ``p - k < window``. Committed slot ``i`` holds position ``i``; new slot
    ``prefix_lengths[b] + s`` holds ``positions[b, s]`` (a tree node's depth-based position).
    And it with :func:`build_attention_mask`'s mask, which says which slots are visible at all."""
    batch, num_new = positions.shape
    slots = torch.arange(num_slots, device=positions.device)  # (S,)
    key_positions = slots.expand(batch, num_slots).clone()  # (B, S)
    new_slots = prefix_lengths[:, None] + torch.arange(num_new, device=positions.device)  # (B, T)
    key_positions.scatter_(1, new_slots, positions)
    return ((positions[:, :, None] - key_positions[:, None, :]) < window)[:, None]  # (B, 1, T, S)


def attention_under_mask(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, is_causal: bool = False,
                         scale: float | None = None) -> Tensor:
    """Scaled dot-product attention with GQA: q ``(B, H, T, hd)``, k/v ``(B, n_kv, S, hd)``.

    ``mask`` is a bool ``(B, 1, T, S)`` (True = attend) or ``None``; with ``None``, every slot is
    visible unless ``is_causal`` (then ``S == T`` and token t sees slots ``<= t``, which lets
    torch use its fused causal kernel for prefill from an empty cache). ``scale``: the scores'
    factor (None: ``1 / sqrt(hd)``). Returns ``(B, H, T, hd)``.
    """
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1], scale=scale
    )


def tree_attention(q: Tensor, k: Tensor, v: Tensor, prefix_lengths: Tensor, tree_mask: Tensor | None) -> Tensor:
    """Attention of new tokens over committed prefix plus tree-visible new tokens (torch SDPA).

    Shapes as in the module docstring; returns ``(B, H, T, hd)``. Only the first
    ``max(prefix_lengths) + T`` slots of ``k``/``v`` are read.
    """
    num_new = q.shape[2]
    num_slots = int(prefix_lengths.max()) + num_new
    if num_slots > k.shape[2]:
        raise ValueError(f"k/v hold {k.shape[2]} slots but prefix+new tokens need {num_slots}")
    mask = build_attention_mask(prefix_lengths, tree_mask, num_new, num_slots)
    return attention_under_mask(q, k[:, :, :num_slots], v[:, :, :num_slots], mask)


def is_cuda_kernel_available() -> bool:
    """True when CUDA is usable by torch and the ``cupy`` package is installed (no import done)."""
    return torch.cuda.is_available() and _is_cupy_installed()


@functools.lru_cache(maxsize=1)
def _is_cupy_installed() -> bool:
    # Asked once per forward on CUDA: a path search each time would cost more than the answer.
    return importlib.util.find_spec("cupy") is not None


MAX_TREE_NODES = 64
"""New tokens per row an ancestor word holds (the CUDA kernel's limit)."""


def ancestor_bits_from_mask(tree_mask: Tensor) -> Tensor:
    """The ancestor words ``(B, T)`` int64 of a tree mask ``(B, T, T)`` bool (``T <= 64``): bit
    ``s`` of word ``t`` is ``tree_mask[b, t, s]``. One op on the mask's device, no host read."""
    num_nodes = tree_mask.shape[-1]
    if num_nodes > MAX_TREE_NODES:
        raise ValueError(f"ancestor words hold at most {MAX_TREE_NODES} nodes, got a {num_nodes}-node mask")
    powers = torch.ones(num_nodes, dtype=torch.int64, device=tree_mask.device) << torch.arange(
        num_nodes, device=tree_mask.device)  # bit 63 is int64's sign bit: the sum of distinct bits never carries
    return (tree_mask.to(torch.int64) * powers).sum(-1)


def ancestor_bits_from_parents(parents: Tensor) -> Tensor:
    """The ancestor words ``(B, T)`` (or ``(T,)``) of a tree given as parents (checked as
    :func:`tree_mask_from_parents` checks them)."""
    return ancestor_bits_from_mask(tree_mask_from_parents(parents))


def tree_mask_from_ancestor_bits(ancestor_bits: Tensor) -> Tensor:
    """The tree mask ``(B, T, T)`` bool of ancestor words ``(B, T)``: the inverse of
    :func:`ancestor_bits_from_mask`."""
    num_nodes = ancestor_bits.shape[-1]
    shifts = torch.arange(num_nodes, device=ancestor_bits.device)
    return ((ancestor_bits[..., None] >> shifts) & 1).bool()  # the arithmetic shift keeps bit s at bit 0


def uses_tree_kernel(device: torch.device, tree_mask: Tensor | None, num_new: int) -> bool:
    """The model's rule for its attention: True when a token tree (a tree mask over at most
    64 new tokens) on a CUDA device where the kernel can run takes the CuPy kernel; chains,
    plain decode and CPU devices keep SDPA (the CPU's compiled step has its own kernel)."""
    return (tree_mask is not None and device.type == "cuda" and num_new <= MAX_TREE_NODES
            and is_cuda_kernel_available())


def tree_attention_from_bits(q: Tensor, k: Tensor, v: Tensor, prefix_lengths: Tensor, ancestor_bits: Tensor, *,
                             max_prefix_length: int | None = None) -> Tensor:
    """Tree attention with the tree as ancestor words ``(B, T)``: the CuPy kernel on CUDA
    tensors where cupy is installed, else its CPU twin (the ancestor mask, then
    :func:`tree_attention`). Both return ``(B, H, T, hd)`` in q's dtype with the same values
    to float rounding; ``max_prefix_length`` spares the kernel a device-to-host read."""
    if q.is_cuda and is_cuda_kernel_available():
        from treeserve.ops.kernels import tree_attention_cuda

        return tree_attention_cuda.tree_attention_cuda(q, k, v, prefix_lengths, ancestor_bits,
                                                       max_prefix_length=max_prefix_length)
    return tree_attention(q, k, v, prefix_lengths, tree_mask_from_ancestor_bits(ancestor_bits))


def tree_attention_from_parents(q: Tensor, k: Tensor, v: Tensor, prefix_lengths: Tensor, parents: Tensor) -> Tensor:
    """Tree attention with the tree given as ``parents`` ``(T,)`` or ``(B, T)``: converted to
    ancestor words (at most 64 nodes) for :func:`tree_attention_from_bits` on CUDA, to the
    ancestor mask for :func:`tree_attention` elsewhere. Returns ``(B, H, T, hd)``."""
    if parents.dim() == 1:
        parents = parents.expand(q.shape[0], -1)
    if q.is_cuda and is_cuda_kernel_available():
        return tree_attention_from_bits(q, k, v, prefix_lengths, ancestor_bits_from_parents(parents))
    return tree_attention(q, k, v, prefix_lengths, tree_mask_from_parents(parents))

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
"""

from __future__ import annotations

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


def attention_under_mask(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, is_causal: bool = False) -> Tensor:
    """Scaled dot-product attention with GQA: q ``(B, H, T, hd)``, k/v ``(B, n_kv, S, hd)``.

    ``mask`` is a bool ``(B, 1, T, S)`` (True = attend) or ``None``; with ``None``, every slot is
    visible unless ``is_causal`` (then ``S == T`` and token t sees slots ``<= t``, which lets
    torch use its fused causal kernel for prefill from an empty cache). Returns ``(B, H, T, hd)``.
    """
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1]
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
    return torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


def tree_attention_from_parents(q: Tensor, k: Tensor, v: Tensor, prefix_lengths: Tensor, parents: Tensor) -> Tensor:
    """Tree attention with the tree given as ``parents`` ``(B, T)``; dispatches to CUDA or torch.

    On CUDA tensors with cupy installed this runs the fused CuPy kernel
    (mask built in-kernel from the parents); otherwise it builds the ancestor mask and calls
    :func:`tree_attention`. Both paths return ``(B, H, T, hd)`` with the same values (to float
    rounding).
    """
    if parents.dim() == 1:
        parents = parents.expand(q.shape[0], -1)
    if q.is_cuda and is_cuda_kernel_available():
        from treeserve.ops.kernels.tree_attention_cuda import tree_attention_cuda

        result: Tensor = tree_attention_cuda(q, k, v, prefix_lengths, parents)
        return result
    return tree_attention(q, k, v, prefix_lengths, tree_mask_from_parents(parents))

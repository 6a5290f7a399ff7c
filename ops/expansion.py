"""Expansion configs (SpecInfer's tree widths per depth), without torch: the command line reads
them before it imports anything heavy (:mod:`treeserve.ops.drafting` grows trees from them)."""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_EXPANSION: tuple[int, ...] = (1, 1, 3, 1, 1, 1, 1, 1)
"""SpecInfer's expansion config: a chain that branches into 3 at the third step (20 drafts + root)."""


def validate_expansion(expansion: Sequence[int]) -> tuple[int, ...]:
    """Check an expansion config (e.g. ``(1, 1, 3, 1, 1)``) and return it as a tuple."""
    config = tuple(expansion)
    if not config or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in config):
        raise ValueError(f"an expansion config is a non-empty sequence of integers >= 1, got {expansion!r}")
    return config


def worst_case_num_nodes(expansion: Sequence[int]) -> list[int]:
    """Most nodes (root included) a tree can have after each expansion step: entry ``d`` bounds
    the nodes of depth <= ``d`` (no two draws equal), so ``[1, k0 + 1, k0 + k0*k1 + 1, ...]``."""
    sizes, width = [1], 1
    for k in expansion:
        width *= k
        sizes.append(sizes[-1] + width)
    return sizes


__all__ = ["DEFAULT_EXPANSION", "validate_expansion", "worst_case_num_nodes"]

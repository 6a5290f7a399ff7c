"""The speculation modes, without torch (the command line lists them before it imports anything
heavy): one enum for the wire's ``speculate`` field, the scheduler's plans and
:func:`~treeserve.ops.speculative.generate_speculative`."""

from __future__ import annotations

import enum


class SpeculationMode(enum.StrEnum):
    """How a request drafts and verifies; the value is the wire's and the command line's name.

    ``TREE``: trie-merge all speculators' token trees and verify the merged tree (SpecInfer).
    ``CHAIN``: verify only the chain of first proposals of the merged tree (sequence-based
    speculative decoding, the baseline SpecInfer compares against).
    ``NONE``: no drafts: plain incremental decoding.
    """

    TREE = "tree"
    CHAIN = "chain"
    NONE = "none"

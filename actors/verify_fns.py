"""The verify functions a verifier shard runs around :func:`~treeserve.ops.verify.verify`: one
that fails a row alone on its own bad numbers (:func:`row_checked_verifier`), and, under tensor
parallelism, one whose rank 0 decides and broadcasts (:func:`rank0_broadcast_verifier`, over the
process group of :func:`process_group_backend`)."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from treeserve.ops.batch_step import RowStep
from treeserve.ops.sampling import Randomness, SamplingParams
from treeserve.ops.token_tree import TokenTree
from treeserve.ops.verify import VerificationError, VerifyFn, VerifyResult, verify

_log = logging.getLogger(__name__)

class RowVerificationFailed(VerificationError):
    """One row's verification failed on its own numbers (non-finite logits or probabilities)."""


def row_checked_verifier(inner: VerifyFn) -> VerifyFn:
    """``inner``, refusing non-finite logits and turning torch's numerical errors (such as
    ``probability tensor contains either inf, nan or element < 0``) into
    :class:`RowVerificationFailed`, so they stay the failure of one row. On tensor-parallel
    ranks it runs inside rank 0's verifier, whose decision (failure included) is broadcast."""

    def verifier(tree: TokenTree, logits: Tensor, params: SamplingParams, randomness: Randomness) -> VerifyResult:
        # One sum first (a NaN or inf anywhere makes it non-finite), the elementwise check only
        # then: it cost 0.16 ms of a 5 ms step over a 49,152-word vocabulary.
        if not bool(torch.isfinite(logits.sum())) and not bool(torch.isfinite(logits).all()):
            raise RowVerificationFailed("numerical failure: the model's logits for this request are not finite")
        try:
            return inner(tree, logits, params, randomness)
        except RuntimeError as exc:
            raise RowVerificationFailed(f"numerical failure: {exc}") from exc

    return verifier


class RowGuard:
    """A verifier for one ``verify_rows`` call that records a row's ``RowVerificationFailed``
    instead of raising it (other errors, such as an inconsistent draft, still fail the call): that row keeps only its root (committed like an accepted path of
    length one), every other row goes on. Rows are known by their step's tree object."""

    def __init__(self, inner: VerifyFn, steps: list[RowStep]) -> None:
        self.failures: dict[int, str] = {}
        self._inner = inner
        self._row_of = {id(step.tree): step.row for step in steps}

    def __call__(self, tree: TokenTree, logits: Tensor, params: SamplingParams,
                 randomness: Randomness) -> VerifyResult:
        try:
            return self._inner(tree, logits, params, randomness)
        except RowVerificationFailed as exc:
            row = self._row_of[id(tree)]
            _log.warning("verifier row %d failed: %s", row, exc)
            self.failures[row] = str(exc)
            return VerifyResult([0], int(tree.tokens[0]))


def process_group_backend(device: str, tp_size: int) -> str | None:
    """The ``torch.distributed`` backend a shard joins: NCCL on every CUDA shard, a lone one
    too (world size 1: the same rendezvous, sharding and per-step decision broadcast as a
    tensor-parallel group, run on one GPU), gloo for CPU groups, none for a lone CPU shard."""
    if device.startswith("cuda"):
        return "nccl"
    return "gloo" if tp_size > 1 else None


def rank0_broadcast_verifier(rank: int, device: torch.device | None, inner: VerifyFn = verify) -> VerifyFn:
    """A verifier for tensor-parallel ranks: rank 0 runs ``inner`` and broadcasts its decision.

    The decision travels as int64 ``[num_accepted, bonus_token, accepted...]`` sized by the tree
    (known to every rank); ``num_accepted == 0`` (impossible for a real result: the root is
    always accepted) tells the other ranks that rank 0's verification raised, so they raise too,
    a :class:`RowVerificationFailed` when the bonus slot is 1 (rank 0's was one: a row-local
    numerical failure), else a ``VerificationError``.
    ``device`` is where the buffer lives (the CUDA device with NCCL; None for gloo on the CPU).
    """
    import torch.distributed as dist

    def verifier(tree: TokenTree, logits: Tensor, params: SamplingParams, randomness: Randomness) -> VerifyResult:
        decision = torch.zeros(tree.num_nodes + 2, dtype=torch.long)
        failure: Exception | None = None
        if rank == 0:
            try:
                result = inner(tree, logits, params, randomness)
                decision[0] = len(result.accepted)
                decision[1] = result.bonus_token
                decision[2 : 2 + len(result.accepted)] = torch.tensor(result.accepted, dtype=torch.long)
            except Exception as exc:  # broadcast the failure first, then raise it
                failure = exc
                decision[1] = int(isinstance(exc, RowVerificationFailed))
        buffer = decision if device is None else decision.to(device)
        dist.broadcast(buffer, src=0)
        values = buffer.cpu().tolist()
        if failure is not None:
            raise failure
        if values[0] == 0:
            if values[1] == 1:
                raise RowVerificationFailed("numerical failure on rank 0")
            raise VerificationError("verification failed on rank 0")
        return VerifyResult(values[2 : 2 + values[0]], values[1])

    return verifier


__all__ = [
    "RowVerificationFailed",
    "VerifierShard",
    "process_group_backend",
    "rank0_broadcast_verifier",
    "row_checked_verifier",
]

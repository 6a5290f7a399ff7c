"""How the scheduler splits one admission into prefill calls (``max_prefill_tokens``)."""

from __future__ import annotations

from treeserve.actors.scheduler.actor import _prefill_chunks, _Request
from treeserve.ops.sampling import SamplingParams


def _requests(*lengths: int) -> list[_Request]:
    return [_Request(f"r{i}", [1] * n, SamplingParams(), "tree", 0.0) for i, n in enumerate(lengths)]


def _lengths(chunks: list[list[_Request]]) -> list[list[int]]:
    return [[len(r.prompt_ids) for r in chunk] for chunk in chunks]


def test_chunks_keep_the_admission_order_and_stay_within_the_budget() -> None:
    assert _lengths(_prefill_chunks(_requests(5, 7, 1, 11), 12)) == [[5, 7], [1, 11]]
    assert _lengths(_prefill_chunks(_requests(5, 7, 1, 11), 8192)) == [[5, 7, 1, 11]]
    assert _lengths(_prefill_chunks(_requests(5, 7, 1, 11), 1)) == [[5], [7], [1], [11]]  # longer: alone
    assert _prefill_chunks([], 10) == []
    reqs = _requests(3, 3, 3)
    assert [r for chunk in _prefill_chunks(reqs, 6) for r in chunk] == reqs  # nobody lost or repeated

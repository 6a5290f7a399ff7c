"""The verifier's warm-up (``warm_up``, run before a shard reports ready): it runs the serving
path's prefill and decode steps on row 0 and leaves that row as if nothing had run there,
zeroed, even when the warm-up tokens' weights are not finite, so the first request's output is
unchanged. A warm-up that only resets the row's length (leaving its K/V) fails the first test."""

from __future__ import annotations

import math

import torch

from treeserve.actors import verifier_rows
from treeserve.actors.verifier_rows import WARM_UP_TOKENS, warm_up
from treeserve.ops.batch_step import RowStep, prefill_rows, verify_rows
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental
from treeserve.ops.token_tree import TokenTree

import tiny_model_files as tiny  # registered by conftest.py


def _decode(model: torch.nn.Module, cache: object, prompt: list[int], steps: int) -> list[int]:
    prefill_rows(model, cache, [(0, prompt[:-1])])  # type: ignore[arg-type]
    root, out = prompt[-1], []
    for _ in range(steps):
        (result,) = verify_rows(model, cache, [RowStep(0, TokenTree.from_parents([-1], [root]), SamplingParams())])  # type: ignore[arg-type]
        root = result.bonus_token
        out.append(root)
    return out


def test_a_poisoned_warm_up_leaves_row_zero_clean_for_the_first_request() -> None:
    model = tiny.make_tiny_model(seed=3)
    with torch.no_grad():
        model.embed_tokens.weight[WARM_UP_TOKENS // 2] = math.nan  # a warm-up token
    cache = model.new_cache(2, 64)
    warm_up(model, cache)
    assert int(cache.lengths[0]) == 0 and int(cache.num_pending[0]) == 0
    assert all(bool((t[0] == 0).all()) for t in (*cache.keys, *cache.values))
    prompt = [5, 17, 30, 41, 12]  # shorter than the warm-up: its masked slots are the warm-up's
    expected = generate_incremental(model, prompt, SamplingParams(max_new_tokens=6)).token_ids
    assert _decode(model, cache, prompt, len(expected)) == expected


def test_the_warm_up_runs_the_serving_forwards(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls: list[str] = []
    monkeypatch.setattr(verifier_rows, "prefill_rows", lambda *a, **k: calls.append("prefill") or prefill_rows(*a, **k))
    monkeypatch.setattr(verifier_rows, "verify_rows", lambda *a, **k: calls.append("step") or verify_rows(*a, **k))
    model = tiny.make_tiny_model(seed=4)
    warm_up(model, model.new_cache(1, 32))
    assert calls == ["prefill", "step", "step"]
    calls.clear()
    warm_up(model, model.new_cache(1, WARM_UP_TOKENS + 1))  # too short a row: skipped
    assert calls == []

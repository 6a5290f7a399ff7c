"""SamplingParams validation and logits_to_probs against a slow reference."""

from __future__ import annotations

import math

import pytest
import torch

from treeserve.ops.sampling import SamplingParams, logits_to_probs, make_generator, sample_token


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -3}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": (3, -1)}, "stop_token_ids"),
    ],
)
def test_invalid_params_raise_clear_value_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_params_defaults_and_stop_tokens() -> None:
    params = SamplingParams(stop_token_ids=[2, 5])  # type: ignore[arg-type]
    assert params.is_greedy and params.stop_token_ids == (2, 5)
    assert params.is_stop(5) and not params.is_stop(4)
    assert not SamplingParams(temperature=0.7).is_greedy


def reference_probs(logits: list[float], params: SamplingParams) -> list[float]:
    """Slow reference: temperature, top-k (ties kept), softmax, nucleus, renormalize."""
    if params.is_greedy:
        best = max(range(len(logits)), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(len(logits))]
    scaled = [x / params.temperature for x in logits]
    if params.top_k is not None and params.top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[params.top_k - 1]
        scaled = [x if x >= kth else -math.inf for x in scaled]
    top = max(scaled)
    exps = [math.exp(x - top) for x in scaled]
    probs = [e / sum(exps) for e in exps]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        if mass >= params.top_p:
            break
        kept.add(i)
        mass += probs[i]
    probs = [p if i in kept else 0.0 for i, p in enumerate(probs)]
    return [p / sum(probs) for p in probs]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=3),
        SamplingParams(temperature=1.7, top_p=0.6),
        SamplingParams(temperature=0.9, top_k=5, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=1),
    ],
)
def test_logits_to_probs_matches_reference(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=gen) * 2
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1  # a tie at the top
    probs = logits_to_probs(logits, params)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    for row in range(logits.shape[0]):
        expected = torch.tensor(reference_probs(logits[row].tolist(), params))
        torch.testing.assert_close(probs[row], expected, atol=1e-6, rtol=1e-5)


def test_sample_token_is_seeded_and_greedy_is_argmax() -> None:
    logits = torch.randn(20, generator=torch.Generator().manual_seed(1))
    assert sample_token(logits, SamplingParams(), None) == int(logits.argmax())
    params = SamplingParams(temperature=1.0, seed=42)
    draws_a = [sample_token(logits, params, g) for g in [make_generator(params)] for _ in range(10)]
    draws_b = [sample_token(logits, params, g) for g in [make_generator(params)] for _ in range(10)]
    assert draws_a == draws_b and len(set(draws_a)) > 1

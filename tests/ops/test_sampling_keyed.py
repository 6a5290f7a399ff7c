"""Keyed sampling (seeded requests): the counter-based uniforms against integer references, and
``sample_keyed`` drawing from ``logits_to_probs`` over many seeds, where samplers that ignore
temperature, top-k or the Gumbel transform fail the same chi-square test."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from treeserve.ops.sampling import (
    SampleKey,
    SamplingParams,
    _mix32,
    keyed_uniforms,
    logits_to_probs,
    randomness_for,
    sample_keyed,
    sample_token,
)

PASS_P_VALUE = 1e-3  # seeded draws: deterministic, so a correct sampler passes every run
FAIL_P_VALUE = 1e-6
NUM_SEEDS = 6000


def lowbias32_reference(x: int) -> int:
    """Wellons' lowbias32 on Python integers (no overflow to worry about)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def chi_square_p_value(counts: Tensor, probs: Tensor) -> float:
    """Pearson goodness of fit; a draw of a zero-probability outcome gives 0."""
    counts, probs = counts.double(), probs.double()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), stat / 2)) if dof > 0 else 1.0


def test_mix32_matches_the_integer_reference_at_the_edges() -> None:
    values = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]
    values += torch.randint(0, 2**32, (2000,), generator=torch.Generator().manual_seed(0), dtype=torch.long).tolist()
    got = _mix32(torch.tensor(values, dtype=torch.long)).tolist()
    assert got == [lowbias32_reference(v) for v in values]


def test_keyed_uniforms_depend_on_the_key_only() -> None:
    u = keyed_uniforms(42, [7], 1000)
    assert u.shape == (1, 1000) and u.dtype == torch.float64
    assert bool(((u > 0) & (u < 1)).all()) and u.unique().numel() == 1000  # distinct within a key
    # The same key gives the same uniforms whatever other keys share the call (no stream).
    together = keyed_uniforms(42, [3, 7, 7, 1000], 1000)
    assert torch.equal(together[1], u[0]) and torch.equal(together[2], u[0])
    assert torch.equal(keyed_uniforms(42, [7], 1000), u)
    for other in (keyed_uniforms(43, [7], 1000), keyed_uniforms(42, [8], 1000), keyed_uniforms(42, [7], 1000, draw=1)):
        assert not torch.equal(other, u)
    assert torch.equal(keyed_uniforms(2**63 - 1, [2**40], 5), keyed_uniforms(2**63 - 1, [2**40], 5))
    with pytest.raises(ValueError, match=">= 0"):
        keyed_uniforms(-1, [0], 5)


def test_keyed_uniforms_are_uniform_and_independent_across_keys() -> None:
    # 200 keys (consecutive positions and seeds) x 500 tokens: one token's uniform over keys, and
    # pairs of neighbouring tokens, must look uniform.
    u = torch.cat([keyed_uniforms(s, list(range(100)), 500) for s in (0, 1)])  # (200, 500)
    bins = (u * 20).long().flatten()
    assert chi_square_p_value(torch.bincount(bins, minlength=20), torch.full((20,), 1 / 20)) > PASS_P_VALUE
    pairs = ((u[:, :-1] * 5).long() * 5 + (u[:, 1:] * 5).long()).flatten()  # (token t, token t+1) in a 5x5 grid
    assert chi_square_p_value(torch.bincount(pairs, minlength=25), torch.full((25,), 1 / 25)) > PASS_P_VALUE
    same_token = ((u[:-1, 3] * 5).long() * 5 + (u[1:, 3] * 5).long())  # one token, neighbouring keys
    assert chi_square_p_value(torch.bincount(same_token, minlength=25), torch.full((25,), 1 / 25)) > PASS_P_VALUE


LOGITS = torch.tensor([2.0, 1.5, 0.2, 0.0, -0.5, -1.0, -3.0, 1.9])
CASES = {
    "t0.7": SamplingParams(temperature=0.7),
    "t1.4_topk5": SamplingParams(temperature=1.4, top_k=5),
    "t0.6_topp0.8": SamplingParams(temperature=0.6, top_p=0.8),
}

Sampler = Callable[[Tensor, SamplingParams, int, int], int]


def keyed(logits: Tensor, params: SamplingParams, seed: int, position: int) -> int:
    return sample_token(logits, params, SampleKey(seed, position))


def ignores_temperature(logits: Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """WRONG: the keyed draw from the temperature-1 distribution."""
    unscaled = SamplingParams(temperature=1.0, top_k=params.top_k, top_p=params.top_p)
    return sample_keyed(logits_to_probs(logits[None], unscaled), seed, [position])[0]


def ignores_truncation(logits: Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """WRONG: temperature applied, top-k / top-p not."""
    return sample_keyed(logits_to_probs(logits[None], SamplingParams(temperature=params.temperature)), seed, [position])[0]


def no_gumbel(logits: Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """WRONG: argmax of p * U (the uniforms without the Gumbel transform)."""
    u = keyed_uniforms(seed, [position], logits.shape[-1])[0]
    return int((logits_to_probs(logits, params).double() * u).argmax())


def counts_over_seeds(sampler: Sampler, params: SamplingParams) -> Tensor:
    # Seeds and positions both vary: each (seed, position) key is one independent draw.
    draws = [sampler(LOGITS, params, seed, 10 + seed % 7) for seed in range(NUM_SEEDS)]
    return torch.bincount(torch.tensor(draws), minlength=LOGITS.numel())


@pytest.mark.parametrize("case", list(CASES))
def test_keyed_sampling_matches_the_distribution_and_wrong_samplers_fail(case: str) -> None:
    params = CASES[case]
    exact = logits_to_probs(LOGITS, params)
    counts = counts_over_seeds(keyed, params)
    assert chi_square_p_value(counts, exact) > PASS_P_VALUE, (counts, exact * NUM_SEEDS)
    wrong: list[Sampler] = [ignores_temperature, no_gumbel] + ([ignores_truncation] if case != "t0.7" else [])
    for sampler in wrong:
        assert chi_square_p_value(counts_over_seeds(sampler, params), exact) < FAIL_P_VALUE, sampler.__name__


def test_sample_keyed_is_the_gumbel_argmax_and_never_draws_zero_mass() -> None:
    params = SamplingParams(temperature=0.8, top_k=3)
    probs = logits_to_probs(LOGITS[None].expand(50, -1), params)  # (50, V)
    positions = list(range(50))
    got = sample_keyed(probs, 9, positions)
    u = keyed_uniforms(9, positions, LOGITS.numel())
    expected = [max(range(LOGITS.numel()), key=lambda t: -math.inf if probs[i, t] == 0 else
                    math.log(float(probs[i, t])) - math.log(-math.log(float(u[i, t])))) for i in range(50)]
    assert got == expected
    assert set(got) <= {0, 1, 7} and len(set(got)) == 3
    assert got == [sample_keyed(probs[i:i + 1], 9, [i])[0] for i in range(50)]  # rows are independent


def test_randomness_for_keys_only_seeded_sampled_requests() -> None:
    generator = torch.Generator()
    assert randomness_for(SamplingParams(seed=3), 5, generator) is None  # greedy
    assert randomness_for(SamplingParams(temperature=1.0), 5, generator) is generator
    assert randomness_for(SamplingParams(temperature=1.0, seed=3), 5, generator) == SampleKey(3, 5)


def test_sample_keyed_refuses_what_is_not_a_distribution() -> None:
    # The verifier turns this RuntimeError into one row's numerical failure, as multinomial's.
    for bad in (torch.tensor([[0.5, float("nan")]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[1.5, -0.5]])):
        with pytest.raises(RuntimeError, match="probability tensor"):
            sample_keyed(bad, 1, [0])
    with pytest.raises(RuntimeError, match="probability tensor"):
        sample_token(torch.tensor([1.0, 2.0]), SamplingParams(temperature=1e-300, seed=1), SampleKey(1, 0))

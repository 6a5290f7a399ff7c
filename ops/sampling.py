"""Sampling parameters and the logits -> probabilities transform shared by LLM and drafters.

The same :func:`logits_to_probs` defines the LLM's target distribution ``p`` (what plain
incremental sampling draws from, and what the verifier must reproduce) and, applied to a
speculator's logits, the drafting distribution ``q``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` means greedy (argmax).

    ``top_k``: keep only the ``top_k`` most likely tokens (None = no limit). ``top_p``: keep the
    smallest set of most likely tokens whose mass reaches ``top_p`` (1.0 = no limit).
    ``seed``: seeds the request's ``torch.Generator`` (None = nondeterministic).
    ``stop_token_ids``: generation ends after emitting one of these (it is kept in the output).
    ``max_new_tokens``: at most this many generated tokens, stop token included.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be None (no limit) or an integer >= 1, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer > 0, got {self.max_new_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be None or a non-negative integer, got {self.seed!r}")
        stops = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def is_greedy(self) -> bool:
        """True when decoding is greedy (temperature 0)."""
        return self.temperature == 0.0

    def is_stop(self, token: int) -> bool:
        """True when ``token`` ends generation."""
        return token in self.stop_token_ids


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` seeded from ``params.seed`` (fresh random seed when None)."""
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Probabilities ``(..., V)`` float32 from logits ``(..., V)`` under ``params``.

    Greedy params give the one-hot of the argmax (the temperature -> 0 limit). Otherwise the
    order is: divide by temperature, keep the top-k logits (ties at the k-th value are kept),
    softmax, keep the top-p nucleus (the most likely tokens up to and including the first one
    whose cumulative mass reaches ``top_p``), renormalize.
    """
    logits = logits.float()
    if params.is_greedy:
        index = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(logits).scatter_(-1, index, 1.0)
    scaled = logits / params.temperature
    if params.top_k is not None and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # (..., V)
        drop_sorted = mass_before >= params.top_p  # the first token always survives
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from_probs(probs: Tensor, generator: torch.Generator | None, num_samples: int = 1) -> Tensor:
    """Draw ``num_samples`` i.i.d. token ids per row of ``probs`` ``(..., V)`` -> ``(..., num_samples)``."""
    flat = probs.reshape(-1, probs.shape[-1])  # (N, V)
    draws = torch.multinomial(flat, num_samples, replacement=True, generator=generator)  # (N, S)
    return draws.reshape(*probs.shape[:-1], num_samples)


def sample_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Next token id from a single logits row ``(V,)``: argmax when greedy, else one draw."""
    if params.is_greedy:
        return int(logits.argmax())
    return int(sample_from_probs(logits_to_probs(logits, params), generator)[0])

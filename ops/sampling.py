"""Sampling parameters, the logits -> probabilities transform, and keyed sampling.

The same :func:`logits_to_probs` defines the LLM's target distribution ``p`` (what plain
incremental sampling draws from, and what the verifier must reproduce) and, applied to a
speculator's logits, the drafting distribution ``q``.

Two sources of randomness:

* a ``torch.Generator`` stream (:func:`make_generator`), for unseeded requests: what a draw
  returns depends on how many draws came before it, so it is not reproducible under
  speculation (the number of draws a verify step takes depends on the drafted tree);
* a :class:`SampleKey`, for seeded requests: the token sampled for sequence position ``n`` is
  :func:`sample_keyed`, the Gumbel-max of ``p`` under noise that is a fixed function of
  ``(seed, n, draw, token id)`` (:func:`keyed_uniforms`, a counter-based hash). So the token
  at ``n`` depends on the seed, ``n`` and ``p`` there, and on nothing else: not on the batch,
  the speculators, the trees or earlier draws. :func:`randomness_for` picks between the two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` means greedy (argmax).

    ``top_k``: keep only the ``top_k`` most likely tokens (None = no limit). ``top_p``: keep the
    smallest set of most likely tokens whose mass reaches ``top_p`` (1.0 = no limit).
    ``seed``: keys the request's randomness by position (:class:`SampleKey`), so the same seed
    and the same LLM distributions give the same tokens (None = a fresh random stream).
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


@dataclass(frozen=True)
class SampleKey:
    """The keyed randomness of a seeded request, placed at a sequence position.

    ``position``: the absolute sequence position (prompt included, 0-based) of the token that
    the first of the logits rows it comes with predicts; a row ``d`` steps further along a path
    predicts position ``position + d``. The token sampled for position ``n`` is
    ``sample_keyed(p, seed, [n])``: reproducible from ``(seed, n, p)`` alone.
    """

    seed: int
    position: int

    def __post_init__(self) -> None:
        if self.seed < 0 or self.position < 0:
            raise ValueError(f"a SampleKey needs seed >= 0 and position >= 0, got {self.seed}, {self.position}")


Randomness = torch.Generator | SampleKey | None
"""What a sampler or verifier draws from: a stream, a key, or nothing (greedy)."""


def randomness_for(params: SamplingParams, position: int, generator: torch.Generator | None) -> Randomness:
    """The randomness of a request at sequence ``position`` (see :class:`SampleKey`): None when
    greedy, the key of ``params.seed`` when seeded, else the request's ``generator`` stream."""
    if params.is_greedy:
        return None
    if params.seed is not None:
        return SampleKey(params.seed, position)
    return generator


_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _splitmix64(x: int) -> int:
    """SplitMix64's output function (a bijection of 64-bit words), on Python ints."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mul32(x: Tensor, m: int) -> Tensor:
    """``(x * m) mod 2**32`` for int64 ``x`` in ``[0, 2**32)``, exact: the product is split in
    16-bit halves of ``m`` so no intermediate leaves int64 (signed overflow is not defined)."""
    lo, hi = m & 0xFFFF, m >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    """``lowbias32`` (Wellons' 32-bit integer hash, a bijection) on int64 ``x`` in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keyed_uniforms(seed: int, positions: Sequence[int], num_tokens: int, draw: int = 0,
                   device: torch.device | str = "cpu") -> Tensor:
    """Uniforms ``(N, num_tokens)`` float64 in ``(0, 1)``: entry ``[i, t]`` is a fixed function of
    ``(seed, positions[i], draw, t)``, the same on every device and run.

    A counter-based generator: ``(seed, position, draw)`` is hashed (SplitMix64) into three
    32-bit words that key three rounds of a 32-bit hash of the token id. Each round is a
    bijection, so the ``num_tokens`` uniforms of one key are distinct. ``draw`` separates
    independent uses of randomness at one position (draw 0 is the emitted token's).
    """
    if seed < 0 or draw < 0 or any(p < 0 for p in positions):
        raise ValueError(f"seed, positions and draw must be >= 0, got {seed}, {list(positions)}, {draw}")
    if not 0 < num_tokens <= 1 << 32:
        raise ValueError(f"num_tokens must be in [1, 2**32], got {num_tokens}")
    words = []
    for position in positions:
        h = _splitmix64((_splitmix64((_splitmix64(seed) + position) & _MASK64) + draw) & _MASK64)
        words.append((h & _MASK32, h >> 32, _splitmix64(h) & _MASK32))
    keys = host_to_device(torch.tensor(words, dtype=torch.long).reshape(len(words), 3), device)  # (N, 3)
    x = torch.arange(num_tokens, dtype=torch.long, device=device).expand(len(words), -1)  # (N, V)
    for k in range(3):
        x = _mix32(x ^ keys[:, k:k + 1])
    return (x.double() + 0.5) * (1.0 / 2**32)


def sample_keyed(probs: Tensor, seed: int, positions: Sequence[int], draw: int = 0) -> list[int]:
    """One token per row of ``probs`` ``(N, V)``, row ``i`` keyed by ``(seed, positions[i], draw)``.

    Gumbel-max: ``argmax_t log p[i, t] + G[i, t]`` with ``G = -log(-log U)``, ``U`` the
    :func:`keyed_uniforms`. For each fixed key this is a deterministic function of ``p``; over
    uniform ``U`` it is an exact draw from ``p`` (tokens with ``p = 0`` are never chosen). Of
    the ways to turn one key into a draw it is the least sensitive to rounding in ``p``: the
    result changes only when the two best perturbed scores are within the rounding, whatever
    the vocabulary size (an inverse-CDF draw changes when ``U`` is near any of the ``V`` CDF
    steps). Ties go to the lowest token id. Like ``torch.multinomial``, raises ``RuntimeError``
    for a row that is not a distribution (non-finite, negative, or no mass), where an argmax
    would quietly pick a token.
    """
    if probs.dim() != 2 or probs.shape[0] != len(positions):
        raise ValueError(f"probs must be (N, V) with N = {len(positions)} positions, got {tuple(probs.shape)}")
    if not bool(is_distribution(probs)):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0, or a row without mass")
    return [int(t) for t in keyed_argmax(probs, seed, positions, draw).tolist()]


def keyed_argmax(probs: Tensor, seed: int, positions: Sequence[int], draw: int = 0) -> Tensor:
    """:func:`sample_keyed`'s draws ``(N,)`` where ``probs`` are, unchecked and with no host read
    (a GPU's verifier checks :func:`is_distribution` beside it and reads both at once)."""
    u = keyed_uniforms(seed, positions, probs.shape[-1], draw, device=probs.device)  # (N, V)
    gumbel = -torch.log(-torch.log(u))
    scores = torch.log(probs.double()) + gumbel  # log 0 = -inf: never chosen
    return scores.argmax(dim=-1)


def is_distribution(probs: Tensor) -> Tensor:
    """A bool scalar where ``probs`` ``(N, V)`` are: every row finite, non-negative, with mass."""
    return (torch.isfinite(probs) & (probs >= 0)).all() & (probs.sum(dim=-1) > 0).all()


def host_to_device(tensor: Tensor, device: torch.device | str) -> Tensor:
    """A host ``tensor`` on ``device``; onto a GPU through pinned memory without waiting (a
    plain copy from the host would wait for everything queued before it, a verify step's
    forward included)."""
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` seeded from ``params.seed`` (fresh random seed when None).

    Streams serve unseeded requests (and drafting); a seeded request's emitted tokens come
    from its :class:`SampleKey` instead (:func:`randomness_for`)."""
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


def sample_token(logits: Tensor, params: SamplingParams, randomness: Randomness) -> int:
    """Next token id from a single logits row ``(V,)``: argmax when greedy, else one draw, keyed
    (``randomness`` a :class:`SampleKey`: the token for position ``randomness.position``) or
    from a stream (a ``torch.Generator``, or None for torch's global one)."""
    if params.is_greedy:
        return int(logits.argmax())
    probs = logits_to_probs(logits, params)
    if isinstance(randomness, SampleKey):
        return sample_keyed(probs[None], randomness.seed, [randomness.position])[0]
    return int(sample_from_probs(probs, randomness)[0])

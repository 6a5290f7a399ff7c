"""``SpeculatorActor``: drafts one merged token tree per request with every configured speculator.

Config dict::

    {"model": str, "cache_dir": str|None, "dtype": "float32"|..., "device": "cpu"|"cuda:N",
     "speculators": [{"kind": "ngram", "max_ngram": 3, "min_ngram": 1, "num_draft_tokens": 4, "num_branches": 1},
                     {"kind": "suffix", "capacity": 65536, "num_draft_tokens": 16},
                     {"kind": "self", "layers": 4, "expansion": [1, 1, 3, 1]},
                     {"kind": "model", "model": "<path>", "expansion": [...]}],
     "capacity": int|None, "num_threads": int|None}

``model`` is the verifier's LM (its vocabulary sizes the n-gram and suffix drafts; a ``suffix``
speculator's index is one per actor, fed by every request it drafts for; ``self`` drafts with its
first ``layers`` blocks, sharing the weights); ``model`` kinds load another LM that shares the
tokenizer. Every kind and its options are
:class:`~treeserve.actors.speculator_factory.SpeculatorSpec`'s, and that module builds them, in
config order. ``capacity`` bounds each request's drafter KV cache (default: the model's
``max_seq_len``). ``num_threads`` sets torch's intra-op threads of the (child) process. Handlers:

* ``start {"request_id", "prompt_ids"}`` -> None: fresh per-request state (one instance per kind).
* ``propose {"requests": [{"request_id", "new_tokens", "max_depth", "params", "max_nodes"?,
  "history"?, "num_states"?}], "states"?}`` -> ``{"trees": [tree wire | None ...], "missing": [request_id ...],
  "draft_probs"?}``, trees in request order (their dense draft probabilities stacked in one
  ``draft_probs`` array; the bodies are :mod:`treeserve.actors.messages.checks`'). Each request first
  advances by ``new_tokens`` (emitted since its last propose: accepted drafts then the bonus
  token; empty on the first call), then every
  speculator proposes a tree rooted at the request's last token with nodes at most
  ``max_depth`` deep; the trees are trie-merged in config order. With ``max_nodes`` (>= 1) the
  merged tree has at most ``max_nodes`` nodes: each speculator gets an equal share of the budget
  and sizes its expansion from worst-case counts before drawing (never a cut after drawing,
  which would bias multi-step speculative sampling).
  Recovery: a request without state (the actor restarted, or ``start`` was lost) never fails
  the batch. If the entry carries ``"history"`` (prompt + every emitted token: the full
  sequence ending with the current root, i.e. already including ``new_tokens``) the state is
  rebuilt from it and drafting proceeds normally; the same happens when a state exists but its
  length plus ``new_tokens`` does not match the history (an earlier propose was lost).
  Otherwise the entry's tree is root-only (rooted at ``new_tokens[-1]``; None when
  ``new_tokens`` is empty, the root being unknown) and its id is listed in ``missing``, so the
  caller sends ``history`` next time. A request's ``num_states`` states (float ``(n, D)``, its
  slice of the body's stacked ``states``, in request order: one frame for any number of
  requests) are the LLM's final hidden states of its tokens since the last ones sent, in order
  (with ``history``: of all of it but the root); ``feature`` speculators (``{"kind": "feature", "path": null,
  "expansion": [4, 2, 1]}``: the greedy spine's widths; optional ``"dynamic": [depth, top_k,
  num_nodes]``: confidence-shaped trees for greedy requests) draft from them.
* ``release {"request_id", "new_tokens"?}`` -> None (idempotent): the request's speculators
  whose index outlives it (``suffix``) first take ``new_tokens``, its tokens since its last
  propose, so the process-wide index holds every answer, including those decoded without
  drafting (an adaptive server at plain decoding), and the next requests can draft from them.
* ``forget_traffic`` -> None: the process-wide suffix indexes start empty again, so later
  requests draft only from what follows (a benchmark of fresh traffic calls it between passes
  over the same prompts); requests in flight keep the index they started with.

Stochastic drafting uses a per-request generator seeded from ``params.seed`` mixed with a
constant. An unseeded request's verifier draws from a stream of its own (drafts that reused it
would correlate proposals with acceptance tests and break losslessness); a seeded request's
verifier uses keyed randomness (:class:`~treeserve.ops.sampling.SampleKey`), on which the
drafts have no influence at all: they change how many tokens a step accepts, never which.
Drafting runs request by request (each :class:`~treeserve.ops.drafting.ModelSpeculator` has
its own batch-1 cache), in a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from treeserve.actors.messages.speculator import ProposalRequest, ProposeBody, ProposeReply, RequestRelease, StartBody
from treeserve.actors.model_host import (
    DTYPES,
    SerialOffload,
    check_device,
    check_int,
    check_model_name,
    check_str_or_none,
    load_on_device,
)
from treeserve.actors.speculator_factory import (
    Drafter,
    SpeculatorKind,
    SpeculatorSpec,
    capture_drafters,
    load_drafter,
    make_speculators,
)
from treeserve.actors.messages.tree_wire import ParamsCache
from treeserve.ops.drafting import Speculator, split_node_budget
from treeserve.ops.model import Transformer
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree, merge_trees
from treeserve.runtime import Actor, handler

_DRAFT_SEED_MIX = 0x5DEECE66D


@dataclass(frozen=True)
class SpeculatorConfig:
    """Validated config of a :class:`SpeculatorActor` (see the module docstring)."""

    model: str
    speculators: tuple[SpeculatorSpec, ...]
    cache_dir: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    capacity: int | None = None
    num_threads: int | None = None

    @classmethod
    def from_wire(cls, config: Any) -> SpeculatorConfig:
        """Build from the constructor dict; ``ValueError`` names the bad key."""
        if not isinstance(config, Mapping):
            raise ValueError(f"SpeculatorActor config must be a dict, got {type(config).__name__}")
        known = {"model", "speculators", "cache_dir", "dtype", "device", "capacity", "num_threads"}
        unknown = sorted(str(k) for k in config if k not in known)
        if unknown:
            raise ValueError(f"unknown SpeculatorActor config keys {unknown}; known keys: {sorted(known)}")
        model = check_model_name(config.get("model"))
        specs = config.get("speculators", [])
        if not isinstance(specs, (list, tuple)):
            raise ValueError("speculators must be a list of {'kind': ...} maps")
        dtype = config.get("dtype", "float32")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        device = check_device(config.get("device", "cpu"))
        cache_dir = check_str_or_none(config.get("cache_dir"), "cache_dir")
        capacity = config.get("capacity")
        if capacity is not None:
            check_int(capacity, "capacity", minimum=2)
        num_threads = config.get("num_threads")
        if num_threads is not None:
            check_int(num_threads, "num_threads", minimum=1)
        specs_tuple = tuple(SpeculatorSpec.from_wire(s) for s in specs)
        return cls(model, specs_tuple, cache_dir, dtype, device, capacity, num_threads)


@runtime_checkable
class _FeatureUser(Protocol):
    """A speculator that drafts from the LLM's hidden states (``uses_features = True``, as
    :class:`~treeserve.ops.feature_speculator.FeatureSpeculator`), which receives them by ``add_features``."""

    uses_features: bool

    def add_features(self, states: Tensor) -> None: ...


@runtime_checkable
class _TrafficIndexer(Protocol):
    """A speculator whose index outlives its request (``indexes_traffic = True``, as
    :class:`~treeserve.ops.suffix.SuffixSpeculator`): a released request's last tokens go in."""

    indexes_traffic: bool

    def accept(self, new_tokens: Sequence[int]) -> None: ...


@dataclass
class _RequestState:
    speculators: list[Speculator]
    last_token: int
    generator: torch.Generator | None = None
    history_len: int = 0


def draft_seed(seed: int) -> int:
    """The drafting generator's seed for a request seeded ``seed`` (distinct from the verifier's)."""
    return (seed ^ _DRAFT_SEED_MIX) % (1 << 63)


class SpeculatorActor(Actor):
    """Per-request speculators behind ``start`` / ``propose`` / ``release`` (see the module docstring)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = SpeculatorConfig.from_wire(config)
        self._offload = SerialOffload()
        self._states: dict[str, _RequestState] = {}
        self._model: Transformer | None = None
        self._drafters: list[Drafter] = []  # per spec: what it drafts with (None for ngram; suffix: its index)
        self._params = ParamsCache()  # each request's params, parsed at its first propose

    async def on_start(self) -> None:
        """Load the LM (and any separate drafter LMs); fails the spawn on a bad path."""
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        await self._offload.run(self._load)

    def _load(self) -> None:
        cfg = self.config
        # The drafters read the LM's embedding and head (feature, distilled) or run its first
        # blocks (self:K): in the served format, on the format's kernels. The full model's
        # decode step is never compiled here (a speculator never runs it); a feature drafter's
        # own step is, on a thread, while it drafts eagerly.
        model = load_on_device(cfg.model, weight_format=cfg.dtype, device=cfg.device, cache_dir=cfg.cache_dir)
        self._model = model
        self._drafters = [load_drafter(spec, model, weight_format=cfg.dtype, cache_dir=cfg.cache_dir, device=cfg.device,
                                       background=True)
                          for spec in cfg.speculators]  # FileNotFoundError / ValueError fail the spawn
        capture_drafters(self._drafters, cfg.capacity)  # a GPU's feature drafter: its steps from CUDA graphs

    # ------------------------------------------------------------------ handlers
    @handler
    async def start(self, body: Any) -> None:
        """Create (or reset) ``request_id``'s speculators over ``prompt_ids``."""
        call = StartBody.from_wire(body, self._vocab_size())
        await self._offload.run(self._start, call.request_id, list(call.prompt_ids))

    @handler
    async def propose(self, body: Any) -> dict[str, Any]:
        """Advance each request by its ``new_tokens`` and draft its merged token tree."""
        call = ProposeBody.from_wire(body, vocab_size=self._vocab_size(), dim=self._model_dim(), params=self._params)
        trees, missing = await self._offload.run(self._propose_all, call.requests)
        return ProposeReply(tuple(trees), tuple(missing)).to_wire()

    @handler
    async def release(self, body: Any) -> None:
        """Forget ``request_id`` (idempotent)."""
        call = RequestRelease.from_wire(body, self._vocab_size())
        self._params.forget(call.request_id)
        await self._offload.run(self._release, call.request_id, call.new_tokens)

    @handler
    async def forget_traffic(self, body: Any) -> None:
        """Start every suffix index afresh (see the module docstring)."""
        del body
        await self._offload.run(self._forget_traffic)

    # ------------------------------------------------------------------ compute (worker thread)
    def _forget_traffic(self) -> None:
        # A new index object: in-flight requests' speculators hold the old one until released.
        assert self._model is not None
        self._drafters = [load_drafter(spec, self._model) if spec.kind is SpeculatorKind.SUFFIX else drafter
                          for spec, drafter in zip(self.config.speculators, self._drafters)]

    def _model_dim(self) -> int:
        assert self._model is not None
        return self._model.config.dim

    def _vocab_size(self) -> int:
        assert self._model is not None
        return self._model.config.vocab_size

    def _start(self, request_id: str, tokens: list[int]) -> None:
        speculators = make_speculators(self.config.speculators, self._drafters, self._vocab_size(), self.config.capacity)
        for speculator in speculators:
            speculator.prefill(tokens)
        self._states[request_id] = _RequestState(speculators, tokens[-1], history_len=len(tokens))

    def _release(self, request_id: str, new_tokens: Sequence[int]) -> None:
        state = self._states.pop(request_id, None)
        if state is not None and new_tokens:
            for speculator in state.speculators:
                if isinstance(speculator, _TrafficIndexer) and speculator.indexes_traffic:
                    speculator.accept(new_tokens)

    def _propose_all(self, requests: Sequence[ProposalRequest]) -> tuple[list[TokenTree | None], list[str]]:
        trees: list[TokenTree | None] = []
        missing: list[str] = []
        for request in requests:
            request_id, new_tokens, history = request.request_id, list(request.new_tokens), request.history
            state = self._states.get(request_id)
            is_in_step = state is not None and state.history_len + len(new_tokens) == len(history or ())
            if history and not is_in_step:
                # Lost, or out of step (e.g. an earlier propose never arrived): rebuild. The
                # history already ends with the current root, so new_tokens are not applied.
                self._start(request_id, list(history))
                state = self._states[request_id]
            elif state is None:
                missing.append(request_id)
                trees.append(TokenTree.from_parents([-1], [new_tokens[-1]]) if new_tokens else None)
                continue
            elif new_tokens:
                for speculator in state.speculators:
                    speculator.accept(new_tokens)
                state.last_token = new_tokens[-1]
                state.history_len += len(new_tokens)
            if request.states is not None and request.states.shape[0]:
                # The LLM's states of the tokens before the root (all of them with a history);
                # a copy: the array is a read-only view of the received frame.
                states = torch.from_numpy(request.states.copy())
                for speculator in state.speculators:
                    if isinstance(speculator, _FeatureUser) and speculator.uses_features:
                        speculator.add_features(states)
            trees.append(self._draft(state, request.params, request.max_depth, request.max_nodes))
        return trees, missing

    def _draft(self, state: _RequestState, params: SamplingParams, max_depth: int, max_nodes: int | None) -> TokenTree:
        if state.generator is None and not params.is_greedy:
            state.generator = torch.Generator()
            if params.seed is None:
                state.generator.seed()
            else:
                state.generator.manual_seed(draft_seed(params.seed))
        if max_depth < 1 or not state.speculators:
            # ModelSpeculators stay in step anyway: their next propose feeds the uncached tokens.
            return TokenTree.from_parents([-1], [state.last_token])
        # The node budget is split between the speculators BEFORE drafting: each limits its tree
        # from worst-case sizes, never by cutting a drawn tree (a cut that depends on the draws
        # biases multi-step speculative sampling). The merged trie has at most 1 + sum(share - 1).
        count = len(state.speculators)
        shares: Sequence[int | None] = [None] * count if max_nodes is None else split_node_budget(max_nodes, count)
        trees = [s.propose(params, state.generator, max_depth=max_depth, max_nodes=share)
                 for s, share in zip(state.speculators, shares)]
        tree = merge_trees(trees)
        if tree.root_token != state.last_token:
            raise RuntimeError(f"a speculator drafted from token {tree.root_token}, expected {state.last_token}")
        return tree


__all__ = ["SpeculatorActor", "SpeculatorConfig", "SpeculatorSpec", "draft_seed"]

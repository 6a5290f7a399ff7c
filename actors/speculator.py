"""``SpeculatorActor``: drafts one merged token tree per request with every configured speculator.

Config dict::

    {"model": str, "cache_dir": str|None, "dtype": "float32"|..., "device": "cpu"|"cuda:N",
     "speculators": [{"kind": "ngram", "max_ngram": 3, "min_ngram": 1, "num_draft_tokens": 4, "num_branches": 1},
                     {"kind": "self", "layers": 4, "expansion": [1, 1, 3, 1]},
                     {"kind": "model", "model": "<path>", "expansion": [...]}],
     "capacity": int|None, "num_threads": int|None}

``model`` is the verifier's LM (its vocabulary sizes the n-gram drafts; ``self`` drafts with its
first ``layers`` blocks, sharing the weights); ``model`` kinds load another LM that shares the
tokenizer. ``capacity`` bounds each request's drafter KV cache (default: the model's
``max_seq_len``). ``num_threads`` sets torch's intra-op threads of the (child) process. Handlers:

* ``start {"request_id", "prompt_ids"}`` -> None: fresh per-request state (one instance per kind).
* ``propose {"requests": [{"request_id", "new_tokens", "max_depth", "params", "max_nodes"?,
  "history"?, "num_states"?}], "states"?}`` -> ``{"trees": [tree wire | None ...], "missing": [request_id ...]}``, trees
  in request order. Each request first advances by ``new_tokens`` (emitted since its last
  propose: accepted drafts then the bonus token; empty on the first call), then every
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
* ``release {"request_id"}`` -> None (idempotent).

Stochastic drafting uses a per-request generator seeded from ``params.seed`` mixed with a
constant, so drafts never reuse the verifier's random stream (which would correlate proposals
with acceptance tests and break losslessness). Drafting runs request by request (each
:class:`~treeserve.ops.drafting.ModelSpeculator` has its own batch-1 cache), in a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from treeserve.actors.tree_wire import params_from_wire, split_states, tree_to_wire
from treeserve.actors.model_host import (
    DTYPES,
    SerialOffload,
    check_body,
    check_device,
    check_int,
    check_model_name,
    check_str_or_none,
)
from treeserve.ops.drafting import ModelSpeculator, Speculator, split_node_budget, validate_expansion
from treeserve.ops.loaders.load import load_model
from treeserve.ops.model import Transformer
from treeserve.ops.ngram import NGramSpeculator
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree, merge_trees
from treeserve.runtime import Actor, handler

_DRAFT_SEED_MIX = 0x5DEECE66D
_KIND_KEYS: Mapping[str, frozenset[str]] = {
    "ngram": frozenset({"kind", "max_ngram", "min_ngram", "num_draft_tokens", "num_branches"}),
    "self": frozenset({"kind", "layers", "expansion"}),
    "model": frozenset({"kind", "model", "expansion"}),
    "distilled": frozenset({"kind", "path", "index", "expansion"}),
    "feature": frozenset({"kind", "path", "expansion", "dynamic"}),
}


@dataclass(frozen=True)
class SpeculatorSpec:
    """One configured speculator: ``kind`` (ngram | self | model | distilled) and its validated options."""

    kind: str
    options: Mapping[str, Any]

    @classmethod
    def from_wire(cls, entry: Any) -> SpeculatorSpec:
        """Validate one entry of the ``speculators`` config list."""
        if not isinstance(entry, Mapping) or entry.get("kind") not in _KIND_KEYS:
            raise ValueError(f"each speculator needs 'kind' in {sorted(_KIND_KEYS)}, got {entry!r}")
        kind = str(entry["kind"])
        unknown = sorted(str(k) for k in entry if k not in _KIND_KEYS[kind])
        if unknown:
            raise ValueError(f"unknown keys {unknown} for a {kind!r} speculator; known: {sorted(_KIND_KEYS[kind])}")
        options = {k: v for k, v in entry.items() if k != "kind"}
        if kind == "ngram":
            for name in ("max_ngram", "min_ngram", "num_draft_tokens", "num_branches"):
                if name in options:
                    check_int(options[name], f"ngram {name}", minimum=1)
        else:
            if "expansion" not in options:
                raise ValueError(f"a {kind!r} speculator needs an 'expansion' config, e.g. [1, 1, 3, 1]")
            options["expansion"] = validate_expansion(options["expansion"])
            if kind == "self":
                check_int(options.get("layers"), "self speculator layers", minimum=1)
            elif kind == "feature":
                # path: a `treeserve distill-features` file (default: the shipped one); expansion:
                # the greedy spine's widths per depth.
                if options.get("path") is not None and (not isinstance(options["path"], str) or not options["path"]):
                    raise ValueError("a 'feature' speculator's 'path' must be a weights file path or null")
                # dynamic: [depth, top_k, num_nodes] for greedy requests' confidence-shaped trees, or null.
                if options.get("dynamic") is not None:
                    dynamic = validate_expansion(options["dynamic"])
                    if len(dynamic) != 3:
                        raise ValueError("a 'feature' speculator's 'dynamic' is [depth, top_k, num_nodes] or null")
                    options["dynamic"] = dynamic
            elif kind == "distilled":
                # path: a `treeserve distill` weights file (default: the shipped one); index: which SSM in it.
                if options.get("path") is not None and (not isinstance(options["path"], str) or not options["path"]):
                    raise ValueError("a 'distilled' speculator's 'path' must be a weights file path or null")
                options["index"] = check_int(options.get("index", 0), "distilled speculator index")
            elif not isinstance(options.get("model"), str) or not options["model"]:
                raise ValueError("a 'model' speculator needs 'model': a registry name, .gguf path or folder")
        return cls(kind, options)


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
    :class:`~treeserve.ops.feature_drafter.FeatureSpeculator`), which receives them by ``add_features``."""

    uses_features: bool

    def add_features(self, states: Tensor) -> None: ...


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
        self._drafters: list[Transformer | None] = []  # per spec: the drafting model (None for ngram)

    async def on_start(self) -> None:
        """Load the LM (and any separate drafter LMs); fails the spawn on a bad path."""
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        await self._offload.run(self._load)

    def _load(self) -> None:
        cfg = self.config
        # The drafters read the LM's embedding and head (feature, distilled) or run its first
        # blocks (self:K): in the served format, on the format's kernels, not compiled (a
        # speculator never runs the full model's decode step).
        model = load_model(cfg.model, weight_format=cfg.dtype, compile_decode=False, cache_dir=cfg.cache_dir).model.to(cfg.device)
        dtype = model.dtype
        self._model = model
        for spec in cfg.speculators:
            if spec.kind == "self":
                self._drafters.append(model.truncated(int(spec.options["layers"])))  # ValueError if too many
            elif spec.kind == "model":
                other = load_model(spec.options["model"], weight_format=cfg.dtype, compile_decode=False,
                                   cache_dir=cfg.cache_dir).model.to(cfg.device)
                if other.config.vocab_size != model.config.vocab_size:
                    raise ValueError(
                        f"drafter {spec.options['model']!r} has vocab size {other.config.vocab_size}, "
                        f"the verifier's model {model.config.vocab_size}: they must share the tokenizer"
                    )
                self._drafters.append(other)
            elif spec.kind == "distilled":
                from treeserve.ops.ssm import DEFAULT_SSM_FILE, load_ssms

                ssms = load_ssms(model, spec.options.get("path") or DEFAULT_SSM_FILE)  # FileNotFoundError if absent
                if not spec.options["index"] < len(ssms):
                    raise ValueError(f"distilled speculator index {spec.options['index']} but the file has {len(ssms)} SSMs")
                self._drafters.append(ssms[spec.options["index"]])
            elif spec.kind == "feature":
                from treeserve.ops.feature_drafter import load_feature_drafter

                self._drafters.append(load_feature_drafter(model, spec.options.get("path")))  # FileNotFoundError if absent
            else:
                self._drafters.append(None)

    # ------------------------------------------------------------------ handlers
    @handler
    async def start(self, body: Any) -> None:
        """Create (or reset) ``request_id``'s speculators over ``prompt_ids``."""
        body = check_body(body, ("request_id", "prompt_ids"))
        request_id = _request_id(body["request_id"])
        prompt = _token_list(body["prompt_ids"], "prompt_ids", self._vocab_size())
        if not prompt:
            raise ValueError("prompt_ids must be a non-empty list of token ids")
        await self._offload.run(self._start, request_id, prompt)

    @handler
    async def propose(self, body: Any) -> dict[str, Any]:
        """Advance each request by its ``new_tokens`` and draft its merged token tree."""
        body = check_body(body, ("requests",), ("states",))
        entries = body["requests"]
        if not isinstance(entries, (list, tuple)):
            raise ValueError("propose needs a list 'requests'")
        vocab = self._vocab_size()
        checked = [check_body(e, ("request_id", "new_tokens", "max_depth", "params"),
                              ("history", "max_nodes", "num_states")) for e in entries]
        counts = [e.get("num_states") for e in checked]
        per_request: list[Tensor | None] = [None] * len(checked)
        if any(count is not None for count in counts):
            if body.get("states") is None:
                raise ValueError("propose gives num_states but no stacked 'states'")
            parts = split_states(body["states"], [count or 0 for count in counts], self._model_dim())
            per_request = [None if c is None else torch.from_numpy(p) for c, p in zip(counts, parts)]
        parsed = []
        for entry, states in zip(checked, per_request):
            history = entry.get("history")
            max_nodes = entry.get("max_nodes")
            parsed.append((
                _request_id(entry["request_id"]),
                _token_list(entry["new_tokens"], "new_tokens", vocab),
                check_int(entry["max_depth"], "max_depth"),
                params_from_wire(entry["params"]),
                None if history is None else _token_list(history, "history", vocab),
                None if max_nodes is None else check_int(max_nodes, "max_nodes", minimum=1),
                states,
            ))
        trees, missing = await self._offload.run(self._propose_all, parsed)
        return {"trees": [None if t is None else tree_to_wire(t) for t in trees], "missing": missing}

    @handler
    async def release(self, body: Any) -> None:
        """Forget ``request_id`` (idempotent)."""
        body = check_body(body, ("request_id",))
        request_id = _request_id(body["request_id"])
        await self._offload.run(self._states.pop, request_id, None)

    # ------------------------------------------------------------------ compute (worker thread)
    def _model_dim(self) -> int:
        assert self._model is not None
        return self._model.config.dim

    def _vocab_size(self) -> int:
        assert self._model is not None
        return self._model.config.vocab_size

    def _start(self, request_id: str, tokens: list[int]) -> None:
        speculators: list[Speculator] = []
        vocab = self._vocab_size()
        for spec, drafter in zip(self.config.speculators, self._drafters):
            if spec.kind == "ngram":
                speculators.append(NGramSpeculator(vocab, **spec.options))
            elif spec.kind == "distilled":
                from treeserve.ops.ssm import DistilledSpeculator, DistilledSSM

                assert isinstance(drafter, DistilledSSM)
                speculators.append(DistilledSpeculator(drafter, spec.options["expansion"], capacity=self.config.capacity))
            elif spec.kind == "feature":
                from treeserve.ops.feature_drafter import FeatureDrafter, FeatureSpeculator

                assert isinstance(drafter, FeatureDrafter)
                speculators.append(FeatureSpeculator(drafter, spec.options["expansion"], capacity=self.config.capacity,
                                                     dynamic=spec.options.get("dynamic")))
            else:
                assert drafter is not None
                speculators.append(ModelSpeculator(drafter, spec.options["expansion"], capacity=self.config.capacity))
        for speculator in speculators:
            speculator.prefill(tokens)
        self._states[request_id] = _RequestState(speculators, tokens[-1], history_len=len(tokens))

    def _propose_all(
        self, requests: Sequence[tuple[str, list[int], int, SamplingParams, list[int] | None, int | None, Tensor | None]]
    ) -> tuple[list[TokenTree | None], list[str]]:
        trees: list[TokenTree | None] = []
        missing: list[str] = []
        for request_id, new_tokens, max_depth, params, history, max_nodes, states in requests:
            state = self._states.get(request_id)
            is_in_step = state is not None and state.history_len + len(new_tokens) == len(history or ())
            if history and not is_in_step:
                # Lost, or out of step (e.g. an earlier propose never arrived): rebuild. The
                # history already ends with the current root, so new_tokens are not applied.
                self._start(request_id, history)
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
            if states is not None and states.shape[0]:
                # The LLM's states of the tokens before the root (all of them with a history).
                for speculator in state.speculators:
                    if isinstance(speculator, _FeatureUser) and speculator.uses_features:
                        speculator.add_features(states)
            trees.append(self._draft(state, params, max_depth, max_nodes))
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


def _request_id(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"request_id must be a non-empty string, got {value!r}")
    return value


def _token_list(value: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {type(value).__name__}")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in value):
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size})")
    return [int(t) for t in value]


__all__ = ["SpeculatorActor", "SpeculatorConfig", "SpeculatorSpec", "draft_seed"]

"""The one way to make speculators: spec string -> :class:`SpeculatorSpec` -> loaded drafter ->
one request's :class:`~treeserve.ops.drafting.Speculator`.

The server's speculator actors, ``treeserve generate`` (through the server or ``--in-process``),
``treeserve serve --speculator`` and the benches all build speculators here, so they run the
same kinds with the same options in the same order. The order matters: at a tree node,
multi-step speculative sampling tries the proposals in speculator order (see
:func:`default_speculators`).

A spec string is ``ngram``, ``suffix``, ``feature[:PATH]``, ``distilled:PATH``,
``self[:LAYERS]`` or ``model:PATH``; its wire form (the speculator actor's config entries) is a map with ``kind``
and the kind's options (:meth:`SpeculatorSpec.from_wire` lists them).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from treeserve.actors.model_host import check_int, load_on_device
from treeserve.ops.drafting import DEFAULT_EXPANSION, ModelSpeculator, Speculator, validate_expansion
from treeserve.ops.feature_drafter import DEFAULT_FEATURE_DRAFTER_FILE, FeatureDrafter, compile_draft_step, load_feature_drafter
from treeserve.ops.feature_speculator import DEFAULT_FEATURE_WIDTHS, FeatureSpeculator
from treeserve.ops.format_names import AUTO_FORMAT, WeightFormat
from treeserve.ops.graph_step import attach_draft_graphs, kernel_fits
from treeserve.ops.loaders.load import load_model
from treeserve.ops.loaders.registry import DEFAULT_MODEL
from treeserve.ops.model import Transformer
from treeserve.ops.ngram import NGramSpeculator
from treeserve.ops.ssm import DistilledSpeculator, DistilledSSM, load_ssms
from treeserve.ops.suffix import SuffixIndex, SuffixSpeculator

_log = logging.getLogger(__name__)


class SpeculatorKind(enum.StrEnum):
    """What drafts: n-grams of the text so far, the suffixes of everything the process has seen
    (every request's), the feature-level drafter, distilled SSMs, the verifier's own first
    layers, or another LM with the same tokenizer."""

    NGRAM = "ngram"
    SUFFIX = "suffix"
    FEATURE = "feature"
    DISTILLED = "distilled"
    SELF = "self"
    MODEL = "model"


SPEC_SYNTAX = "ngram | suffix | feature[:PATH] | distilled:PATH | self[:LAYERS] | model:PATH"
"""The spec strings :func:`parse_speculator` accepts (``none`` for no speculation is the caller's)."""
NGRAM_OPTIONS: Mapping[str, int] = {"max_ngram": 3, "num_draft_tokens": 8, "num_branches": 2}
"""The default n-gram drafter: model-free and nearly free to run."""
INT_FORMATS = tuple(f.value for f in WeightFormat if f.is_int)
"""The formats whose default speculators are the model-free ones (see :func:`default_speculators`)."""
SUFFIX_INDEX_OPTIONS = ("capacity", "min_ngram", "max_ngram", "max_matches")
"""The options of a ``suffix`` spec that configure its process-wide :class:`~treeserve.ops.suffix.SuffixIndex`;
the others (``num_draft_tokens``, ``max_nodes``, ``min_probability``) each request's speculator."""
DEFAULT_SELF_LAYERS = 4

_KIND_KEYS: Mapping[SpeculatorKind, frozenset[str]] = {
    SpeculatorKind.NGRAM: frozenset({"kind", "max_ngram", "min_ngram", "num_draft_tokens", "num_branches"}),
    SpeculatorKind.SUFFIX: frozenset({"kind", *SUFFIX_INDEX_OPTIONS, "num_draft_tokens", "max_nodes", "min_probability"}),
    SpeculatorKind.SELF: frozenset({"kind", "layers", "expansion"}),
    SpeculatorKind.MODEL: frozenset({"kind", "model", "expansion"}),
    SpeculatorKind.DISTILLED: frozenset({"kind", "path", "index", "expansion"}),
    SpeculatorKind.FEATURE: frozenset({"kind", "path", "expansion", "dynamic"}),
}

Drafter = Transformer | SuffixIndex | None
"""What a spec loads once per process: the drafting model (a truncated verifier, another LM,
a :class:`~treeserve.ops.ssm.DistilledSSM` or a :class:`~treeserve.ops.feature_drafter.FeatureDrafter`),
the suffix drafter's index (shared by every request of the process), or None for the
model-free n-gram drafter."""


@dataclass(frozen=True)
class SpeculatorSpec:
    """One configured speculator: its ``kind`` and its validated options."""

    kind: SpeculatorKind
    options: Mapping[str, Any]

    @classmethod
    def from_wire(cls, entry: Any) -> SpeculatorSpec:
        """Validate one entry of a ``speculators`` config list; ``ValueError`` names the problem.

        Options: ``ngram``: ``max_ngram``, ``min_ngram``, ``num_draft_tokens``, ``num_branches``
        (ints >= 1, all optional). ``suffix``: ``capacity``, ``min_ngram``, ``max_ngram``,
        ``max_matches``, ``num_draft_tokens``, ``max_nodes`` (ints >= 1) and ``min_probability``
        (0 to 1), all optional (:mod:`treeserve.ops.suffix`). Every other kind needs ``expansion`` (tree widths per depth).
        ``self``: ``layers`` (>= 1). ``model``: ``model`` (registry name, ``.gguf`` or folder).
        ``distilled``: ``path`` (a ``treeserve distill`` file; none is shipped) and ``index``
        (which SSM in it, default 0). ``feature``: ``path`` (a ``treeserve distill-features``
        file; null: the shipped one) and ``dynamic`` (``[depth, top_k, num_nodes]`` for greedy
        requests' confidence-shaped trees, or null).
        """
        kinds = {k.value for k in SpeculatorKind}
        if not isinstance(entry, Mapping) or entry.get("kind") not in kinds:
            raise ValueError(f"each speculator needs 'kind' in {sorted(kinds)}, got {entry!r}")
        kind = SpeculatorKind(entry["kind"])
        unknown = sorted(str(k) for k in entry if k not in _KIND_KEYS[kind])
        if unknown:
            raise ValueError(f"unknown keys {unknown} for a {kind.value!r} speculator; known: {sorted(_KIND_KEYS[kind])}")
        options = {k: v for k, v in entry.items() if k != "kind"}
        if kind is SpeculatorKind.NGRAM:
            for name in ("max_ngram", "min_ngram", "num_draft_tokens", "num_branches"):
                if name in options:
                    check_int(options[name], f"ngram {name}", minimum=1)
            return cls(kind, options)
        if kind is SpeculatorKind.SUFFIX:
            for name in (*SUFFIX_INDEX_OPTIONS, "num_draft_tokens", "max_nodes"):
                if name in options:
                    check_int(options[name], f"suffix {name}", minimum=1)
            if options.get("min_ngram", 2) > options.get("max_ngram", 6):
                raise ValueError("a 'suffix' speculator needs min_ngram <= max_ngram")
            if "min_probability" in options:
                value = options["min_probability"]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                    raise ValueError(f"suffix min_probability must be a number in [0, 1], got {value!r}")
            return cls(kind, options)
        if "expansion" not in options:
            raise ValueError(f"a {kind.value!r} speculator needs an 'expansion' config, e.g. [1, 1, 3, 1]")
        options["expansion"] = validate_expansion(options["expansion"])
        if kind is SpeculatorKind.SELF:
            check_int(options.get("layers"), "self speculator layers", minimum=1)
        elif kind is SpeculatorKind.FEATURE:
            if options.get("path") is not None and (not isinstance(options["path"], str) or not options["path"]):
                raise ValueError("a 'feature' speculator's 'path' must be a weights file path or null")
            if options.get("dynamic") is not None:
                dynamic = validate_expansion(options["dynamic"])
                if len(dynamic) != 3:
                    raise ValueError("a 'feature' speculator's 'dynamic' is [depth, top_k, num_nodes] or null")
                options["dynamic"] = dynamic
        elif kind is SpeculatorKind.DISTILLED:
            if not isinstance(options.get("path"), str) or not options["path"]:
                raise ValueError("a 'distilled' speculator needs 'path': the weights file `treeserve distill` "
                                 "wrote (none is shipped)")
            options["index"] = check_int(options.get("index", 0), "distilled speculator index")
        elif not isinstance(options.get("model"), str) or not options["model"]:
            raise ValueError("a 'model' speculator needs 'model': a registry name, .gguf path or folder")
        return cls(kind, options)

    def to_wire(self) -> dict[str, Any]:
        """The config entry :meth:`from_wire` reads back (tuples as lists)."""
        return {"kind": self.kind.value, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.options.items()}}


def parse_speculator(text: str, expansion: Sequence[int] = DEFAULT_EXPANSION) -> SpeculatorSpec:
    """The spec of one spec string (:data:`SPEC_SYNTAX`); ``expansion`` is the tree of the kinds
    that take one (``feature`` keeps its own widths) and sizes the n-gram drafts."""
    kind, _, arg = text.partition(":")
    expansion = list(validate_expansion(expansion))
    entry: dict[str, Any]
    if kind == SpeculatorKind.NGRAM and not arg:
        entry = {**NGRAM_OPTIONS, "num_draft_tokens": len(expansion)}
    elif kind == SpeculatorKind.SUFFIX and not arg:
        entry = {}
    elif kind == SpeculatorKind.FEATURE:
        entry = {"path": arg or None, "expansion": list(DEFAULT_FEATURE_WIDTHS)}
    elif kind == SpeculatorKind.DISTILLED:
        if not arg:
            raise ValueError(f"speculator {text!r} needs the SSM weights file: distilled:PATH (none is shipped; "
                             "`treeserve distill` writes one)")
        entry = {"path": arg, "index": 0, "expansion": expansion}
    elif kind == SpeculatorKind.SELF:
        try:
            layers = int(arg or DEFAULT_SELF_LAYERS)
        except ValueError:
            raise ValueError(f"speculator self:LAYERS needs an integer, got {text!r}") from None
        entry = {"layers": layers, "expansion": expansion}
    elif kind == SpeculatorKind.MODEL and arg:
        entry = {"model": arg, "expansion": expansion}
    else:
        raise ValueError(f"unknown speculator {text!r}; use {SPEC_SYNTAX}")
    return SpeculatorSpec.from_wire({"kind": kind, **entry})


def default_speculators(model: str, weight_format: str | None = None, device: str = "cpu") -> tuple[SpeculatorSpec, ...]:
    """The speculators a server runs unless told otherwise.

    In the int formats (``q4_1``, the CPU default that ``auto`` picks, and ``int8``): the suffix
    drafter, then the n-gram drafter, both model-free. There the verify step is fast enough that
    the feature drafter's own forwards cost more than the tokens it wins at batch 1 (q4_1,
    bench/RESULTS.md, 10 prompts of MT-Bench, GSM8K and HumanEval at temperatures 0 and 0.8:
    suffix + n-gram 0.92-1.77x incremental decoding; feature + n-gram + suffix 0.63-1.12x;
    the feature drafter alone 0.63-0.92x).

    Otherwise (float32, bfloat16, or ``weight_format`` None: unknown) the n-gram drafter,
    merged with the shipped feature-level drafter when ``model`` is the default model it was
    trained for. The feature drafter comes first: at a tree node, multi-step speculative
    sampling tries the proposals in speculator order, and a rejected n-gram point mass tried
    first would leave the better drafter's draws to be judged against the residual distribution
    (temperature 0.8, MT-Bench, bench/RESULTS.md: 1.07x incremental feature-first vs 0.97x
    n-gram-first; greedy is unaffected). Small tree budgets go to the first speculator as well.
    A self-drafter (the verifier's first K layers) agrees too rarely with the full model to pay
    for its forwards on this model, so it is opt-in."""
    int_format = weight_format in INT_FORMATS or (weight_format == AUTO_FORMAT and device == "cpu")
    if int_format:
        return (SpeculatorSpec(SpeculatorKind.SUFFIX, {}), SpeculatorSpec(SpeculatorKind.NGRAM, dict(NGRAM_OPTIONS)))
    specs = [SpeculatorSpec(SpeculatorKind.NGRAM, dict(NGRAM_OPTIONS))]
    if model == DEFAULT_MODEL and DEFAULT_FEATURE_DRAFTER_FILE.is_file():
        specs.insert(0, SpeculatorSpec(SpeculatorKind.FEATURE, {"path": None, "expansion": DEFAULT_FEATURE_WIDTHS}))
    return tuple(specs)


def load_drafter(spec: SpeculatorSpec, model: Transformer, *, weight_format: str | None = None,
                 cache_dir: str | None = None, device: str = "cpu", background: bool = False) -> Drafter:
    """Load what ``spec`` drafts with, once per process, onto ``model`` (the verifier's LM, whose
    embedding and head the feature and distilled drafters read). ``weight_format``,
    ``cache_dir`` and ``device`` are those of a ``model`` kind's other LM (the served ones);
    a feature drafter on an int format gets its compiled step from ``cache_dir`` (compiled
    there once; ``background``: on a thread while it drafts eagerly, as a speculator actor does).
    ``FileNotFoundError`` for a missing weights file, ``ValueError`` for one that does not fit
    ``model``."""
    if spec.kind is SpeculatorKind.SELF:
        return model.truncated(int(spec.options["layers"]))  # ValueError if too many
    if spec.kind is SpeculatorKind.SUFFIX:
        return SuffixIndex(**{k: v for k, v in spec.options.items() if k in SUFFIX_INDEX_OPTIONS})
    if spec.kind is SpeculatorKind.MODEL:
        # In the served format, on the format's kernels, not compiled: a speculator never runs
        # the full model's decode step.
        other = (load_model(spec.options["model"], compile_decode=False, cache_dir=cache_dir).model.to(device)
                 if weight_format is None else
                 load_on_device(spec.options["model"], weight_format=weight_format, device=device, cache_dir=cache_dir))
        if other.config.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"drafter {spec.options['model']!r} has vocab size {other.config.vocab_size}, "
                f"the verifier's model {model.config.vocab_size}: they must share the tokenizer"
            )
        return other
    if spec.kind is SpeculatorKind.DISTILLED:
        ssms = load_ssms(model, spec.options["path"])
        index = int(spec.options["index"])
        if not index < len(ssms):
            raise ValueError(f"distilled speculator index {index} but the file has {len(ssms)} SSMs")
        return ssms[index]
    if spec.kind is SpeculatorKind.FEATURE:
        return compile_draft_step(load_feature_drafter(model, spec.options.get("path")), cache_dir,
                                  background=background)
    return None


def capture_drafters(drafters: Sequence[Drafter], capacity: int | None) -> int:
    """On a GPU with the tree kernel (cupy), capture each feature drafter's forward over a few
    one-row caches of ``capacity`` slots (None: the drafter's ``max_seq_len``;
    :func:`~treeserve.ops.graph_step.attach_draft_graphs`), which its requests' speculators
    then draft in; returns how many drafters were captured (none on a CPU). A failed capture
    is logged and that drafter drafts eagerly."""
    captured = 0
    for drafter in drafters:
        if isinstance(drafter, FeatureDrafter) and kernel_fits(drafter):
            try:
                attach_draft_graphs(drafter, capacity if capacity is not None else drafter.config.max_seq_len)
            except Exception:  # drafting goes on eagerly
                _log.warning("capturing the feature drafter's CUDA graphs failed; it drafts eagerly", exc_info=True)
                continue
            captured += 1
    return captured


def make_speculator(spec: SpeculatorSpec, drafter: Drafter, vocab_size: int, capacity: int | None = None) -> Speculator:
    """A fresh speculator of ``spec`` for one request; ``drafter`` is what :func:`load_drafter`
    loaded for it, ``capacity`` bounds its KV cache (None: the drafter's ``max_seq_len``)."""
    if spec.kind is SpeculatorKind.NGRAM:
        return NGramSpeculator(vocab_size, **spec.options)
    if spec.kind is SpeculatorKind.SUFFIX:
        assert isinstance(drafter, SuffixIndex)
        return SuffixSpeculator(drafter, vocab_size,
                                **{k: v for k, v in spec.options.items() if k not in SUFFIX_INDEX_OPTIONS})
    if spec.kind is SpeculatorKind.DISTILLED:
        assert isinstance(drafter, DistilledSSM)
        return DistilledSpeculator(drafter, spec.options["expansion"], capacity=capacity)
    if spec.kind is SpeculatorKind.FEATURE:
        assert isinstance(drafter, FeatureDrafter)
        return FeatureSpeculator(drafter, spec.options["expansion"], capacity=capacity,
                                 dynamic=spec.options.get("dynamic"))
    assert isinstance(drafter, Transformer)
    return ModelSpeculator(drafter, spec.options["expansion"], capacity=capacity)


def make_speculators(specs: Sequence[SpeculatorSpec], drafters: Sequence[Drafter], vocab_size: int,
                     capacity: int | None = None) -> list[Speculator]:
    """One request's speculators, in spec order (``drafters[i]`` loaded for ``specs[i]``)."""
    if len(specs) != len(drafters):
        raise ValueError(f"{len(specs)} speculator specs but {len(drafters)} drafters")
    return [make_speculator(spec, drafter, vocab_size, capacity) for spec, drafter in zip(specs, drafters)]


__all__ = [
    "DEFAULT_SELF_LAYERS", "NGRAM_OPTIONS", "SUFFIX_INDEX_OPTIONS", "SPEC_SYNTAX", "Drafter", "SpeculatorKind", "SpeculatorSpec",
    "default_speculators", "load_drafter", "make_speculator", "make_speculators", "parse_speculator",
]

"""Training the SSJF output-length predictor, and the ``treeserve train-predictor`` command.

The predictor itself (features, the ridge and rank heads, ``load_predictor``, ``OnlineHead``)
lives below the actors, in :mod:`treeserve.ops.length_predictor`, and its names are re-exported
here. :func:`train_predictor` reports held-out metrics of the saved feature set and of every
compared one, on prompts recorded by ``bench/predictor_data.py`` (:func:`load_length_data`):
either k-fold cross-validated, or, with ``test``, on a held-out test split that no head is fit
on. :func:`is_test_prompt` is that split (a hash of the prompt's set and id, so the benchmark
traces draw their prompts from it and never from training data). ``main`` is the
``treeserve train-predictor`` entry point.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from treeserve.ops.length_predictor import DEFAULT_ALPHAS, HEADS, FeatureSpec, Predictor, PredictorError, evaluate, features, fit_predictor, load_predictor, pooled_hidden_features, prompt_hidden
from treeserve.training.length_heads import fit_listmle_predictor, fit_ordinal_predictor, fit_rank_predictor
from treeserve.training.length_data import LengthExample, is_test_prompt, load_length_data

if TYPE_CHECKING:
    from treeserve.ops.model import Transformer



# ---------------------------------------------------------------------------------- training
@dataclass
class TrainReport:
    """What :func:`train_predictor` returns: the predictor (fit on all examples), the
    cross-validated held-out metrics and out-of-fold predictions of every compared spec."""

    predictor: Predictor
    held_out: dict[str, dict[str, float]]
    num_examples: int
    num_folds: int
    test_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    held_out_predictions: dict[str, np.ndarray] = field(default_factory=dict)


def spec_name(spec: FeatureSpec) -> str:
    """A short label: ``hidden@4``, ``tokens@1024``, ``prompt_len``."""
    if spec.kind == "hidden":
        return f"hidden@{spec.num_layers}"
    return f"tokens@{spec.num_buckets}" if spec.kind == "tokens" else "prompt_len"


def feature_matrix(spec: FeatureSpec, examples: Sequence[LengthExample], model: Transformer | None,
                   cache_dir: Path | None = None) -> tuple[np.ndarray, float]:
    """Features of every example ``(N, F)`` and the mean seconds per prompt they took.

    With ``cache_dir``, features are also kept in ``<cache_dir>/<spec>.npz`` by a hash of each
    prompt's ids, and reused on a later call (the seconds are then the recorded ones).
    """
    truncated = model.truncated(spec.num_layers) if spec.needs_model and model is not None else None
    keys = [hashlib.sha256(np.asarray(e.prompt_ids, dtype=np.int64).tobytes()).hexdigest() for e in examples]
    cached: dict[str, np.ndarray] = {}
    seconds_per_prompt = None
    path = None if cache_dir is None else cache_dir / f"features_{spec_name(spec).replace('@', '_')}.npz"
    if path is not None and path.exists():
        with np.load(path, allow_pickle=False) as data:
            cached = dict(zip([str(k) for k in data["keys"]], data["x"]))
            seconds_per_prompt = float(data["seconds_per_prompt"])
    missing = [i for i, k in enumerate(keys) if k not in cached]
    if missing:
        started = time.perf_counter()
        for i in missing:
            cached[keys[i]] = features(spec, examples[i].prompt_ids, truncated)
        seconds_per_prompt = (time.perf_counter() - started) / len(missing)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(path, keys=np.array(list(cached)), x=np.stack(list(cached.values())),
                     seconds_per_prompt=np.array(seconds_per_prompt))
    return np.stack([cached[k] for k in keys]), float(seconds_per_prompt or 0.0)


def hidden_features_at(model: Transformer, prompt_ids: Sequence[int], layers: Sequence[int]) -> dict[int, np.ndarray]:
    """``hidden@L`` features of one prompt for every ``L`` in ``layers``, from one prefill of the
    first ``max(layers)`` blocks: the same vectors :func:`features` computes with
    ``model.truncated(L)`` for each ``L`` (final norm, then mean / last-token pooling).

    The state after ``L`` blocks is read where the model's loop hands it on: at block ``L``'s
    input norm, or at the final norm for the last block run.
    """
    import torch

    deepest = max(layers)
    truncated = model.truncated(deepest)
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for layer in set(layers):
        norm = truncated.norm if layer == deepest else truncated.layers[layer].input_layernorm

        def grab(_module: Any, inputs: tuple[Any, ...], layer: int = layer) -> None:
            captured[layer] = inputs[0].detach()
        handles.append(norm.register_forward_pre_hook(grab))
    try:
        prompt_hidden(truncated, prompt_ids)
    finally:
        for handle in handles:
            handle.remove()
    with torch.inference_mode():
        return {layer: pooled_hidden_features(truncated.norm(captured[layer])[0].float().cpu().numpy())
                for layer in layers}


def cache_hidden_features(layers: Sequence[int], examples: Sequence[LengthExample], model: Transformer,
                          cache_dir: Path, *, log_every: int = 0) -> None:
    """Compute every ``hidden@L`` feature set of ``layers`` for ``examples`` in one pass per prompt
    (:func:`hidden_features_at`) into the files :func:`feature_matrix` reads from ``cache_dir``;
    prompts already cached for every ``L`` are skipped. ``seconds_per_prompt`` of ``hidden@L``
    is the measured cost of one ``L``-block prefill, scaled from the pass by ``L / max(layers)``."""
    specs = {layer: FeatureSpec("hidden", num_layers=layer) for layer in layers}
    paths = {layer: cache_dir / f"features_{spec_name(spec).replace('@', '_')}.npz" for layer, spec in specs.items()}
    cached: dict[int, dict[str, np.ndarray]] = {}
    for layer, path in paths.items():
        cached[layer] = {}
        if path.exists():
            with np.load(path, allow_pickle=False) as data:
                cached[layer] = dict(zip([str(k) for k in data["keys"]], data["x"]))
    keys = [hashlib.sha256(np.asarray(e.prompt_ids, dtype=np.int64).tobytes()).hexdigest() for e in examples]
    missing = [i for i, k in enumerate(keys) if any(k not in cached[layer] for layer in layers)]
    if not missing:
        return
    started = time.perf_counter()

    def save() -> None:
        seconds = (time.perf_counter() - started) / max(1, done)
        cache_dir.mkdir(parents=True, exist_ok=True)
        for layer, path in paths.items():
            np.savez(path, keys=np.array(list(cached[layer])), x=np.stack(list(cached[layer].values())),
                     seconds_per_prompt=np.array(seconds * layer / max(layers)))

    done = 0
    for i in missing:
        for layer, x in hidden_features_at(model, examples[i].prompt_ids, layers).items():
            cached[layer][keys[i]] = x
        done += 1
        if log_every and done % log_every == 0:
            save()  # resumable: a killed run keeps what it computed
            print(f"[train-predictor] features {done}/{len(missing)}, {time.perf_counter() - started:.0f} s", flush=True)
    save()


def fit_head(head: str, x: np.ndarray, lengths: np.ndarray, spec: FeatureSpec, max_tokens: int, *,
             alphas: Sequence[float] = DEFAULT_ALPHAS, seed: int = 0) -> Predictor:
    """Fit a ``ridge``, ``rank``, ``ordinal`` or ``listmle`` head (:data:`HEADS`) on features ``x`` and true ``lengths``."""
    if head == "ridge":
        return fit_predictor(x, lengths, spec, max_tokens, alphas=alphas, seed=seed)
    if head == "rank":
        return fit_rank_predictor(x, lengths, spec, max_tokens, seed=seed)
    if head == "ordinal":
        return fit_ordinal_predictor(x, lengths, spec, max_tokens, seed=seed)
    if head == "listmle":
        return fit_listmle_predictor(x, lengths, spec, max_tokens, seed=seed)
    raise PredictorError(f"head must be one of {HEADS}, got {head!r}")


def train_predictor(
    examples: Sequence[LengthExample],
    spec: FeatureSpec,
    *,
    model: Transformer | None = None,
    compare: Sequence[FeatureSpec] = (),
    max_tokens: int = 512,
    num_folds: int = 5,
    seed: int = 0,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    head: str = "ridge",
    test: Sequence[LengthExample] = (),
    cache_dir: Path | None = None,
) -> TrainReport:
    """Train the predictor of ``spec``; measure it and each ``compare`` spec on held-out prompts.

    Held-out figures are ``num_folds``-fold cross-validated: the examples are split into seeded
    random folds, each fold is predicted by a head fit on the other folds only (its ridge
    strength chosen by an inner CV there), and :func:`evaluate` scores the pooled out-of-fold
    predictions, so every example is a held-out prompt exactly once (plus ``feature_ms``: mean
    feature cost per prompt). The returned predictor is then fit on all examples. ``hidden``
    specs need ``model``. ``head`` picks the head (:func:`fit_head`; the compared specs use it
    too). With ``test`` examples, no cross-validation runs: every head is fit on ``examples``
    once and the held-out figures are its predictions on ``test`` (``held_out_predictions`` and
    ``test_indices`` then index ``test``); ``fit_s`` records the saved head's training time.
    """
    if test:
        return _train_with_test_split(examples, test, spec, model=model, compare=compare, max_tokens=max_tokens,
                                      seed=seed, alphas=alphas, head=head, cache_dir=cache_dir)
    if num_folds < 2:
        raise PredictorError(f"num_folds must be >= 2, got {num_folds}")
    if len(examples) < 2 * num_folds:
        raise PredictorError(f"need at least {2 * num_folds} examples for {num_folds} folds, got {len(examples)}")
    lengths = np.array([e.num_output_tokens for e in examples], dtype=np.float64)
    folds = np.random.default_rng(seed).permutation(len(examples)) % num_folds
    held_out: dict[str, dict[str, float]] = {}
    predictions: dict[str, np.ndarray] = {}
    final: Predictor | None = None
    specs = [spec] + [s for s in compare if s != spec]
    for current in specs:
        x, seconds = feature_matrix(current, examples, model, cache_dir)
        predicted = np.zeros(len(examples))
        for k in range(num_folds):
            fitted = fit_head(head, x[folds != k], lengths[folds != k], current, max_tokens, alphas=alphas, seed=seed)
            predicted[folds == k] = np.asarray(fitted.predict_features(x[folds == k]))
        predictions[spec_name(current)] = predicted
        held_out[spec_name(current)] = {**evaluate(predicted, lengths), "feature_ms": 1000 * seconds}
        if current == spec:
            final = fit_head(head, x, lengths, current, max_tokens, alphas=alphas, seed=seed)
            final.meta["held_out"] = held_out[spec_name(current)]
    assert final is not None
    return TrainReport(final, held_out, len(examples), num_folds, np.arange(len(examples)), predictions)


def _train_with_test_split(examples: Sequence[LengthExample], test: Sequence[LengthExample], spec: FeatureSpec, *,
                           model: Transformer | None, compare: Sequence[FeatureSpec], max_tokens: int, seed: int,
                           alphas: Sequence[float], head: str, cache_dir: Path | None) -> TrainReport:
    """:func:`train_predictor` with a held-out test split (see there)."""
    train_ids = {(e.dataset, e.id) for e in examples}
    if any((e.dataset, e.id) in train_ids for e in test):
        raise PredictorError("a test prompt is also a training prompt")
    lengths = np.array([e.num_output_tokens for e in examples], dtype=np.float64)
    test_lengths = np.array([e.num_output_tokens for e in test], dtype=np.float64)
    held_out: dict[str, dict[str, float]] = {}
    predictions: dict[str, np.ndarray] = {}
    final: Predictor | None = None
    for current in [spec] + [s for s in compare if s != spec]:
        x, seconds = feature_matrix(current, examples, model, cache_dir)
        x_test, _ = feature_matrix(current, test, model, cache_dir)
        started = time.perf_counter()
        fitted = fit_head(head, x, lengths, current, max_tokens, alphas=alphas, seed=seed)
        fit_s = time.perf_counter() - started
        predicted = np.asarray(fitted.predict_features(x_test))
        predictions[spec_name(current)] = predicted
        held_out[spec_name(current)] = {**evaluate(predicted, test_lengths), "feature_ms": 1000 * seconds,
                                        "fit_s": fit_s}
        if current == spec:
            final = fitted
            final.meta["held_out"] = held_out[spec_name(current)]
    assert final is not None
    return TrainReport(final, held_out, len(examples), 0, np.arange(len(test)), predictions)


def _parse_spec(text: str, num_buckets: int) -> FeatureSpec:
    kind, _, arg = text.partition("@")
    if kind == "hidden":
        return FeatureSpec("hidden", num_layers=int(arg or 4))
    if kind == "tokens":
        return FeatureSpec("tokens", num_buckets=int(arg or num_buckets))
    return FeatureSpec(kind)


DEFAULT_DATA = (Path("bench/data/predictor_lengths_512_q4_1.csv"),
                Path("bench/out/predictor_lengths_512_q4_1_alpacaeval.csv"))
"""The shipped predictor's data (``bench/predictor_data.py``, q4_1, ``max_tokens`` 512): the
committed CSV and the AlpacaEval rows (CC BY-NC, in the ignored ``bench/out/``). The earlier
256-token runs (``bench/data/predictor_lengths_256*.csv``) stay for reference."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``treeserve train-predictor`` flags."""
    parser.add_argument("--data", type=Path, nargs="+", default=None,
                        help="CSVs written by bench/predictor_data.py (default: "
                             + " ".join(str(p) for p in DEFAULT_DATA) + ", those that exist)")
    parser.add_argument("--prompts-dir", type=Path, default=Path("bench/data"),
                        help="folder with the <dataset>.jsonl prompt files (fetch.py, synthetic.py)")
    parser.add_argument("--features", default="hidden@12",
                        help="hidden@LAYERS | tokens@BUCKETS | prompt_len (the predictor to save)")
    parser.add_argument("--head", default="ordinal", choices=HEADS,
                        help="rank: pairwise ranking loss on top of ridge; ordinal: proportional-odds model of the "
                             "length buckets; ridge: regression on log length (the other heads are reported too)")
    parser.add_argument("--compare", nargs="*", default=["hidden@4", "hidden@8", "prompt_len", "tokens@1024"],
                        help="other feature specs to report on the held-out prompts")
    parser.add_argument("--cross-validate", action="store_true",
                        help="report k-fold cross-validation over all prompts instead of the held-out test split "
                             "(treeserve.training.length_data.is_test_prompt); the saved head is then fit on every prompt")
    parser.add_argument("--features-cache", type=Path, default=Path("bench/out/predictor_features"),
                        help="keep computed features here, by prompt hash, for reruns")
    parser.add_argument("--out", type=Path, default=None, help="where to save the .npz (default: do not save)")
    parser.add_argument("--predictions-out", type=Path, default=None,
                        help="write the held-out prompts' true and predicted lengths here (CSV)")
    parser.add_argument("--model", default=None, help="served model (default: the default model)")
    parser.add_argument("--folds", type=int, default=5, help="folds of --cross-validate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--baseline", type=Path, nargs="*", default=[],
                        help="saved predictors (.npz) to score on the same held-out prompts (e.g. the shipped one)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="a bench/scheduling.py trace: also report tau on its prompts (by their source set/id)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def held_out_by_dataset(examples: Sequence[LengthExample], report: TrainReport,
                        min_examples: int = 10) -> dict[str, dict[str, dict[str, float]]]:
    """:func:`evaluate` of each spec's out-of-fold predictions within each dataset (>= ``min_examples``)."""
    names = np.array([e.dataset for e in examples])
    lengths = np.array([e.num_output_tokens for e in examples], dtype=np.float64)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for dataset in sorted(set(names.tolist())):
        mask = names == dataset
        if mask.sum() >= min_examples:
            out[dataset] = {n: evaluate(p[mask], lengths[mask]) for n, p in report.held_out_predictions.items()}
    return out


def write_predictions(path: Path, examples: Sequence[LengthExample], report: TrainReport) -> None:
    """CSV of every held-out prompt's true length and predictions (one column per compared
    spec; ``predicted_len`` is the saved spec's), as ``bench/scheduling.py --jobs`` reads it.
    ``examples`` are the prompts the predictions refer to (the test split, or all prompts for
    cross-validation)."""
    names = list(report.held_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["dataset", "id", "num_prompt_tokens", "num_output_tokens", "is_capped", "predicted_len"]
                        + [f"pred_{n}" for n in names])
        for row, index in enumerate(report.test_indices):
            e = examples[int(index)]
            preds = [float(report.held_out_predictions[n][row]) for n in names]
            writer.writerow([e.dataset, e.id, len(e.prompt_ids), e.num_output_tokens, int(e.is_capped),
                             f"{preds[0]:.2f}"] + [f"{v:.2f}" for v in preds])


def _print_report(args: argparse.Namespace, report: TrainReport, num_examples: int, num_train: int, num_test: int,
                  result: dict[str, Any], seconds: float) -> None:
    """``train-predictor``'s held-out table as text (``result``: what ``--json`` prints)."""
    how = (f"{report.num_folds}-fold cross-validation over {num_examples} prompts" if args.cross_validate
           else f"trained on {num_train} prompts, scored on {num_test} held-out test prompts")
    public, trace = result["held_out_public_sets"], result["held_out_trace_prompts"]
    print(f"held-out ({how}); head {args.head}")
    print(f"{'features':<16} {'MAE tok':>8} {'bucket acc':>10} {'tau':>6} {'tau public':>10} "
          f"{'bucket public':>13} {'tau trace':>9} {'feat ms':>8}")
    for name, m in report.held_out.items():
        pub = public.get(name, {})
        print(f"{name:<16} {m['mae_tokens']:>8.1f} {m['bucket_accuracy']:>10.3f} "
              f"{m['kendall_tau']:>6.3f} {pub.get('kendall_tau', float('nan')):>10.3f} "
              f"{pub.get('bucket_accuracy', float('nan')):>13.3f} "
              f"{trace.get(name, {}).get('kendall_tau', float('nan')):>9.3f} {m['feature_ms']:>8.1f}")
    print("Kendall's tau within each dataset (held out):")
    for dataset, per_spec in result["held_out_by_dataset"].items():
        print(f"  {dataset:<11} n={int(next(iter(per_spec.values()))['num']):<4} "
              + " ".join(f"{n}={m['kendall_tau']:.3f}" for n, m in per_spec.items()))
    print(f"training took {seconds:.1f} s (features included; cached features are reused)")


def run(args: argparse.Namespace) -> int:
    """Run ``train-predictor`` with parsed ``args``; prints the held-out table; returns an exit code."""
    import torch

    from treeserve.models import DEFAULT_MODEL, REGISTRY, load_model

    torch.set_num_threads(args.threads)
    model_name = args.model or DEFAULT_MODEL
    loaded = load_model(model_name)
    data = args.data or [p for p in DEFAULT_DATA if p.exists()]
    header, examples = load_length_data(data, args.prompts_dir, loaded.tokenizer)
    spec = _parse_spec(args.features, 1024)
    compare = [_parse_spec(s, 1024) for s in args.compare]
    test = [] if args.cross_validate else [e for e in examples if is_test_prompt(e.dataset, e.id)]
    train = examples if args.cross_validate else [e for e in examples if not is_test_prompt(e.dataset, e.id)]
    common = {"model": loaded.model, "max_tokens": int(header.get("max_tokens", 512)), "num_folds": args.folds,
              "seed": args.seed, "test": test, "cache_dir": args.features_cache}
    started = time.perf_counter()
    layers = sorted({s.num_layers for s in [spec, *compare] if s.kind == "hidden"})
    if layers and args.features_cache is not None:  # every hidden@L from one prefill per prompt
        cache_hidden_features(layers, examples, loaded.model, args.features_cache)
    report = train_predictor(train, spec, compare=compare, head=args.head, **common)
    seconds = time.perf_counter() - started
    for other in (h for h in HEADS if h != args.head):  # the same features under the other heads
        alternative = train_predictor(train, spec, head=other, **common)
        report.held_out[f"{spec_name(spec)}/{other}"] = alternative.held_out[spec_name(spec)]
        report.held_out_predictions[f"{spec_name(spec)}/{other}"] = alternative.held_out_predictions[spec_name(spec)]
    scored = test or examples
    for path in args.baseline:  # a saved head, scored on the same prompts with its own features
        old = load_predictor(path)
        x_old, _ = feature_matrix(old.spec, scored, loaded.model, args.features_cache)
        name = f"baseline:{path.name}"
        predicted = np.minimum(np.asarray(old.predict_features(x_old)), float(common["max_tokens"]))
        report.held_out[name] = {**evaluate(predicted, np.array([e.num_output_tokens for e in scored], dtype=np.float64)),
                                 "feature_ms": 0.0}
        report.held_out_predictions[name] = predicted
    spec_obj = REGISTRY.get(model_name)
    report.predictor.meta.update({
        "trained_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "head": args.head,
        "data": [str(p) for p in data], "data_provenance": header, "num_examples": len(examples),
        "num_train": len(train), "num_test": len(test), "train_sets": sorted({e.dataset for e in train}),
        "split": "cross-validation" if args.cross_validate else "treeserve.training.length_data.is_test_prompt",
        "model": model_name, "model_gguf_sha256": spec_obj.gguf_sha256 if spec_obj else None,
        "folds": args.folds, "seed": args.seed, "script": "treeserve train-predictor",
        "train_s_with_features": round(seconds, 1),
    })
    if args.out is not None:
        report.predictor.save(args.out)
    if args.predictions_out is not None:
        write_predictions(args.predictions_out, scored, report)
    by_dataset = held_out_by_dataset(scored, report)
    public = [i for i, e in enumerate(scored) if e.dataset != "synthetic"]
    lengths = np.array([e.num_output_tokens for e in scored], dtype=np.float64)
    public_only = {n: evaluate(p[public], lengths[public]) for n, p in report.held_out_predictions.items()} \
        if public else {}
    trace_only: dict[str, dict[str, float]] = {}
    if args.trace is not None:
        sources = {json.loads(line).get("source") for line in args.trace.read_text(encoding="utf-8").split("\n")
                   if line.strip()}
        on_trace = [i for i, e in enumerate(scored) if f"{e.dataset}/{e.id}" in sources]
        trace_only = {n: evaluate(p[on_trace], lengths[on_trace]) for n, p in report.held_out_predictions.items()} \
            if on_trace else {}
    result = {"spec": spec_name(spec), "head": args.head, "num_train": len(train), "num_test": len(test),
              "num_folds": report.num_folds, "held_out": report.held_out, "held_out_public_sets": public_only,
              "held_out_trace_prompts": trace_only,
              "held_out_by_dataset": by_dataset, "train_s_with_features": seconds,
              "saved_to": str(args.out) if args.out else None}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _print_report(args, report, len(examples), len(train), len(test), result, seconds)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m treeserve.training.predictor`` == ``treeserve train-predictor``."""
    parser = argparse.ArgumentParser(prog="treeserve train-predictor",
                                     description="train the output-length predictor used by SSJF")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

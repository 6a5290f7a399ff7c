"""Training the SSJF output-length predictor, and the ``treeserve train-predictor`` command.

The predictor itself (features, the ridge head, ``load_predictor``, ``OnlineHead``) lives below
the actors, in :mod:`treeserve.ops.length_predictor`, and its names are re-exported here.
:func:`train_predictor` reports cross-validated held-out metrics of the saved feature set and
of every compared one, on prompts recorded by ``bench/predictor_data.py``
(:func:`load_length_data`). ``main`` is the ``treeserve train-predictor`` entry point.
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

from treeserve.ops.length_predictor import (
    BUCKET_EDGES,
    DEFAULT_ALPHAS,
    DEFAULT_PREDICTOR_FILE,
    FEATURE_KINDS,
    FeatureSpec,
    OnlineHead,
    Predictor,
    PredictorError,
    bucket_of,
    evaluate,
    features,
    fit_predictor,
    kendall_tau,
    load_predictor,
    pooled_hidden_features,
    prompt_hidden,
    token_features,
)

if TYPE_CHECKING:
    from treeserve.ops.model import Transformer

__all__ = [
    "BUCKET_EDGES",
    "DEFAULT_ALPHAS",
    "DEFAULT_PREDICTOR_FILE",
    "FEATURE_KINDS",
    "FeatureSpec",
    "LengthExample",
    "OnlineHead",
    "Predictor",
    "PredictorError",
    "TrainReport",
    "add_arguments",
    "bucket_of",
    "evaluate",
    "feature_matrix",
    "features",
    "fit_predictor",
    "held_out_by_dataset",
    "kendall_tau",
    "load_length_data",
    "load_predictor",
    "main",
    "pooled_hidden_features",
    "prompt_hidden",
    "read_length_csv",
    "run",
    "spec_name",
    "token_features",
    "train_predictor",
    "write_predictions",
]


# ---------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class LengthExample:
    """One recorded prompt: where it came from, its chat-templated ids and the real output length."""

    dataset: str
    id: str
    prompt_ids: tuple[int, ...]
    num_output_tokens: int
    is_capped: bool


def read_length_csv(path: str | Path) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """The provenance header (``# key: json``) and the rows of a ``bench/predictor_data.py`` CSV."""
    header: dict[str, Any] = {}
    lines = Path(path).read_text(encoding="utf-8").split("\n")
    body = []
    for line in lines:
        if line.startswith("# "):
            key, _, value = line[2:].partition(": ")
            header[key] = json.loads(value)
        elif line.strip():
            body.append(line)
    return header, list(csv.DictReader(body))


def load_length_data(csv_path: str | Path, prompts_dir: str | Path, tokenizer: Any) -> tuple[dict[str, Any], list[LengthExample]]:
    """Join the CSV rows with the fetched prompt files (``<prompts_dir>/<dataset>.jsonl``) by id.

    Each prompt is checked against the row's ``prompt_sha256`` and re-tokenized with the chat
    template; a row whose prompt is missing or differs raises :class:`PredictorError`.
    """
    header, rows = read_length_csv(csv_path)
    prompts: dict[tuple[str, str], str] = {}
    for dataset in sorted({r["dataset"] for r in rows}):
        path = Path(prompts_dir) / f"{dataset}.jsonl"
        if not path.exists():
            raise PredictorError(f"{path} is missing: run python bench/data/fetch.py {dataset}")
        for line in path.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                record = json.loads(line)
                prompts[(dataset, str(record["id"]))] = record["prompt"]
    examples = []
    for row in rows:
        prompt = prompts.get((row["dataset"], row["id"]))
        if prompt is None or hashlib.sha256(prompt.encode("utf-8")).hexdigest() != row["prompt_sha256"]:
            raise PredictorError(f"prompt {row['dataset']}/{row['id']} is missing or differs from the recorded one")
        ids = tuple(int(t) for t in tokenizer.encode_chat([{"role": "user", "content": prompt}]))
        examples.append(LengthExample(row["dataset"], row["id"], ids, int(row["num_output_tokens"]),
                                      row["is_capped"] == "1"))
    return header, examples


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


def feature_matrix(spec: FeatureSpec, examples: Sequence[LengthExample], model: Transformer | None) -> tuple[np.ndarray, float]:
    """Features of every example ``(N, F)`` and the mean seconds per prompt it took."""
    truncated = model.truncated(spec.num_layers) if spec.needs_model and model is not None else None
    started = time.perf_counter()
    rows = [features(spec, e.prompt_ids, truncated) for e in examples]
    return np.stack(rows), (time.perf_counter() - started) / max(1, len(examples))


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
) -> TrainReport:
    """Train the predictor of ``spec``; measure it and each ``compare`` spec on held-out prompts.

    Held-out figures are ``num_folds``-fold cross-validated: the examples are split into seeded
    random folds, each fold is predicted by a head fit on the other folds only (its ridge
    strength chosen by an inner CV there), and :func:`evaluate` scores the pooled out-of-fold
    predictions, so every example is a held-out prompt exactly once (plus ``feature_ms``: mean
    feature cost per prompt). The returned predictor is then fit on all examples. ``hidden``
    specs need ``model``.
    """
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
        x, seconds = feature_matrix(current, examples, model)
        predicted = np.zeros(len(examples))
        for k in range(num_folds):
            fitted = fit_predictor(x[folds != k], lengths[folds != k], current, max_tokens, alphas=alphas, seed=seed)
            predicted[folds == k] = np.asarray(fitted.predict_features(x[folds == k]))
        predictions[spec_name(current)] = predicted
        held_out[spec_name(current)] = {**evaluate(predicted, lengths), "feature_ms": 1000 * seconds}
        if current == spec:
            final = fit_predictor(x, lengths, current, max_tokens, alphas=alphas, seed=seed)
            final.meta["held_out"] = held_out[spec_name(current)]
    assert final is not None
    return TrainReport(final, held_out, len(examples), num_folds, np.arange(len(examples)), predictions)


def _parse_spec(text: str, num_buckets: int) -> FeatureSpec:
    kind, _, arg = text.partition("@")
    if kind == "hidden":
        return FeatureSpec("hidden", num_layers=int(arg or 4))
    if kind == "tokens":
        return FeatureSpec("tokens", num_buckets=int(arg or num_buckets))
    return FeatureSpec(kind)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``treeserve train-predictor`` flags."""
    parser.add_argument("--data", type=Path, default=Path("bench/data/predictor_lengths.csv"),
                        help="CSV written by bench/predictor_data.py")
    parser.add_argument("--prompts-dir", type=Path, default=Path("bench/data"),
                        help="folder with the fetched <dataset>.jsonl prompt files")
    parser.add_argument("--features", default="hidden@4",
                        help="hidden@LAYERS | tokens@BUCKETS | prompt_len (the predictor to save)")
    parser.add_argument("--compare", nargs="*", default=["prompt_len", "tokens@1024", "hidden@4", "hidden@30"],
                        help="other feature specs to report on the held-out split")
    parser.add_argument("--out", type=Path, default=None, help="where to save the .npz (default: do not save)")
    parser.add_argument("--predictions-out", type=Path, default=None,
                        help="write the held-out prompts' true and predicted lengths here (CSV)")
    parser.add_argument("--model", default=None, help="served model (default: the default model)")
    parser.add_argument("--folds", type=int, default=5, help="cross-validation folds of the held-out figures")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
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
    """CSV of every prompt's true length and out-of-fold predictions (one column per compared
    spec; ``predicted_len`` is the saved spec's), as ``bench/scheduling.py --jobs`` reads it."""
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


def run(args: argparse.Namespace) -> int:
    """Run ``train-predictor`` with parsed ``args``; prints the held-out table; returns an exit code."""
    import torch

    from treeserve.models import DEFAULT_MODEL, REGISTRY, load_model

    torch.set_num_threads(args.threads)
    model_name = args.model or DEFAULT_MODEL
    loaded = load_model(model_name)
    header, examples = load_length_data(args.data, args.prompts_dir, loaded.tokenizer)
    spec = _parse_spec(args.features, 1024)
    compare = [_parse_spec(s, 1024) for s in args.compare]
    report = train_predictor(examples, spec, model=loaded.model, compare=compare,
                             max_tokens=int(header.get("max_tokens", 512)), num_folds=args.folds, seed=args.seed)
    spec_obj = REGISTRY.get(model_name)
    report.predictor.meta.update({
        "trained_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "data": str(args.data), "data_provenance": header, "num_examples": len(examples),
        "model": model_name, "model_gguf_sha256": spec_obj.gguf_sha256 if spec_obj else None,
        "folds": args.folds, "seed": args.seed, "script": "treeserve train-predictor",
    })
    if args.out is not None:
        report.predictor.save(args.out)
    if args.predictions_out is not None:
        write_predictions(args.predictions_out, examples, report)
    by_dataset = held_out_by_dataset(examples, report)
    result = {"spec": spec_name(spec), "num_examples": report.num_examples, "num_folds": report.num_folds,
              "held_out": report.held_out, "held_out_by_dataset": by_dataset,
              "saved_to": str(args.out) if args.out else None}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"held-out ({report.num_folds}-fold cross-validation over {report.num_examples} prompts)")
        print(f"{'features':<12} {'MAE tok':>8} {'bucket acc':>10} {'tau':>6} {'feat ms':>8}")
        for name, m in report.held_out.items():
            print(f"{name:<12} {m['mae_tokens']:>8.1f} {m['bucket_accuracy']:>10.3f} "
                  f"{m['kendall_tau']:>6.3f} {m['feature_ms']:>8.1f}")
        print("Kendall's tau within each dataset (out-of-fold):")
        for dataset, per_spec in by_dataset.items():
            print(f"  {dataset:<11} n={int(next(iter(per_spec.values()))['num']):<4} "
                  + " ".join(f"{n}={m['kendall_tau']:.3f}" for n, m in per_spec.items()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m treeserve.predictor`` == ``treeserve train-predictor``."""
    parser = argparse.ArgumentParser(prog="treeserve train-predictor",
                                     description="train the output-length predictor used by SSJF")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

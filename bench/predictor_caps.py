"""Train and score the output-length predictor on requests with varied ``max_tokens`` (issue 42).

A request can never write past its cap, so the job length a scheduler orders by is
``min(answer length, max_tokens)``, and the cap is a feature: a client that asks for 8 tokens
wants a label, one that asks for 1,024 a long answer. This bench gives every recorded prompt of
``bench/predictor_data.py``'s CSV the caps an API client would send for its kind
(``bench/data/api_caps.py``: 8-16 for one-word answers up to 1,024 for essays, code and chats),
trains heads on the hidden states after the served model's first blocks plus the cap
(:func:`~treeserve.ops.length_predictor.cap_features`), and scores them on the held-out split
(``treeserve.training.length_data.is_test_prompt``) against the shipped head, whose prediction
the scheduler clips to the cap:

* **chat**: the public held-out prompts at ``max_tokens`` 512, true length as recorded;
* **api**: every held-out prompt at its API cap, true length ``min(length, cap)``.

Labels at a cap of 1,024. The CSV's answers stop at 512 tokens; an answer that ran to 512 is taken
to run to 1,024 as well (the repetition loops in which most of them end do not stop):
``--check-1024 FILE`` measures how often that holds, from answers recorded at both caps.

Each training prompt enters once per cap its kind may have (so the head sees the same prompt
under different caps). Heads: ``listmle`` (listwise ranking, vllm-ltr's loss), ``ordinal`` and
``ridge``, each with the cap features. Usage::

    python bench/data/synthetic.py --num 2400 && python bench/data/fetch.py
    python bench/predictor_caps.py --data bench/data/predictor_lengths_512_q4_1.csv \\
        --out ops/data/predictor_smollm2-135m-instruct_caps.npz --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
from api_caps import KIND_CAPS, MAX_API_CAP, api_cap, kind_of  # noqa: E402

from treeserve.ops.length_predictor import FeatureSpec, Predictor, cap_features, evaluate, load_predictor  # noqa: E402
from treeserve.training.length_data import LengthExample, is_test_prompt, load_length_data  # noqa: E402
from treeserve.training.length_heads import fit_listmle_predictor, fit_ordinal_predictor  # noqa: E402
from treeserve.training.predictor import feature_matrix  # noqa: E402

RECORDED_CAP = 512
HEADS = ("listmle", "ordinal", "ridge")
CAP_EDGES = (16, 64, 128, 256, 512)
"""The ordinal head's buckets with caps: one more below 64, for the label and extraction calls."""


def capped_length(example: LengthExample, cap: int) -> int:
    """The job length at ``cap``: the recorded length below 512, and an answer that ran to 512
    running to any larger cap (see the module docstring)."""
    if cap <= RECORDED_CAP or not example.is_capped:
        return min(example.num_output_tokens, cap)
    return cap


def with_caps(x: np.ndarray, caps: Sequence[int]) -> np.ndarray:
    return np.concatenate([x, np.stack([cap_features(c) for c in caps])], axis=1)


def fit(head: str, x: np.ndarray, lengths: np.ndarray, seed: int) -> Predictor:
    spec = FeatureSpec("hidden", num_layers=12, with_cap=True)
    if head == "listmle":
        return fit_listmle_predictor(x, lengths, spec, MAX_API_CAP, seed=seed)
    if head == "ordinal":
        return fit_ordinal_predictor(x, lengths, spec, MAX_API_CAP, edges=CAP_EDGES, seed=seed)
    from treeserve.ops.length_predictor import fit_predictor

    return fit_predictor(x, lengths, spec, MAX_API_CAP, seed=seed)


def check_1024(path: Path) -> dict[str, float]:
    """From ``{"tokens": [...]}`` lines recorded at a cap of 1,024: how many answers that reached
    512 tokens ran on to 1,024."""
    lengths = [len(json.loads(line)["tokens"]) for line in path.read_text().split("\n") if line.strip()]
    reached = [n for n in lengths if n >= RECORDED_CAP]
    return {"num_answers": float(len(lengths)), "num_reached_512": float(len(reached)),
            "num_reached_1024": float(sum(n >= 1024 for n in reached))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from treeserve.models import DEFAULT_MODEL, load_model

    loaded = load_model(DEFAULT_MODEL)
    _, examples = load_length_data(args.data, args.prompts_dir, loaded.tokenizer)
    spec = FeatureSpec("hidden", num_layers=12)
    x, _ = feature_matrix(spec, examples, loaded.model, args.features_cache)
    test = [i for i, e in enumerate(examples) if is_test_prompt(e.dataset, e.id)]
    train = [i for i, e in enumerate(examples) if not is_test_prompt(e.dataset, e.id)]
    rows = [(i, cap) for i in train for cap in KIND_CAPS[kind_of(examples[i].dataset, examples[i].id)]]
    x_train = with_caps(x[[i for i, _ in rows]], [c for _, c in rows])
    y_train = np.array([capped_length(examples[i], c) for i, c in rows], dtype=np.float64)
    suites = {
        "chat": [(i, RECORDED_CAP) for i in test if examples[i].dataset != "synthetic"],
        "api": [(i, api_cap(examples[i].dataset, examples[i].id)) for i in test],
        "api_public": [(i, api_cap(examples[i].dataset, examples[i].id)) for i in test
                       if examples[i].dataset != "synthetic"],
    }
    shipped = load_predictor()
    out: dict[str, Any] = {"num_train_prompts": len(train), "num_train_rows": len(rows), "num_test_prompts": len(test),
                           "suites": {name: len(s) for name, s in suites.items()}, "heads": {}}

    def score(predict: Any) -> dict[str, dict[str, float]]:
        result = {}
        for name, suite in suites.items():
            truth = np.array([capped_length(examples[i], c) for i, c in suite], dtype=np.float64)
            caps = np.array([c for _, c in suite], dtype=np.float64)
            predicted = np.minimum(np.asarray(predict(suite), dtype=np.float64), caps)  # as the scheduler clips
            result[name] = evaluate(predicted, truth)
        return result

    out["heads"]["shipped (no cap feature)"] = score(lambda s: shipped.predict_features(x[[i for i, _ in s]]))
    out["heads"]["cap only (max_tokens)"] = score(lambda s: [float(c) for _, c in s])
    best: tuple[float, str, Predictor] | None = None
    for head in args.heads:
        started = time.perf_counter()
        predictor = fit(head, x_train, y_train, args.seed)
        seconds = time.perf_counter() - started
        scores = score(lambda s, p=predictor: p.predict_features(with_caps(x[[i for i, _ in s]], [c for _, c in s])))
        out["heads"][f"{head} + cap"] = {**scores, "fit_s": seconds}
        key = scores["chat"]["kendall_tau"] + scores["api"]["kendall_tau"]
        if best is None or key > best[0]:
            best = (key, head, predictor)
    if args.check_1024 is not None:
        out["check_1024"] = check_1024(args.check_1024)
    if best is not None and args.out is not None:
        _, head, predictor = best
        predictor.meta.update({"script": "bench/predictor_caps.py", "head": head, "caps": "bench/data/api_caps.py",
                               "num_train_rows": len(rows), "data": [str(p) for p in args.data],
                               "trained_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "model": DEFAULT_MODEL, "held_out": out["heads"][f"{head} + cap"]})
        predictor.save(args.out)
        out["saved"] = {"path": str(args.out), "head": head}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, nargs="+", default=[Path("bench/data/predictor_lengths_512_q4_1.csv")])
    parser.add_argument("--prompts-dir", type=Path, default=Path("bench/data"))
    parser.add_argument("--features-cache", type=Path, default=Path("bench/out/predictor_features"))
    parser.add_argument("--heads", nargs="+", default=list(HEADS), choices=HEADS)
    parser.add_argument("--check-1024", type=Path, default=None,
                        help="answers recorded at max_tokens 1024 (JSON lines with 'tokens')")
    parser.add_argument("--out", type=Path, default=None, help="save the best head here (.npz)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for name, scores in out["heads"].items():
            print(f"{name:28s} " + "  ".join(f"{suite} tau {m['kendall_tau']:.3f} mae {m['mae_tokens']:.0f}"
                                               for suite, m in scores.items() if isinstance(m, dict)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

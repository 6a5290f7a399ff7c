"""treeserve.training.predictor: tau-b vs a slow reference, ridge recovers known relations, save/load,
token/hidden features, online refinement, the CSV join; all synthetic and fast."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from treeserve.ops.model import Transformer
from treeserve.ops.model_config import ModelConfig
from treeserve.training.predictor import train_predictor
from treeserve.ops.length_predictor import FeatureSpec, OnlineHead, Predictor, PredictorError, bucket_of, evaluate, features, fit_predictor, kendall_tau, load_predictor, token_features
from treeserve.training.length_data import LengthExample, load_length_data


def slow_tau_b(x: list[float], y: list[float]) -> float:
    """Textbook tau-b over all pairs (the reference)."""
    concordant = discordant = tied_x_only = tied_y_only = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        dx, dy = x[i] - x[j], y[i] - y[j]
        if dx == 0 and dy == 0:
            continue
        if dx == 0:
            tied_x_only += 1
        elif dy == 0:
            tied_y_only += 1
        elif dx * dy > 0:
            concordant += 1
        else:
            discordant += 1
    denom = math.sqrt((concordant + discordant + tied_x_only) * (concordant + discordant + tied_y_only))
    return (concordant - discordant) / denom if denom else 0.0


def slow_tau_a(x: list[float], y: list[float]) -> float:
    """Tau-a (ignores ties in the denominator): a deliberately different statistic."""
    n = len(x)
    s = sum(np.sign(x[i] - x[j]) * np.sign(y[i] - y[j]) for i, j in itertools.combinations(range(n), 2))
    return float(s) / (n * (n - 1) / 2)


@pytest.mark.parametrize("seed", range(5))
def test_kendall_tau_matches_slow_reference_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 700))  # crosses the 512-row chunk boundary sometimes
    x = rng.integers(0, 6, n).astype(float).tolist()  # many ties
    y = (np.array(x) + rng.integers(-3, 4, n)).tolist()
    assert kendall_tau(x, y) == pytest.approx(slow_tau_b(x, y), abs=1e-12)
    # With this many ties tau-a differs, so a tau-a implementation would fail the line above.
    assert abs(slow_tau_a(x, y) - slow_tau_b(x, y)) > 1e-3


def test_kendall_tau_edge_cases() -> None:
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau([1, 1, 1], [1, 2, 3]) == 0.0
    with pytest.raises(PredictorError):
        kendall_tau([1, 2], [1, 2, 3])


def test_buckets_and_evaluate() -> None:
    assert bucket_of(np.array([0, 63, 64, 127, 128, 511, 512, 900])).tolist() == [0, 0, 1, 1, 2, 3, 4, 4]
    m = evaluate(np.array([10.0, 100.0, 300.0]), np.array([20.0, 100.0, 600.0]))
    assert m["mae_tokens"] == pytest.approx((10 + 0 + 300) / 3)
    assert m["bucket_accuracy"] == pytest.approx(2 / 3)
    assert m["kendall_tau"] == pytest.approx(1.0)


def test_ridge_recovers_a_known_relation() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 6)) * np.array([1, 2, 3, 0.5, 10, 1]) + 5
    true_w = np.array([0.3, -0.2, 0.1, 0.0, 0.05, 0.0])
    log_len = 4.0 + (x - 5) @ true_w + rng.normal(scale=0.02, size=600)
    lengths = np.expm1(log_len)
    pred = fit_predictor(x[:500], lengths[:500], FeatureSpec("prompt_len"), max_tokens=10_000)
    # Standardised weights map back to raw-space weights.
    assert np.allclose(pred.weights / pred.scale, true_w, atol=0.01)
    out = np.asarray(pred.predict_features(x[500:]))
    assert np.abs(np.log1p(out) - log_len[500:]).mean() < 0.05
    assert kendall_tau(out, lengths[500:]) > 0.9


def test_predictions_are_clipped_to_the_cap() -> None:
    x = np.arange(40, dtype=float)[:, None]
    pred = fit_predictor(x, np.expm1(0.2 * x[:, 0]), FeatureSpec("prompt_len"), max_tokens=512)
    assert pred.predict_features(np.array([200.0])) == 512.0
    assert pred.predict_features(np.array([-200.0])) == 1.0


def test_save_load_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(50, 9))
    lengths = np.expm1(3 + x[:, 0])
    pred = fit_predictor(x, lengths, FeatureSpec("tokens", num_buckets=8), max_tokens=512)
    pred.meta["note"] = "round trip"
    path = tmp_path / "p.npz"
    pred.save(path)
    back = load_predictor(path)
    assert back.spec == pred.spec and back.max_tokens == 512 and back.meta["note"] == "round trip"
    assert np.allclose(back.predict_features(x), pred.predict_features(x), rtol=1e-4)
    with np.load(path, allow_pickle=False) as data:  # no pickle needed to read it
        assert json.loads(str(data["meta"]))["spec"]["kind"] == "tokens"
    with pytest.raises(PredictorError):
        load_predictor(tmp_path / "missing.npz")


def _synthetic_examples(n: int, seed: int) -> list[LengthExample]:
    """Token 7 in a prompt means a long answer; prompt length is unrelated to output length."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(10, 400, int(rng.integers(5, 60))).tolist()
        is_long = bool(rng.random() < 0.5)
        if is_long:
            ids[int(rng.integers(0, len(ids)))] = 7
        length = int(rng.integers(300, 500) if is_long else rng.integers(5, 60))
        out.append(LengthExample("synthetic", str(i), tuple(ids), length, False))
    return out


def test_train_predictor_token_features_beat_prompt_length() -> None:
    examples = _synthetic_examples(400, 0)
    report = train_predictor(examples, FeatureSpec("tokens", num_buckets=256),
                             compare=[FeatureSpec("prompt_len")], num_folds=4)
    tokens, baseline = report.held_out["tokens@256"], report.held_out["prompt_len"]
    assert report.num_examples == 400 and report.held_out["prompt_len"]["num"] == 400
    # Out-of-fold: refitting on all data and predicting the training prompts would score higher.
    in_sample = report.predictor.predict_features(np.stack([token_features(e.prompt_ids, 256) for e in examples]))
    assert kendall_tau(in_sample, [e.num_output_tokens for e in examples]) > tokens["kendall_tau"]
    assert tokens["kendall_tau"] > 0.3 and tokens["kendall_tau"] > abs(baseline["kendall_tau"]) + 0.15
    assert tokens["bucket_accuracy"] > baseline["bucket_accuracy"]
    pred = report.predictor
    long_ids = list(examples[0].prompt_ids[:10]) + [7]
    assert pred.predict_from_prompt_ids(long_ids) > 4 * pred.predict_from_prompt_ids([11, 12, 13, 14, 15])


def test_token_features_are_hashed_presence_plus_length() -> None:
    f = token_features([5, 5, 9], 16)
    assert f.shape == (17,) and set(f[:16].tolist()) == {0.0, 1.0} and f[:16].sum() in (1.0, 2.0)
    assert f[16] == pytest.approx(math.log1p(3))
    assert np.array_equal(token_features([5, 5, 9], 16), f)


def _tiny_model() -> Transformer:
    config = ModelConfig(vocab_size=50, dim=16, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8,
                         ffn_dim=32, max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


def test_hidden_features_use_the_truncated_model() -> None:
    model = _tiny_model()
    spec = FeatureSpec("hidden", num_layers=2)
    f = features(spec, [1, 2, 3, 4], model.truncated(2))
    assert f.shape == (2 * 16 + 1,)
    # The last-token part equals the truncated model's own hidden state at the last position.
    _, hidden = model.truncated(2)(torch.tensor([[1, 2, 3, 4]]), model.truncated(2).new_cache(1, 4), return_hidden=True)
    assert np.allclose(f[16:32], hidden[0, -1].numpy(), atol=1e-6)
    assert not np.allclose(f, features(FeatureSpec("hidden", num_layers=3), [1, 2, 3, 4], model))
    with pytest.raises(PredictorError):
        features(spec, [1, 2, 3], model)  # a 3-layer model for a 2-layer spec
    with pytest.raises(PredictorError):
        features(spec, [1, 2, 3], None)


def test_hidden_predictor_trains_and_predicts_through_bind() -> None:
    model = _tiny_model()
    rng = np.random.default_rng(0)
    examples = []
    for i in range(60):
        ids = rng.integers(3, 50, int(rng.integers(3, 12))).tolist()
        examples.append(LengthExample("s", str(i), tuple(ids), 20 if ids[0] < 25 else 200, False))
    spec = FeatureSpec("hidden", num_layers=2)
    report = train_predictor(examples, spec, model=model, num_folds=3)
    pred = report.predictor.bind(model)
    value = pred.predict_from_prompt_ids([4, 5, 6])
    assert 1.0 <= value <= 512.0
    assert value == pytest.approx(report.predictor.predict_from_prompt_ids([4, 5, 6], model))


def test_online_head_adapts_to_a_shift_and_stays_bounded() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 4))
    pred = fit_predictor(x, np.expm1(3 + 0.5 * x[:, 0]), FeatureSpec("prompt_len"), max_tokens=10_000)
    shifted = lambda z: np.expm1(4 + 0.5 * z[:, 0] + 0.4 * z[:, 1])  # noqa: E731
    test = rng.normal(size=(200, 4))
    before = np.abs(np.log1p(pred.predict_features(test)) - np.log1p(shifted(test))).mean()
    head = OnlineHead(pred, buffer_size=64, refit_every=16, alpha=1.0)
    stream = rng.normal(size=(160, 4))
    for row, length in zip(stream, shifted(stream)):
        head.observe(row, int(round(length)))
    after = np.abs(np.log1p(pred.predict_features(test)) - np.log1p(shifted(test))).mean()
    assert after < 0.3 * before
    assert len(head._buffer) == 64 and head.num_observed == 160


def test_load_length_data_joins_by_id_and_checks_the_prompt(tmp_path: Path) -> None:
    class FakeTokenizer:
        def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
            return [ord(c) for c in messages[0]["content"]]

    (tmp_path / "setA.jsonl").write_text(json.dumps({"id": "a1", "prompt": "hi"}) + "\n", encoding="utf-8")
    sha = hashlib.sha256(b"hi").hexdigest()
    csv_path = tmp_path / "lengths.csv"
    csv_path.write_text(
        '# max_tokens: 512\n# script: "x"\n'
        "dataset,id,prompt_sha256,num_prompt_tokens,num_output_tokens,is_capped\n"
        f"setA,a1,{sha},2,512,1\n", encoding="utf-8")
    header, examples = load_length_data(csv_path, tmp_path, FakeTokenizer())
    assert header == {"max_tokens": 512, "script": "x"}
    assert examples == [LengthExample("setA", "a1", (104, 105), 512, True)]
    csv_path.write_text(csv_path.read_text().replace(sha, "0" * 64), encoding="utf-8")
    with pytest.raises(PredictorError, match="differs"):
        load_length_data(csv_path, tmp_path, FakeTokenizer())


def test_shipped_predictor_loads_with_provenance() -> None:
    pred = load_predictor()
    assert isinstance(pred, Predictor)
    assert pred.meta["model_gguf_sha256"] and pred.meta["data_provenance"]["script"] == "bench/predictor_data.py"
    assert pred.weights.size == pred.mean.size == pred.scale.size


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_prompt_hidden_equals_the_models_own_forward(num_tokens: int) -> None:
    from treeserve.ops.length_predictor import prompt_hidden

    model = _tiny_model().truncated(2)
    ids = list(range(3, 3 + num_tokens))
    _, hidden = model(torch.tensor([ids]), model.new_cache(1, num_tokens), return_hidden=True)
    assert np.allclose(prompt_hidden(model, ids), hidden[0].numpy(), atol=1e-5)


def test_one_pass_features_equal_each_truncated_models_own(tmp_path: Path) -> None:
    from treeserve.training.predictor import cache_hidden_features, feature_matrix, hidden_features_at

    model = _tiny_model()
    ids = [5, 9, 2, 33, 7]
    layers = [1, 2, model.config.num_layers]
    one_pass = hidden_features_at(model, ids, layers)
    for layer in layers:
        expected = features(FeatureSpec("hidden", num_layers=layer), ids, model.truncated(layer))
        assert np.allclose(one_pass[layer], expected, atol=1e-6), layer
    assert not np.allclose(one_pass[1], one_pass[2])  # each layer's own state, not one state reused
    examples = [LengthExample("s", str(i), tuple(ids[: i + 1]), 10 * i + 1, False) for i in range(4)]
    cache_hidden_features(layers, examples, model, tmp_path)
    for layer in layers:
        x, _ = feature_matrix(FeatureSpec("hidden", num_layers=layer), examples, None, tmp_path)  # read back, no model
        assert np.allclose(x[2], features(FeatureSpec("hidden", num_layers=layer), ids[:3], model.truncated(layer)),
                           atol=1e-6)


def test_predictor_data_batched_greedy_equals_one_prompt_at_a_time() -> None:
    """bench/predictor_data.py's continuous batching (rows refilled as answers end) gives each
    prompt the answer plain greedy decoding gives it alone, and its length and cap flag."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "bench" / "predictor_data.py"
    spec = importlib.util.spec_from_file_location("treeserve_bench_predictor_data", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    model = _tiny_model()
    prompts = [[1, 5, 9], [2, 7], [3, 3, 3, 4, 8], [6], [9, 1, 4, 4]]

    states: dict[tuple[int, ...], list[torch.Tensor]] = {}  # the hidden state that wrote each token, alone

    def alone(ids: list[int], stop: set[int], max_tokens: int) -> list[int]:
        cache = model.new_cache(1, len(ids) + max_tokens + 1)
        out: list[int] = []
        tokens = list(ids)
        states[tuple(ids)] = []
        while len(out) < max_tokens:
            with torch.inference_mode():
                logits, hidden = model(torch.tensor([tokens]), cache, return_hidden=True)
            cache.commit(0, list(range(len(tokens))))
            out.append(int(logits[0, -1].argmax()))
            states[tuple(ids)].append(hidden[0, -1])
            tokens = [out[-1]]
            if out[-1] in stop:
                break
        return out

    first = [alone(p, set(), 8) for p in prompts]
    stop = {first[1][2]}  # one answer ends early on a "stop id", the others may too
    expected = [alone(p, stop, 8) for p in prompts]
    jobs = [module.Job("s", str(i), "", p, []) for i, p in enumerate(prompts)]
    done: list[object] = []
    assert module.generate_batched(model, jobs, stop, 8, 2, 1e9, done.append) == len(prompts)
    assert [j.output for j in jobs] == expected and len(done) == len(prompts)
    assert [j.is_capped for j in jobs] == [len(e) == 8 and e[-1] not in stop for e in expected]
    # With state_every, each multiple of 3 tokens keeps the state of the forward that wrote its last token.
    jobs = [module.Job("s", str(i), "", p, []) for i, p in enumerate(prompts)]
    module.generate_batched(model, jobs, stop, 8, 2, 1e9, lambda _: None, state_every=3)
    for job in jobs:
        assert [w for w, _ in job.states] == list(range(3, len(job.output) + 1, 3))
        for written, state in job.states:
            torch.testing.assert_close(state, states[tuple(job.prompt_ids)][written - 1], atol=1e-5, rtol=1e-5)


def test_batched_prompt_features_equal_one_prompt_at_a_time() -> None:
    """The predictor actor's ``predict_batch`` path: right-padded causal prefills of several
    prompts give each prompt's own features (up to float rounding), in the prompts' order."""
    from treeserve.ops.length_predictor import features_batch, padded_batches, prompt_hidden, prompt_hidden_batch

    model = _tiny_model().truncated(2)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 50, int(n)).tolist() for n in (5, 1, 12, 11, 6, 5, 30)]
    for prompt, hidden in zip(prompts, prompt_hidden_batch(model, prompts)):
        assert hidden.shape == (len(prompt), 16)
        assert np.allclose(hidden, prompt_hidden(model, prompt), atol=1e-5)
    spec = FeatureSpec("hidden", num_layers=2)
    batched = features_batch(spec, prompts, model)
    assert batched.shape == (len(prompts), 2 * 16 + 1)
    assert np.allclose(batched, np.stack([features(spec, p, model) for p in prompts]), atol=1e-5)
    groups = padded_batches([len(p) for p in prompts])
    assert sorted(i for g in groups for i in g) == list(range(len(prompts)))
    assert [2, 7] not in groups and any(len(g) > 1 for g in groups)  # 12 and 11 share; 30 pads nothing
    with pytest.raises(PredictorError):
        features_batch(FeatureSpec("hidden", num_layers=3), prompts, model)  # a 2-layer model
    assert np.array_equal(features_batch(FeatureSpec("prompt_len"), [[1], [1, 2]]), [[math.log1p(1)], [math.log1p(2)]])

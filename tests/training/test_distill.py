"""Distillation (treeserve.training.distill): teacher data, boost weights, training, resume."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

import treeserve.training.distill as distill
import treeserve.training.teacher as teacher_module
from tests.ops.conftest import make_tiny_model
from treeserve.training.distill import BoostConfig, boost_weights, build_training_set, draft_vocabulary, predict_top1, run_distillation, top1_agreement, train_ssm
from treeserve.training.teacher import TeacherSequence, generate_teacher_data, teacher_generate_batch
from treeserve.ops.model import Transformer
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental, generate_speculative
from treeserve.ops.ssm import init_ssm_from_verifier, load_distilled_speculators, load_ssms, ssm_config_for

STOP = frozenset({2})


def tiny_teacher(seed: int = 0) -> Transformer:
    return make_tiny_model(seed, weight_scale=0.3).requires_grad_(False)


def random_prompts(num: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 101, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(num)]


def test_teacher_batch_is_greedy_decoding_with_top_k_per_position() -> None:
    teacher = tiny_teacher()
    prompts = random_prompts(5)
    records = teacher_generate_batch(teacher, prompts, max_new_tokens=10, stop_ids=STOP, top_k=4)
    for prompt, record in zip(prompts, records):
        reference = generate_incremental(teacher, prompt, SamplingParams(max_new_tokens=10, stop_token_ids=(2,)))
        assert record.token_ids.tolist() == prompt + reference.token_ids
        assert record.prompt_len == len(prompt)
        assert record.top_ids.shape == (len(record.token_ids) - 1, 4)
        # The teacher's top-1 after each prefix is the next token of its greedy continuation.
        assert record.top_ids[len(prompt) - 1 :, 0].tolist() == reference.token_ids
        assert bool((record.top_probs[:, :-1] >= record.top_probs[:, 1:]).all())
        with torch.no_grad():
            full = torch.softmax(teacher(record.token_ids[None], teacher.new_cache(1, len(record.token_ids))), -1)[0]
        torch.testing.assert_close(record.top_probs.float(), full[:-1].gather(-1, record.top_ids.long()),
                                   atol=2e-3, rtol=2e-3)


def test_teacher_data_resumes_from_its_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    teacher = tiny_teacher()
    prompts = random_prompts(7)
    calls: list[int] = []
    real = teacher_module.teacher_generate_batch

    def counting(*args: object, **kwargs: object) -> list[TeacherSequence]:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(teacher_module, "teacher_generate_batch", counting)

    def interrupt_after_first(stage: str, done: int, total: int) -> None:
        if done == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_teacher_data(teacher, prompts, tmp_path, batch_size=3, max_new_tokens=5, stop_ids=STOP,
                              progress=interrupt_after_first)
    assert len(calls) == 1
    data = generate_teacher_data(teacher, prompts, tmp_path, batch_size=3, max_new_tokens=5, stop_ids=STOP)
    assert len(calls) == 3  # only the two missing batches ran
    fresh = real(teacher, prompts[:3], max_new_tokens=5, stop_ids=STOP)
    assert [d.token_ids.tolist() for d in data[:3]] == [f.token_ids.tolist() for f in fresh]
    assert len(data) == 7


def test_draft_vocabulary_takes_the_most_frequent_top1_and_forced_ids() -> None:
    top = torch.tensor([[5, 3], [5, 3], [5, 1], [9, 3], [9, 1], [7, 3], [11, 3]], dtype=torch.int32)
    seq = TeacherSequence(torch.zeros(8, dtype=torch.long), 1, top, torch.ones(7, 2, dtype=torch.float16))
    assert draft_vocabulary([seq], 2).tolist() == [5, 9]
    assert draft_vocabulary([seq], 3, always=[2]).tolist() == [2, 5, 9]
    # Beyond the top-1 tokens: lower-rank tokens (3 before 1), then the lowest ids.
    assert draft_vocabulary([seq], 5).tolist() == [3, 5, 7, 9, 11]
    assert draft_vocabulary([seq], 6).tolist() == [1, 3, 5, 7, 9, 11]
    assert draft_vocabulary([seq], 8).tolist() == [0, 1, 2, 3, 5, 7, 9, 11]
    with pytest.raises(ValueError):
        draft_vocabulary([seq], 13)


BoostFn = Callable[[Tensor, list[Tensor], Tensor], Tensor]


def boost_check(fn: BoostFn) -> bool:
    """True iff ``fn`` gives missed positions more weight than positions an earlier SSM got right."""
    base = torch.ones(2, 5)
    teacher = torch.tensor([[1, 2, 3, 4, -1], [5, 6, 7, 8, 9]])
    earlier = [torch.tensor([[1, 0, 3, 0, 0], [0, 6, 0, 0, 0]]), torch.tensor([[0, 0, 0, 4, 0], [0, 0, 0, 0, 0]])]
    weights = fn(base, earlier, teacher)
    hit = torch.tensor([[1, 0, 1, 1, 0], [0, 1, 0, 0, 0]], dtype=torch.bool)
    return bool(weights[~hit].min() > weights[hit].max())


def test_boost_weights_upweight_the_positions_earlier_ssms_miss() -> None:
    assert boost_check(lambda b, p, t: boost_weights(b, p, t, matched_weight=0.1))
    weights = boost_weights(torch.full((1, 3), 0.5), [torch.tensor([[4, 0, 0]])], torch.tensor([[4, 5, 6]]),
                            matched_weight=0.2)
    torch.testing.assert_close(weights, torch.tensor([[0.1, 0.5, 0.5]]))


def test_uniform_weights_fail_the_boost_check() -> None:
    assert not boost_check(lambda b, p, t: b.clone())
    assert not boost_check(lambda b, p, t: boost_weights(b, p, t, matched_weight=1.0))


def _tiny_data(teacher: Transformer, num: int = 24) -> list[TeacherSequence]:
    return teacher_generate_batch(teacher, random_prompts(num, seed=1), max_new_tokens=16, stop_ids=frozenset(), top_k=4)


def test_training_raises_agreement_with_the_teacher() -> None:
    torch.manual_seed(0)
    teacher = tiny_teacher()
    data = _tiny_data(teacher)
    ids = draft_vocabulary(data, 40)
    train = build_training_set(data, ids, prompt_weight=0.25)
    ssm = init_ssm_from_verifier(teacher, ssm_config_for(teacher, num_layers=1, ffn_dim=48, draft_vocab_size=40), ids)
    before = top1_agreement([predict_top1(ssm, train)], train)
    train_ssm(ssm, train, train.base_weights, num_epochs=8, lr=1e-2, tokens_per_batch=128)
    after = top1_agreement([predict_top1(ssm, train)], train)
    assert after > before + 0.1, (before, after)
    assert not any(p.requires_grad for p in ssm.parameters())


def _run(teacher: Transformer, tmp_path: Path, work: str, progress: teacher_module.DistillProgress | None = None) -> Path:
    out = tmp_path / work / "ssm.safetensors"
    config = BoostConfig(num_ssms=2, ffn_dim=48, draft_vocab_size=40, num_epochs=2, num_boost_epochs=1, lr=1e-2,
                         boost_lr=5e-3, tokens_per_batch=128)
    kwargs = {} if progress is None else {"progress": progress}
    run_distillation(teacher, random_prompts(20, seed=2), stop_ids=STOP, work_dir=tmp_path / work, out_path=out,
                     config=config, batch_size=5, max_new_tokens=12, num_heldout=4, **kwargs)
    return out


def test_interrupted_distillation_resumes_to_the_same_weights(tmp_path: Path) -> None:
    teacher = tiny_teacher()
    reference = load_ssms(teacher, _run(teacher, tmp_path, "straight"))
    seen: list[str] = []

    def interrupt_in_second_epoch(stage: str, done: int, total: int) -> None:
        seen.append(stage)
        if stage == "train ssm1" and done == total // 2 + 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(teacher, tmp_path, "resumed", interrupt_in_second_epoch)
    assert (tmp_path / "resumed" / "train" / "ssm0_epoch.pt").exists()
    stages: list[str] = []
    path = _run(teacher, tmp_path, "resumed", lambda stage, done, total: stages.append(stage))
    assert "teacher" in stages and stages.count("train ssm1") < seen.count("train ssm1") + 1
    resumed = load_ssms(teacher, path)
    assert len(resumed) == len(reference) == 2
    for a, b in zip(reference, resumed):
        for (name, x), (_, y) in zip(sorted(a.stored_state_dict().items()), sorted(b.stored_state_dict().items())):
            torch.testing.assert_close(x, y, msg=name)
    # The boost-tuned second SSM differs from the first, and the file serves losslessly.
    assert not torch.equal(reference[0].layers[0].mlp.up_proj.weight, reference[1].layers[0].mlp.up_proj.weight)
    speculators = load_distilled_speculators(teacher, path, expansion=(2, 1, 1))
    params = SamplingParams(max_new_tokens=24)
    prompt = [4, 8, 15, 16]
    assert (generate_speculative(teacher, speculators, prompt, params).token_ids
            == generate_incremental(teacher, prompt, params).token_ids)


def test_changed_settings_are_refused_in_a_used_work_dir(tmp_path: Path) -> None:
    teacher = tiny_teacher()
    _run(teacher, tmp_path, "w")
    with pytest.raises(ValueError, match="other settings"):
        run_distillation(teacher, random_prompts(20, seed=2), stop_ids=STOP, work_dir=tmp_path / "w",
                         out_path=tmp_path / "x.safetensors", config=BoostConfig(num_ssms=3, draft_vocab_size=40),
                         batch_size=5, max_new_tokens=12, num_heldout=4)


def _load_tiny_model_files() -> object:
    import importlib.util
    import sys

    if "tiny_model_files" in sys.modules:
        return sys.modules["tiny_model_files"]
    path = Path(__file__).parents[1] / "actors" / "tiny_model_files.py"
    spec = importlib.util.spec_from_file_location("tiny_model_files", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tiny_model_files"] = module
    spec.loader.exec_module(module)
    return module


def _tiny_chat_model_and_prompts(tmp_path: Path, num_prompts: int) -> tuple[Path, Path]:
    """A tiny HF model folder with a chat template, and a JSONL file of random prompts."""
    import json

    folder = _load_tiny_model_files().write_tiny_hf_model(tmp_path / "tiny")  # type: ignore[attr-defined]
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}w5"
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    gen = torch.Generator().manual_seed(0)
    lines = [json.dumps({"prompt": " ".join(f"w{int(t)}" for t in torch.randint(6, 97, (5,), generator=gen))})
             for _ in range(num_prompts)]
    prompts = tmp_path / "train_prompts.jsonl"
    prompts.write_text("\n".join(lines))
    return folder, prompts


def test_cli_distill_writes_weights_and_resumes_after_an_interruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from treeserve import cli

    folder, prompts = _tiny_chat_model_and_prompts(tmp_path, 14)
    out = tmp_path / "ssm.safetensors"
    argv = ["distill", "--model", str(folder), "--prompts", str(prompts), "--work-dir", str(tmp_path / "work"),
            "--out", str(out), "--max-prompts", "14", "--batch-size", "4", "--max-new-tokens", "8",
            "--draft-vocab", "30", "--ffn-dim", "32", "--epochs", "2", "--boost-epochs", "1",
            "--heldout", "4", "--tokens-per-batch", "64"]
    real = distill.train_ssm

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(distill, "train_ssm", interrupted)
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 130 and not out.exists()
    shards = sorted((tmp_path / "work" / "teacher").glob("shard_*.pt"))
    assert len(shards) == 4
    stamps = [s.stat().st_mtime_ns for s in shards]
    monkeypatch.setattr(distill, "train_ssm", real)
    with pytest.raises(SystemExit) as finished:
        cli.main(argv)
    assert finished.value.code == 0 and out.exists()
    assert [s.stat().st_mtime_ns for s in shards] == stamps  # the teacher data was reused, not redone
    from treeserve.models import load_model

    model = load_model(folder).model
    assert len(load_distilled_speculators(model, out)) == 2
    with pytest.raises(SystemExit) as refused:
        cli.main([*argv[:-1], "128"])  # other settings in the same work dir
    assert refused.value.code == 2


def test_cli_distill_features_continues_the_teacher_answers_and_fine_tunes(tmp_path: Path) -> None:
    import json

    from safetensors import safe_open

    from treeserve import cli
    from treeserve.models import load_model
    from treeserve.ops.feature_drafter import load_feature_drafter

    folder, prompts = _tiny_chat_model_and_prompts(tmp_path, 10)
    work = tmp_path / "work"
    common = ["--model", str(folder), "--prompts", str(prompts), "--work-dir", str(work), "--max-prompts", "10",
              "--batch-size", "4"]
    # `distill` leaves its teacher answers (6 tokens each) in the work dir.
    with pytest.raises(SystemExit) as done:
        cli.main(["distill", *common, "--max-new-tokens", "6", "--draft-vocab", "30", "--ffn-dim", "32",
                  "--epochs", "1", "--boost-epochs", "1", "--num-ssms", "1", "--heldout", "2",
                  "--tokens-per-batch", "64", "--out", str(tmp_path / "ssm.safetensors")])
    assert done.value.code == 0
    teacher = [r for s in sorted((work / "teacher").glob("shard_*.pt")) for r in torch.load(s)["records"]]
    first = tmp_path / "fd.safetensors"
    features = ["distill-features", *common, "--max-new-tokens", "12", "--draft-vocab", "30", "--heldout", "2"]
    with pytest.raises(SystemExit) as done:
        cli.main([*features, "--epochs", "2", "--out", str(first)])
    assert done.value.code == 0 and first.exists()
    parts = sorted((work / "states_12" / "states").glob("part_*.pt"))
    states = [r for _, r in sorted((i, r) for s in parts for i, r in torch.load(s)["records"])]
    assert len(states) == len(teacher) == 10
    for answer, record in zip(teacher, states):
        # The teacher's 6-token answer is continued (to 12 tokens, or to a stop token).
        assert record["token_ids"][: len(answer["token_ids"])].tolist() == answer["token_ids"].tolist()
        assert record["prompt_len"] == answer["prompt_len"]
    model = load_model(folder).model
    tuned = tmp_path / "tuned.safetensors"
    with pytest.raises(SystemExit) as done:
        cli.main([*features, "--epochs", "1", "--init", str(first), "--out", str(tuned)])
    assert done.value.code == 0
    with safe_open(str(tuned), framework="pt") as handle:
        meta = json.loads(handle.metadata()["metadata"])
    assert meta["init"]["path"] == str(first) and len(meta["init"]["metadata"]["heldout_generated_top1"]) == 2
    before, after = load_feature_drafter(model, first), load_feature_drafter(model, tuned)
    assert torch.equal(before.draft_ids, after.draft_ids)  # the vocabulary is kept
    assert not torch.equal(before.fc.weight, after.fc.weight)  # and the weights trained on


def test_self_written_prompts_are_distinct_ended_turns_and_skip_the_excluded(tmp_path: Path) -> None:
    """The model writes user turns from its template's user prefix: each kept question is new
    (a near-greedy writer repeats itself: one question survives de-duplication, and none once
    it is excluded), only turns that ended are kept, the seed decides the draws, and the CLI
    writes them as a prompt set."""
    import json

    from treeserve import cli
    from treeserve.models import load_model
    from treeserve.training.teacher import self_written_prompts, user_turn_prefix

    folder, _ = _tiny_chat_model_and_prompts(tmp_path, 2)
    loaded = load_model(str(folder))
    model, tokenizer = loaded.model, loaded.tokenizer
    assert tokenizer.decode(user_turn_prefix(tokenizer)) == "w3"

    def write(**kwargs: object) -> list[str]:
        options: dict[str, object] = dict(temperature=0.9, max_tokens=20, batch_size=8, seed=0, min_chars=4, max_rounds=3)
        options.update(kwargs)
        return self_written_prompts(model, tokenizer, 6, **options)  # type: ignore[arg-type]

    varied = write()
    assert varied and len({" ".join(q.lower().split()) for q in varied}) == len(varied)
    assert write() == varied and write(seed=1) != varied
    # A turn cut at max_tokens is dropped: with room for one token no turn ends in a word.
    assert write(max_tokens=1, min_chars=1) == []
    repeated = write(temperature=0.05)
    assert len(repeated) == 1
    assert write(temperature=0.05, exclude=[repeated[0].upper()]) == []
    out = tmp_path / "questions.jsonl"
    with pytest.raises(SystemExit) as done:
        cli.main(["synth-prompts", "--model", str(folder), "--format", "float32", "--out", str(out), "--num", "3",
                  "--max-tokens", "20", "--batch-size", "8", "--threads", "1"])
    assert done.value.code == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == [f"selfwritten/{i}" for i in range(len(lines))] and 1 <= len(lines) <= 3

"""Training the feature drafter (treeserve.training.feature_distill): the second unrolled draft step
sees exactly what a depth-2 draft sees when serving, prompt positions are weighted as asked,
held-out agreement can count generated positions only, and training lowers the loss."""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_ops_feature_drafter import single_thread, tiny_drafter, tiny_verifier  # noqa: F401 - autouse fixture
from treeserve.training.feature_distill import (
    StateSequence,
    TrainConfig,
    training_batch,
    collect_states,
    evaluate_top1,
    feature_loss,
    train_feature_drafter,
    unrolled_features,
)


def sequences(verifier, num: int, length: int, prompt_len: int, seed: int = 0) -> list[StateSequence]:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, verifier.config.vocab_size, (length,), generator=gen) for _ in range(num)]
    return collect_states(verifier, tokens, prompt_lens=[prompt_len] * num)


def test_second_step_matches_a_depth_two_draft_at_serving_time() -> None:
    verifier = tiny_verifier()
    drafter = tiny_drafter(verifier)
    data = sequences(verifier, 1, 12, 0)
    states, tokens, _, _ = training_batch(data, [(0, 0)], 11)
    with torch.no_grad():
        first, second = unrolled_features(drafter, states, tokens, steps=2)
        for j in range(1, tokens.shape[1]):
            # Serving: the true pairs before j are committed; the depth-2 node feeds the
            # drafter's own prediction of f_j with the token x_{j+1}, at position j.
            cache = drafter.new_cache(1, 32)
            prefix = drafter.features(states[:, :j], tokens[:, :j], cache)
            cache.commit(0, range(j))
            assert torch.allclose(prefix[0, -1], first[0, j - 1], atol=1e-5)
            node = drafter.features(prefix[:, -1:], tokens[:, j: j + 1], cache)
            assert torch.allclose(node[0, 0], second[0, j], atol=1e-5), j


def test_prompt_positions_get_the_prompt_weight() -> None:
    verifier = tiny_verifier()
    data = sequences(verifier, 2, 10, 4)
    _, _, _, weights = training_batch(data, [(0, 0), (1, 0)], 9, prompt_weight=0.25)
    # Pair t holds token x_{t+1}; drafting starts at the prompt's last token (index 3).
    assert weights[0].tolist() == [0.25, 0.25, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    _, _, _, late = training_batch(data, [(0, 4)], 5, prompt_weight=0.25)
    assert late.tolist() == [[1.0] * 5]


@pytest.mark.parametrize("step", [1, 2])
def test_generated_only_agreement_counts_the_generated_positions(step: int) -> None:
    verifier = tiny_verifier()
    drafter = tiny_drafter(verifier)
    data = sequences(verifier, 2, 16, 8)
    with torch.no_grad():
        states, tokens, _, _ = training_batch(data, [(0, 0), (1, 0)], 15)
        predicted = unrolled_features(drafter, states, tokens, steps=step)[-1]
        right = drafter.draft_ids[drafter.head(predicted).argmax(-1)] == torch.stack([d.top1[1:] for d in data])
    first = max(8 - 2, 1 if step == 2 else 0)  # pair t holds x_{t+1}; drafting starts at x_7
    expected_generated = right[:, first:].float().mean().item()
    expected_all = right[:, 1 if step == 2 else 0:].float().mean().item()
    assert evaluate_top1(drafter, data, length=15, generated_only=True, step=step) == pytest.approx(expected_generated)
    assert evaluate_top1(drafter, data, length=15, step=step) == pytest.approx(expected_all)


def test_training_lowers_both_steps_losses() -> None:
    verifier = tiny_verifier()
    drafter = tiny_drafter(verifier)
    data = sequences(verifier, 6, 24, 6, seed=3)
    batch = training_batch(data, [(i, 0) for i in range(6)], 23, prompt_weight=0.2)
    with torch.no_grad():
        before = feature_loss(drafter, *batch, steps=2)[0].item()
    history = train_feature_drafter(drafter, data, TrainConfig(epochs=6, lr=3e-3, batch_size=3, length=23),
                                    held_out=data[:2])
    with torch.no_grad():
        after = feature_loss(drafter, *batch, steps=2)[0].item()
    assert len(history) == 6
    assert after < 0.8 * before, (before, after)


def test_train_config_rejects_bad_unrolling() -> None:
    with pytest.raises(ValueError):
        TrainConfig(steps=3)
    with pytest.raises(ValueError):
        TrainConfig(prompt_weight=1.5)


def test_state_data_is_the_greedy_answer_with_its_states_and_resumes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Five prompts over two rows (rows freed by a stop token or the token cap take the next
    start at once): each record is the prompt's own incremental greedy answer, with the states
    and top-1 a separate pass computes; a rerun loads the saved parts instead of generating."""
    from treeserve.training.feature_distill import generate_state_data
    from treeserve.ops.sampling import SamplingParams
    from treeserve.ops.speculative import generate_incremental

    verifier = tiny_verifier()
    prompts = [[3, 9, 27, 81], [5, 6, 7, 8, 9, 10], [11, 2], [40, 41, 42], [7]]
    free = [generate_incremental(verifier, p, SamplingParams(max_new_tokens=12)).token_ids for p in prompts]
    stop = free[1][5]  # the second answer stops early; others may too
    calls = []
    data = generate_state_data(verifier, [(p, len(p)) for p in prompts], tmp_path / "a", max_new_tokens=12,
                               stop_ids=frozenset({stop}), batch_size=2, save_every=2,
                               progress=lambda *a: calls.append(a))
    assert [c[1] for c in calls] == [1, 2, 3, 4, 5] and all(c[2] == 5 for c in calls)
    lengths = set()
    for prompt, record in zip(prompts, data):
        answer = generate_incremental(verifier, prompt, SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)))
        # The last token's state is never computed, so it is cut off.
        assert record.token_ids.tolist() == prompt + answer.token_ids[:-1]
        assert record.prompt_len == len(prompt)
        reference = collect_states(verifier, [record.token_ids])[0]
        assert torch.allclose(record.states.float(), reference.states.float(), atol=2e-3)
        assert torch.equal(record.top1, reference.top1)
        lengths.add(len(answer.token_ids))
    assert len(lengths) > 1  # rows finished at different steps
    # Continuing the first answer's first 5 tokens ends in the same sequence.
    partial = prompts[0] + data[0].token_ids[4:9].tolist()
    again = generate_state_data(verifier, [(partial, 4)], tmp_path / "b", max_new_tokens=12, stop_ids=frozenset({stop}))
    assert again[0].token_ids.tolist() == data[0].token_ids.tolist()
    # A rerun loads the parts instead of generating.
    parts = sorted((tmp_path / "a" / "states").glob("part_*.pt"))
    stamps = [p.stat().st_mtime_ns for p in parts]
    rerun = generate_state_data(verifier, [(p, len(p)) for p in prompts], tmp_path / "a", max_new_tokens=12,
                                stop_ids=frozenset({stop}), batch_size=2)
    assert [d.token_ids.tolist() for d in rerun] == [d.token_ids.tolist() for d in data]
    assert [p.stat().st_mtime_ns for p in sorted((tmp_path / "a" / "states").glob("part_*.pt"))] == stamps
    # A lost part is generated again, and only it.
    parts[0].unlink()
    calls.clear()
    rerun = generate_state_data(verifier, [(p, len(p)) for p in prompts], tmp_path / "a", max_new_tokens=12,
                                stop_ids=frozenset({stop}), batch_size=2, progress=lambda *a: calls.append(a))
    assert [d.token_ids.tolist() for d in rerun] == [d.token_ids.tolist() for d in data]
    assert [c[1] for c in calls] == [4, 5]
    # A rerun over a larger prompt set in another order generates only the new prompt's answer.
    more = [[13, 14, 15]] + prompts[::-1]
    calls.clear()
    rerun = generate_state_data(verifier, [(p, len(p)) for p in more], tmp_path / "a", max_new_tokens=12,
                                stop_ids=frozenset({stop}), batch_size=2, progress=lambda *a: calls.append(a))
    assert [d.token_ids.tolist() for d in rerun[1:]] == [d.token_ids.tolist() for d in data[::-1]]
    assert rerun[0].token_ids.tolist()[:3] == more[0] and [c[1:3] for c in calls] == [(6, 6)]

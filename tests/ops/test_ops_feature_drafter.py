"""The feature-level drafter (treeserve.ops.feature_drafter): the LLM's states reach it in order,
greedy generation with it is lossless, its drafts stay in the draft vocabulary, weights round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from tests.ops.conftest import TINY, make_tiny_model
from treeserve.ops.feature_drafter import init_feature_drafter, load_feature_drafter, save_feature_drafter
from treeserve.ops.feature_speculator import FeatureSpeculator
from treeserve.ops.kernels import q8_amx
from treeserve.ops.model import Transformer
from treeserve.ops.model_config import ModelConfig
from treeserve.ops.ngram import NGramSpeculator
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental, generate_speculative
from treeserve.ops.ssm import ssm_config_for
from treeserve.ops.tree_attention import tree_mask_from_parents



@pytest.fixture(autouse=True)
def single_thread() -> object:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_verifier(seed: int = 0) -> Transformer:
    return make_tiny_model(seed, weight_scale=0.3)


def tiny_drafter(verifier: Transformer, draft_vocab: int = 60, seed: int = 1):  # type: ignore[no-untyped-def]
    ids = torch.randperm(verifier.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    config = ssm_config_for(verifier, num_layers=1, ffn_dim=verifier.config.ffn_dim, draft_vocab_size=draft_vocab)
    return init_feature_drafter(verifier, config, ids.sort().values)


class RecordingSpeculator(FeatureSpeculator):
    """Keeps every state it is given, to compare with a causal pass over the final sequence."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.received: list[Tensor] = []

    def add_features(self, states: Tensor) -> None:
        self.received.append(states.clone())
        super().add_features(states)


def causal_states(model: Transformer, tokens: list[int]) -> Tensor:
    with torch.no_grad():
        _, hidden = model(torch.tensor([tokens]), model.new_cache(1, len(tokens)), return_hidden=True)
    return hidden[0]


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=30), SamplingParams(temperature=0.8, seed=3, max_new_tokens=30)],
                         ids=["greedy", "t0.8"])
def test_the_llm_states_arrive_in_token_order(params: SamplingParams) -> None:
    verifier = tiny_verifier()
    speculator = RecordingSpeculator(tiny_drafter(verifier), (2, 2, 1))
    prompt = [3, 9, 27, 81, 42]
    out = generate_speculative(verifier, [speculator], prompt, params)
    received = torch.cat(speculator.received)
    sequence = prompt + out.token_ids
    # Every token but the last few (the final step's states are not delivered) has its state.
    expected = causal_states(verifier, sequence)[: received.shape[0]]
    assert received.shape[0] >= len(prompt) - 1 + len(out.token_ids) - 8
    torch.testing.assert_close(received, expected, atol=1e-4, rtol=1e-4)


def test_greedy_generation_with_the_feature_drafter_is_lossless() -> None:
    verifier = tiny_verifier()
    speculators = [FeatureSpeculator(tiny_drafter(verifier), (3, 2, 1, 1)),
                   NGramSpeculator(TINY["vocab_size"], num_draft_tokens=3)]
    params = SamplingParams(max_new_tokens=40)
    for prompt in ([1, 2, 3], [7, 7, 8, 50, 3, 2, 9], [5]):
        reference = generate_incremental(verifier, prompt, params)
        assert generate_speculative(verifier, speculators, prompt, params).token_ids == reference.token_ids
        assert generate_speculative(verifier, speculators[:1], prompt, params).token_ids == reference.token_ids


def test_drafts_stay_in_the_draft_vocabulary_and_limits_apply_before_drafting() -> None:
    verifier = tiny_verifier()
    drafter = tiny_drafter(verifier, draft_vocab=10)
    allowed = set(drafter.draft_ids.tolist())
    speculator = FeatureSpeculator(drafter, (3, 2, 2, 1))
    prompt = [4, 8, 15, 16, 23]
    speculator.prefill(prompt)
    speculator.add_features(causal_states(verifier, prompt[:-1]))
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=1)):
        tree = speculator.propose(params, torch.Generator().manual_seed(0))
        # Greedy: distinct top tokens; sampled: equal draws share one node (each its own proposal).
        assert tree.num_nodes == 1 + 3 + 2 + 2 + 1 if params.is_greedy else 4 <= tree.num_nodes <= 9
        assert set(tree.tokens[1:].tolist()) <= allowed
    assert speculator.propose(SamplingParams(), None, max_nodes=6).num_nodes == 1 + 3 + 2
    assert speculator.propose(SamplingParams(), None, max_depth=1).num_nodes == 1 + 3
    # Without the state before the root there is nothing to draft from.
    speculator.prefill([7])
    assert speculator.propose(SamplingParams(), None).num_nodes == 1


def _primed(verifier: Transformer, drafter, prompt: list[int], **kwargs) -> FeatureSpeculator:  # type: ignore[no-untyped-def]
    speculator = FeatureSpeculator(drafter, **kwargs)
    speculator.prefill(prompt)
    speculator.add_features(causal_states(verifier, prompt[:-1]))
    return speculator


def test_dynamic_tree_keeps_the_likeliest_paths() -> None:
    verifier = tiny_verifier()
    drafter = tiny_drafter(verifier)
    prompt = [4, 8, 15, 16, 23]
    greedy = SamplingParams()

    def shape(tree):  # type: ignore[no-untyped-def]
        return tree.parents.tolist(), tree.tokens.tolist()

    # One child per node: the dynamic tree is the drafter's greedy chain.
    chain = _primed(verifier, drafter, prompt, widths=(1, 1, 1)).propose(greedy, None)
    assert shape(_primed(verifier, drafter, prompt, dynamic=(3, 1, 4)).propose(greedy, None)) == shape(chain)
    # One level: the top-k children of the root, as the spine's first level.
    level = _primed(verifier, drafter, prompt, widths=(3,)).propose(greedy, None)
    assert shape(_primed(verifier, drafter, prompt, dynamic=(1, 3, 4)).propose(greedy, None)) == shape(level)
    # Bigger: within its budget and depth, and the likeliest nodes first, so a smaller budget
    # keeps a subset of a larger one's paths.
    speculator = _primed(verifier, drafter, prompt, dynamic=(4, 3, 9))
    tree = speculator.propose(greedy, None)
    assert tree.num_nodes == 9 and int(tree.depths().max()) <= 4

    def paths(t):  # type: ignore[no-untyped-def]
        tokens = t.tokens.tolist()
        return {tuple(tokens[i] for i in t.path_to(node)[1:]) for node in range(1, t.num_nodes)}

    sizes = [paths(speculator.propose(greedy, None, max_nodes=n)) for n in range(2, 10)]
    assert all(len(a) == n - 1 and a < b for n, (a, b) in enumerate(zip(sizes, sizes[1:]), start=2))
    assert any(len(p) > 1 for p in sizes[-1]) and len({p[0] for p in sizes[-1]}) > 1  # a tree, not a chain
    assert speculator.propose(greedy, None, max_nodes=5).num_nodes == 5
    assert int(speculator.propose(greedy, None, max_depth=2).depths().max()) <= 2
    # Sampling keeps the spine (i.i.d. draws at each spine node), whatever `dynamic` says.
    sampled = speculator.propose(SamplingParams(temperature=1.0, seed=1), torch.Generator().manual_seed(0))
    assert sampled.num_nodes <= 1 + sum(speculator.widths)


def test_greedy_generation_with_a_dynamic_tree_is_lossless() -> None:
    verifier = tiny_verifier()
    speculators = [FeatureSpeculator(tiny_drafter(verifier), dynamic=(4, 3, 10)),
                   NGramSpeculator(TINY["vocab_size"], num_draft_tokens=3)]
    params = SamplingParams(max_new_tokens=40)
    for prompt in ([1, 2, 3], [7, 7, 8, 50, 3, 2, 9], [5]):
        reference = generate_incremental(verifier, prompt, params)
        assert generate_speculative(verifier, speculators, prompt, params).token_ids == reference.token_ids


def test_save_load_round_trip(tmp_path: Path) -> None:
    verifier = tiny_verifier()
    drafter = tiny_drafter(verifier)
    with torch.no_grad():
        drafter.fc.bias.normal_()
    path = tmp_path / "fd.safetensors"
    save_feature_drafter(drafter, path, metadata={"note": "test"})
    loaded = load_feature_drafter(verifier, path)
    assert torch.equal(loaded.draft_ids, drafter.draft_ids)
    torch.testing.assert_close(loaded.fc.bias, drafter.fc.bias.half().float())
    with pytest.raises(FileNotFoundError):
        load_feature_drafter(verifier, tmp_path / "missing.safetensors")
    other = Transformer(ModelConfig(**{**TINY, "dim": 32, "head_dim": 4, "num_heads": 8}))
    with pytest.raises(ValueError, match="width"):
        load_feature_drafter(other, path)


FORMAT_DIMS = dict(dim=64, ffn_dim=128, num_heads=8, num_kv_heads=2, head_dim=16, vocab_size=256)


@pytest.mark.skipif(not q8_amx.available(), reason="the Q8_0 kernel needs AVX2 or AMX")
def test_a_formatted_drafter_drafts_what_the_bf16_one_does(tmp_path: Path) -> None:
    """format_drafter (the int formats' drafter: Q8_0 linears and head, the verifier's fused
    attention) computes what the bf16 drafter computes, within Q8_0 and bf16 rounding, over a
    chain of true pairs and then a token tree on the same cache; a q4_1 verifier loads its
    drafter formatted."""
    import copy

    from treeserve.ops.feature_drafter import format_drafter
    from treeserve.ops.formats import apply_format

    verifier = make_tiny_model(0, weight_scale=0.3, **FORMAT_DIMS)
    drafter = tiny_drafter(verifier, draft_vocab=64)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if not name.startswith("embed_tokens"):
                param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    plain = drafter.to(torch.bfloat16)
    fast = format_drafter(copy.deepcopy(plain))
    assert fast.head_kernel is not None and not hasattr(fast.layers[0].self_attn, "q_proj")
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(1, 20, 64, generator=gen).bfloat16()
    tokens = torch.randint(0, 256, (1, 20), generator=gen)
    tree_mask = tree_mask_from_parents(torch.tensor([-1, 0, 0, 1, 1, 2]))[None]
    positions = torch.tensor([[20, 21, 21, 22, 22, 22]])
    outs = []
    for model in (plain, fast):
        cache = model.new_cache(1, 64)
        with torch.no_grad():
            chain = model.features(states, tokens, cache)
            cache.commit(0, range(20))
            tree = model.features(states[:, :6], tokens[:, :6], cache, tree_mask=tree_mask, positions=positions)
            outs.append((chain.float(), tree.float(), model.head(tree[0]).float()))
    # Q8_0 rounds each linear's weights and rows by about 0.5%; this random block's large
    # activations grow that to about 5% of the mean (an unfused or misordered projection:
    # above 50%).
    for ours, theirs in zip(outs[1], outs[0]):
        assert (ours - theirs).abs().mean() <= 0.1 * theirs.abs().mean(), (ours - theirs).abs().mean()
    assert (outs[1][2].argmax(-1) == outs[0][2].argmax(-1)).float().mean() >= 4 / 6
    path = tmp_path / "fd.safetensors"
    save_feature_drafter(tiny_drafter(make_tiny_model(0, weight_scale=0.3, **FORMAT_DIMS), draft_vocab=64), path)
    assert load_feature_drafter(make_tiny_model(0, weight_scale=0.3, **FORMAT_DIMS), path).head_kernel is None
    q4 = apply_format(make_tiny_model(0, weight_scale=0.3, **FORMAT_DIMS), "q4_1")
    assert load_feature_drafter(q4, path).head_kernel is not None


def test_the_compiled_draft_step_computes_what_the_eager_one_does(tmp_path: Path) -> None:
    """compile_draft_step: the formatted drafter's block compiled ahead of time and saved, over
    a chain of pairs and then a token tree, equals its eager step within inductor's float32
    intermediates, and each tree node's state is its path's run as a chain; a second drafter of other weights loads the same file and computes its own
    states (the weights are arguments, not baked in); a catch-up longer than the step's 64
    tokens runs eagerly."""
    import copy

    from treeserve.ops.feature_drafter import compile_draft_step, format_drafter

    verifier = make_tiny_model(0, weight_scale=0.3, **FORMAT_DIMS)

    def pair(seed: int):  # type: ignore[no-untyped-def]
        """Two formatted copies of one drafter: one to compile, one to stay eager."""
        drafter = tiny_drafter(verifier, draft_vocab=64)
        with torch.no_grad():
            for name, param in drafter.named_parameters():
                if not name.startswith("embed_tokens"):
                    param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(seed + len(name))))
        drafter = drafter.to(torch.bfloat16)
        return format_drafter(copy.deepcopy(drafter)), format_drafter(drafter)

    gen = torch.Generator().manual_seed(3)
    states = torch.randn(1, 80, 64, generator=gen).bfloat16()
    tokens = torch.randint(0, 256, (1, 80), generator=gen)
    tree_mask = tree_mask_from_parents(torch.tensor([-1, 0, 0, 1, 1, 2]))[None]

    def run(drafter, length: int) -> tuple[Tensor, Tensor]:  # type: ignore[no-untyped-def]
        cache = drafter.new_cache(1, 96)
        with torch.no_grad():
            chain = drafter.features(states[:, :length], tokens[:, :length], cache)
            cache.commit(0, range(length))
            positions = torch.tensor([[length, length + 1, length + 1, length + 2, length + 2, length + 2]])
            tree = drafter.features(states[:, :6], tokens[:, :6], cache, tree_mask=tree_mask, positions=positions)
        return chain.float(), tree.float()

    first, eager = pair(1)
    compile_draft_step(first, tmp_path)
    assert first.draft_step is not None and first.draft_step.is_compiled
    assert first.draft_step.compile_seconds is not None and first.draft_step.artifact is not None
    def spread(t: Tensor) -> Tensor:
        return t.amax(-1, keepdim=True) - t.amin(-1, keepdim=True)

    # bf16 activations: inductor keeps fused intermediates in float32 where eager rounds them
    # (as in test_decode_step); a wrong slot, mask or weight differs by the spread itself.
    for length in (20, 70):  # 70: the chain runs eagerly, the tree compiled
        for ours, theirs in zip(run(first, length), run(eager, length)):
            assert ((ours - theirs).abs() / spread(theirs)).max() <= 0.05
    # Each tree node's state is its path's, run as a chain after the same pairs.
    tree = run(first, 20)[1][0]
    parents = [-1, 0, 0, 1, 1, 2]
    for node in range(6):
        path = [node]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        cache = first.new_cache(1, 96)
        with torch.no_grad():
            first.features(states[:, :20], tokens[:, :20], cache)
            cache.commit(0, range(20))
            chain = first.features(states[:, path], tokens[:, path], cache)[0, -1].float()
        assert ((chain - tree[node]).abs() / spread(chain)).max() <= 0.05, node
    second, second_eager = pair(7)
    compile_draft_step(second, tmp_path)
    assert second.draft_step is not None and second.draft_step.load_seconds is not None
    ours, theirs, other = run(second, 20)[1], run(second_eager, 20)[1], run(eager, 20)[1]
    assert ((ours - theirs).abs() / spread(theirs)).max() <= 0.05
    assert ((ours - other).abs() / spread(other)).max() > 0.2  # not the first drafter's states

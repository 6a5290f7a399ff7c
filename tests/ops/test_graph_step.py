"""Captured steps (``treeserve.ops.graph_step``): padded to their buckets, replayed on static
buffers, they score every row as the eager forward does, write each row's keys and values
where the eager forward writes them, and leave every other row's slots below capacity alone.
On the CPU the :class:`Replay` twin runs; the attention is each path a GPU could take (the
CUDA tree kernel emulated by its g++ shim, SDPA under a mask over the whole cache) and the
CPU's own kernel; the CUDA graphs themselves are checked where CUDA is (marked ``gpu``)."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

from treeserve.ops import batch_step, graph_step
from treeserve.ops.batch_step import RowStep, row_block, verify_rows
from treeserve.ops.formats import apply_format
from treeserve.ops.graph_step import HEADROOM, GraphStep, attach_graphs, bucket_of
from treeserve.ops.kernels import tree_attention_cpu, tree_attention_cuda
from treeserve.ops.kv_cache import KVCache
from treeserve.ops.model import Transformer
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.token_tree import TokenTree

from .conftest import make_tiny_model
from .test_decode_step import _clone, _trees

DIMS = dict(dim=64, ffn_dim=128, num_heads=8, num_kv_heads=2, head_dim=8)
CAPACITY = 48


@pytest.fixture(scope="module")
def shim_kernel(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The CUDA tree kernel's source on the CPU (g++ shim), as ``tree_attention_cuda`` is called."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to emulate the kernel")
    from treeserve_testing import tree_attention_shim

    try:
        library = tree_attention_shim.build(tmp_path_factory.mktemp("kernel"))
    except RuntimeError as exc:
        pytest.skip(f"the kernel shim does not build here: {exc}")

    def on_cpu(q: Any, k: Any, v: Any, lengths: Any, bits: Any, *, max_prefix_length: int | None = None,
               num_splits: int | None = None) -> Any:
        return tree_attention_cuda.run_tree_attention(q, k, v, lengths, bits, launch=tree_attention_shim.launcher(library),
                                                      num_sms=16, max_prefix_length=max_prefix_length, num_splits=num_splits)

    return on_cpu


@pytest.fixture(params=["cuda_kernel", "sdpa", "cpu_kernel"])
def attention(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """GraphStep options for one attention path, with what that path needs patched in."""
    if request.param == "cuda_kernel":
        monkeypatch.setattr(tree_attention_cuda, "tree_attention_cuda", request.getfixturevalue("shim_kernel"))
        return {"use_kernel": True, "use_cuda_graphs": False}
    if request.param == "cpu_kernel" and not tree_attention_cpu.available():
        pytest.skip("needs AVX-512 and a C++ compiler")
    if request.param == "sdpa":
        monkeypatch.setattr(tree_attention_cpu, "available", lambda: False)
        monkeypatch.setattr(tree_attention_cpu, "loaded", lambda: False)
    return {"use_kernel": False, "use_cuda_graphs": False}


def _model(seed: int = 3) -> Transformer:
    return apply_format(make_tiny_model(seed, **DIMS), "float32")


def _filled_cache(model: Transformer, lengths: list[int]) -> KVCache:
    """A cache with headroom whose rows hold different numbers of committed random tokens."""
    gen = torch.Generator().manual_seed(1)
    cache = model.new_cache(len(lengths), CAPACITY, headroom=HEADROOM)
    tokens = torch.randint(0, model.config.vocab_size, (len(lengths), max(lengths)), generator=gen)
    model.hidden_states(tokens.to(cache.device), cache)
    for row, length in enumerate(lengths):
        cache.commit(row, range(length))
    return cache


def test_a_count_pads_up_to_the_next_bucket() -> None:
    assert [bucket_of(n, (1, 4, 8)) for n in (1, 2, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]


def test_a_captured_step_needs_a_cache_with_headroom() -> None:
    model = _model()
    with pytest.raises(ValueError, match="headroom"):
        GraphStep(model, model.new_cache(2, CAPACITY))


# (rows in the cache, the block [start, stop) that steps, new tokens a row, tree or chain)
CASES = [(3, (0, 3), 1, "chain"), (5, (1, 3), 5, "tree"), (6, (2, 6), 16, "tree"), (2, (0, 2), 3, "chain"),
         (4, (3, 4), 1, "chain")]


@pytest.mark.parametrize(("num_rows", "block", "num_new", "kind"), CASES)
def test_a_replayed_step_scores_and_writes_as_the_eager_forward(attention: dict[str, Any], num_rows: int,
                                                                block: tuple[int, int], num_new: int, kind: str) -> None:
    """Rows padded to a row bucket (before and after the block), nodes padded to a node
    bucket: the block's hidden states and its rows' new slots equal the eager forward's on a
    twin cache, and every slot below capacity of the rows outside the block is untouched (a
    pad row that wrote into committed or pending slots would change them)."""
    model = _model()
    lengths = [4 + 7 * row % 23 for row in range(num_rows)]
    cache = _filled_cache(model, lengths)
    twin = _clone(cache)
    step = GraphStep(model, cache, row_buckets=(1, 2, 4), node_buckets=(1, 4, 8, 16), **attention)
    step.capture()
    before = [t.clone() for t in cache.keys + cache.values]
    start, stop = block
    tokens, mask, positions = _trees(lengths[start:stop], num_new, seed=num_new)
    tree_mask, tree_positions = (mask, positions) if kind == "tree" else (None, None)
    hidden = step(tokens, row_block(cache, start, stop), tree_mask, tree_positions)
    assert step.replays == 1 and step.eager_calls == 0
    reference = model.hidden_states(tokens, row_block(twin, start, stop), tree_mask=tree_mask, positions=tree_positions)
    torch.testing.assert_close(hidden, reference, rtol=2e-5, atol=2e-5)
    for mine, theirs, old in zip(cache.keys + cache.values, twin.keys + twin.values, before):
        for row in range(num_rows):
            if start <= row < stop:  # committed slots and the new ones
                end = lengths[row] + num_new
                torch.testing.assert_close(mine[row, :, :end], theirs[row, :, :end], rtol=2e-5, atol=2e-5)
            else:
                assert torch.equal(mine[row, :, :CAPACITY], old[row, :, :CAPACITY]), f"row {row} outside the block changed"


def test_padding_rows_would_corrupt_committed_slots_if_written_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above catches a pad row that writes where it attends from (slot 0)."""
    model = _model()
    cache = _filled_cache(model, [5, 9, 12])
    before = [t.clone() for t in cache.keys]

    def wrong(self: GraphStep, bucket: graph_step.Bucket) -> None:
        right(self, bucket)
        bucket.write_at.zero_()

    right = GraphStep._reset_padding
    monkeypatch.setattr(GraphStep, "_reset_padding", wrong)
    step = GraphStep(model, cache, row_buckets=(4,), node_buckets=(1,), use_kernel=False, use_cuda_graphs=False)
    step.capture()
    step(torch.tensor([[1], [2]]), row_block(cache, 0, 2))
    assert not torch.equal(cache.keys[0][2, :, :CAPACITY], before[0][2, :, :CAPACITY])


def test_a_foreign_cache_or_too_many_nodes_runs_eagerly() -> None:
    model = _model()
    cache = _filled_cache(model, [5, 6])
    step = GraphStep(model, cache, row_buckets=(2,), node_buckets=(1, 4), use_kernel=False, use_cuda_graphs=False)
    step.capture()
    other = _filled_cache(model, [5, 6])
    twin = _clone(other)
    hidden = step(torch.tensor([[3], [4]]), other)
    torch.testing.assert_close(hidden, model.hidden_states(torch.tensor([[3], [4]]), twin), rtol=1e-5, atol=1e-5)
    step(torch.zeros(2, 6, dtype=torch.long), cache)  # 6 nodes: above the largest bucket
    assert step.eager_calls == 2 and step.replays == 0


def _verify_all(model: Transformer, cache: KVCache, steps: list[RowStep]) -> list[tuple[list[int], int]]:
    return [(r.accepted, r.bonus_token) for r in verify_rows(model, cache, steps)]


def _verify_on_device(monkeypatch: pytest.MonkeyPatch, model: Transformer, cache: KVCache,
                      steps: list[RowStep]) -> list[tuple[list[int], int]]:
    """:func:`_verify_all` with the greedy rows decided as on a GPU (one read a block)."""
    with monkeypatch.context() as patch:
        patch.setattr(batch_step, "decides_on_device", lambda logits: True)
        return _verify_all(model, cache, steps)


def test_verify_rows_through_attached_graphs_equals_eager_serving(attention: dict[str, Any],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The verifier's batched step, attached: rows far apart in length are verified in two
    row blocks (two forwards, committed after both), so the second block's pad rows must not
    touch the first block's pending slots. Accepted paths, bonus tokens and the committed
    caches equal the model's without graphs (its greedy rows decided row by row on the host;
    the graphed run's on the device, as on a GPU), over several steps."""
    model = _model(5)
    lengths = [3, 4, 20, CAPACITY - 2, 5]  # idle row 3 has no room for a tree: two row blocks
    cache = _filled_cache(model, lengths)
    twin = _clone(cache)
    gen = torch.Generator().manual_seed(7)
    graphed = _model(5)
    attach_graphs(graphed, cache, row_buckets=(1, 2, 4), node_buckets=(1, 4, 8), **attention)
    for step_index in range(3):
        steps = []
        for row in (0, 1, 2, 4):
            num_nodes = 1 + int(torch.randint(0, 7, (1,), generator=gen))
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]
            tokens = torch.randint(0, 20, (num_nodes,), generator=gen).tolist()  # small vocab: some drafts match
            steps.append(RowStep(row, TokenTree.from_parents(parents, tokens), SamplingParams()))
        assert _verify_on_device(monkeypatch, graphed, cache, steps) == _verify_all(model, twin, steps), \
            f"step {step_index}"
        assert cache.lengths.tolist() == twin.lengths.tolist()
    for mine, theirs in zip(cache.keys, twin.keys):
        for row, length in enumerate(cache.lengths.tolist()):
            torch.testing.assert_close(mine[row, :, :length], theirs[row, :, :length], rtol=2e-5, atol=2e-5)
    assert isinstance(graphed.decode_step, GraphStep) and graphed.decode_step.replays >= 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_replay_what_the_twin_computes() -> None:
    """On a GPU: the captured CUDA graphs give the twin's hidden states, step after step, and
    the eager forward's (the tree kernel where cupy is, else SDPA)."""
    model = apply_format(make_tiny_model(3, **DIMS).to("cuda"), "float32")
    lengths = [5, 17, 9]
    cache, twin, eager = (_filled_cache(model, lengths) for _ in range(3))
    graphs = GraphStep(model, cache, use_cuda_graphs=True)
    graphs.capture()
    replays = GraphStep(model, twin, use_cuda_graphs=False)
    replays.capture()
    tokens, mask, positions = _trees(lengths, 7, seed=2)
    tokens, mask, positions = tokens.cuda(), mask.cuda(), positions.cuda()
    for _ in range(2):
        torch.testing.assert_close(graphs(tokens, cache, mask, positions), replays(tokens, twin, mask, positions),
                                   rtol=1e-5, atol=1e-5)
    reference = model.hidden_states(tokens, eager, tree_mask=mask, positions=positions)
    torch.testing.assert_close(graphs(tokens, cache, mask, positions), reference, rtol=1e-4, atol=1e-4)
    assert graphs.replays == 3


def test_generation_in_the_captured_cache_equals_plain_generation(attention: dict[str, Any]) -> None:
    """Incremental and tree-speculative greedy generation run in the cache the graphs were
    captured over (every step replayed, the prompt included) emit the tokens of plain
    generation without graphs; a model whose text repeats gives the n-gram drafter hits."""
    from treeserve.ops.ngram import NGramSpeculator
    from treeserve.ops.speculative import generate_incremental, generate_speculative

    model = _model(11)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    params = SamplingParams(max_new_tokens=24)
    reference = generate_incremental(model, prompt, params).token_ids
    graphed = _model(11)
    cache = graphed.new_cache(1, 40 + 64, headroom=HEADROOM)
    step = attach_graphs(graphed, cache, row_buckets=(1,), node_buckets=(1, 4, 8, 16), **attention)
    assert generate_incremental(graphed, prompt, params, cache=cache).token_ids == reference
    assert step.eager_calls == 0 and step.replays == len(reference)
    speculative = generate_speculative(graphed, [NGramSpeculator(model.config.vocab_size, num_branches=2)], prompt,
                                       params, cache=cache, max_tree_nodes=16)
    assert speculative.token_ids == reference and step.eager_calls == 0
    with pytest.raises(ValueError, match="1-row cache"):
        generate_incremental(graphed, prompt, params, cache=graphed.new_cache(2, 64))


@pytest.mark.parametrize("dynamic", [None, (4, 3, 10)], ids=["spine", "dynamic"])
def test_a_feature_drafter_drafts_the_same_trees_from_its_captured_caches(attention: dict[str, Any],
                                                                          dynamic: tuple[int, int, int] | None) -> None:
    """A drafter with captured caches (what a speculator actor on a GPU runs) drafts the
    trees it drafts eagerly: the same accepted drafts step by step, every draft forward
    replayed; the cache a request leased goes back when its speculator is dropped."""
    import gc

    from treeserve.ops.feature_drafter import init_feature_drafter
    from treeserve.ops.feature_speculator import FeatureSpeculator
    from treeserve.ops.graph_step import attach_draft_graphs
    from treeserve.ops.speculative import generate_speculative
    from treeserve.ops.ssm import ssm_config_for

    verifier = make_tiny_model(0, weight_scale=0.3)

    def drafter() -> Any:
        ids = torch.randperm(verifier.config.vocab_size, generator=torch.Generator().manual_seed(1))[:60]
        config = ssm_config_for(verifier, num_layers=1, ffn_dim=verifier.config.ffn_dim, draft_vocab_size=60)
        return init_feature_drafter(verifier, config, ids.sort().values)

    params = SamplingParams(max_new_tokens=30)
    prompt = [3, 9, 27, 81, 42, 3, 9]
    eager = generate_speculative(verifier, [FeatureSpeculator(drafter(), (3, 2, 1), dynamic=dynamic)], prompt, params)
    captured = drafter()
    graphs = attach_draft_graphs(captured, 64, slots=1, node_buckets=(1, 4, 8, 16), **attention)
    speculator = FeatureSpeculator(captured, (3, 2, 1), dynamic=dynamic)
    replayed = generate_speculative(verifier, [speculator], prompt, params)
    assert replayed.token_ids == eager.token_ids and replayed.accepted_per_step == eager.accepted_per_step
    assert sum(eager.accepted_per_step) > 0, "the drafter must win some drafts for the comparison to mean anything"
    (step,) = graphs.steps.values()
    assert step.replays > 0 and step.eager_calls == 0 and graphs.free == []
    second = FeatureSpeculator(captured, (3, 2, 1), dynamic=dynamic)
    generate_speculative(verifier, [second], prompt, params)  # no free cache: drafts eagerly, the same way
    del speculator, second
    gc.collect()
    assert graphs.free == [step.cache]


@pytest.mark.parametrize("num_new", [1, 8])
def test_the_kernel_planned_for_the_whole_cache_reads_each_rows_own_length(shim_kernel: Any, monkeypatch: pytest.MonkeyPatch,
                                                                           num_new: int) -> None:
    """The captured kernel's launch covers the whole storage in several key splits, so rows
    much shorter than the cache leave splits empty (they must add nothing), and a long row
    fills them: the replayed step equals the eager forward for rows of 5, 200 and 20 tokens."""
    from treeserve.ops.kernels.tree_attention_cuda import plan_launch

    monkeypatch.setattr(tree_attention_cuda, "tree_attention_cuda", shim_kernel)
    model = _model()
    lengths = [5, 200, 20]
    gen = torch.Generator().manual_seed(1)
    cache = model.new_cache(3, 250, headroom=HEADROOM)
    model.hidden_states(torch.randint(0, model.config.vocab_size, (3, 200), generator=gen), cache)
    for row, length in enumerate(lengths):
        cache.commit(row, range(length))
    twin = _clone(cache)
    config = model.config
    plan = plan_launch(4, config.num_heads, config.num_kv_heads, num_new, 250 + HEADROOM, num_sms=16)
    assert plan.num_splits > 1, "the case must split the keys to mean anything"
    step = GraphStep(model, cache, row_buckets=(4,), node_buckets=(1, 8), use_kernel=True, use_cuda_graphs=False)
    step.capture()
    tokens, mask, positions = _trees(lengths, num_new, seed=5)
    hidden = step(tokens, cache, mask, positions)
    torch.testing.assert_close(hidden, model.hidden_states(tokens, twin, tree_mask=mask, positions=positions),
                               rtol=2e-5, atol=2e-5)


def test_serving_captures_only_where_the_tree_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernel_fits: a CUDA model with cupy and plain attention; not the CPU, not without cupy,
    not sliding windows or another attention scale (Gemma 3), where the captured attention
    would be SDPA over the whole cache."""
    from types import SimpleNamespace

    from treeserve.ops.graph_step import kernel_fits

    def model(device: str, **config: Any) -> Any:
        return SimpleNamespace(device=torch.device(device),
                               config=SimpleNamespace(**{"windowed": False, "attn_scale": None, **config}))

    assert not kernel_fits(_model())
    monkeypatch.setattr(graph_step, "is_cuda_kernel_available", lambda: True)
    assert kernel_fits(model("cuda")) and not kernel_fits(model("cpu"))
    assert not kernel_fits(model("cuda", windowed=True)) and not kernel_fits(model("cuda", attn_scale=0.1))
    monkeypatch.setattr(graph_step, "is_cuda_kernel_available", lambda: False)
    assert not kernel_fits(model("cuda"))

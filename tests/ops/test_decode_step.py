"""The static-shape decode step (``treeserve.ops.decode_step``): it computes what the model's
forward computes for one token per row and for token trees, eagerly and compiled, and a saved
step loads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from treeserve.ops.decode_step import DecodeStep, artifact_name, step_hidden
from treeserve.ops.formats import apply_format
from treeserve.ops.kernels import tree_attention_cpu
from treeserve.ops.kv_cache import KVCache
from treeserve.ops.model import Transformer
from treeserve.ops.tree_attention import tree_mask_from_parents

from .conftest import make_tiny_model

FORMAT_DIMS = dict(dim=64, ffn_dim=128, num_heads=8, num_kv_heads=2, head_dim=8)
BOTH_ATTENTIONS = pytest.mark.parametrize("attention", ["kernel", "torch"], indirect=True)


@pytest.fixture
def attention(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The step's attention: the CPU tree-mask kernel (skipped where this CPU has none), or
    torch's fused attention under a dense mask (the path of every other machine)."""
    if request.param == "kernel" and not tree_attention_cpu.available():
        pytest.skip("needs AVX-512 and a C++ compiler")
    if request.param == "torch":
        monkeypatch.setattr(tree_attention_cpu, "available", lambda: False)
        monkeypatch.setattr(tree_attention_cpu, "loaded", lambda: False)  # what fits() reads
    return str(request.param)


def _ragged_cache(model: Transformer, lengths: list[int], capacity: int = 40) -> KVCache:
    """A cache whose rows hold different numbers of committed random tokens."""
    gen = torch.Generator().manual_seed(1)
    cache = model.new_cache(len(lengths), capacity)
    longest = max(lengths)
    model.hidden_states(torch.randint(0, model.config.vocab_size, (len(lengths), longest), generator=gen), cache)
    for row, length in enumerate(lengths):
        cache.commit(row, range(length))
    return cache


def _clone(cache: KVCache) -> KVCache:
    twin = KVCache(num_layers=cache.num_layers, batch_size=cache.batch_size, num_kv_heads=cache.keys[0].shape[1],
                   head_dim=cache.keys[0].shape[3], capacity=cache.capacity, dtype=cache.dtype, headroom=cache.headroom)
    for mine, theirs in zip(twin.keys + twin.values, cache.keys + cache.values):
        mine.copy_(theirs)
    twin.lengths.copy_(cache.lengths)
    return twin


def _forward_reference(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own tree forward of a one-node tree per row (what the verifier runs)."""
    ones = torch.ones(tokens.shape[0], 1, 1, dtype=torch.bool)
    logits, hidden = model(tokens[:, None], cache, tree_mask=ones, positions=cache.lengths[:, None].clone(),
                           return_hidden=True)
    return logits[:, 0], hidden[:, 0]


def _step_logits(step: DecodeStep, tokens: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row through ``step``: (logits (B, V), hidden (B, D))."""
    hidden = step(tokens[:, None], cache)[:, 0]
    return step.model.logits(hidden), hidden


@BOTH_ATTENTIONS
def test_eager_decode_step_equals_the_forward_in_float32(attention: str) -> None:
    """Rows at different lengths: same logits, same K/V written at each row's own slot."""
    model = apply_format(make_tiny_model(2, **FORMAT_DIMS), "float32")
    cache = _ragged_cache(model, [5, 17, 9])
    twin = _clone(cache)
    tokens = torch.tensor([3, 50, 7])
    logits, hidden = _step_logits(DecodeStep(model), tokens, cache)
    ref_logits, ref_hidden = _forward_reference(model, tokens, twin)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
    assert cache.num_pending == [1, 1, 1]
    for mine, theirs in zip(cache.keys + cache.values, twin.keys + twin.values):
        for row, length in enumerate([5, 17, 9]):
            torch.testing.assert_close(mine[row, :, : length + 1], theirs[row, :, : length + 1], rtol=1e-5, atol=1e-5)


@BOTH_ATTENTIONS
def test_decode_step_never_sees_a_rows_stale_slots(attention: str) -> None:
    """Garbage beyond a row's length (another request's leftovers) must not change its logits."""
    model = apply_format(make_tiny_model(4, **FORMAT_DIMS), "float32")
    cache = _ragged_cache(model, [4, 12])
    clean = _clone(cache)
    for keys in cache.keys:
        keys[0, :, 5:] = 1e3  # row 0 attends to slots 0..4 only (4 committed + the new token)
    tokens = torch.tensor([9, 9])
    dirty_logits = _step_logits(DecodeStep(model), tokens, cache)[0]
    clean_logits = _step_logits(DecodeStep(model), tokens, clean)[0]
    torch.testing.assert_close(dirty_logits, clean_logits, rtol=1e-6, atol=1e-6)


def _trees(lengths: list[int], num_nodes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random token trees per row: (tokens (B, T), tree_mask (B, T, T), positions (B, T))."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.stack([
        torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, num_nodes)])
        for _ in lengths
    ])
    mask = tree_mask_from_parents(parents)
    positions = torch.tensor(lengths)[:, None] + mask.sum(-1) - 1  # committed length + depth
    return torch.randint(0, 100, (len(lengths), num_nodes), generator=gen), mask, positions


STEP_CASES = (([3], 1), ([5, 30, 11], 1), ([2, 2, 2, 2], 1), ([3], 5), ([5, 30, 11], 16))
"""(committed lengths of the rows, new tokens a row): one token per row, ragged rows, trees."""


def _against_eager(step: DecodeStep, lengths: list[int], num_nodes: int) -> tuple[float, KVCache, KVCache]:
    """One call of ``step`` and of the eager step on twin ragged caches with random trees: the
    largest logit gap relative to the eager logits' spread, and the two caches."""
    model = step.model
    cache = _ragged_cache(model, lengths, capacity=48)
    twin = _clone(cache)
    tokens, mask, positions = _trees(lengths, num_nodes, seed=num_nodes)
    logits = model.logits(step(tokens, cache, mask, positions))
    eager = model.logits(DecodeStep(model)(tokens, twin, mask, positions))
    spread = (eager.amax(-1) - eager.amin(-1))[..., None]
    return ((logits - eager).abs() / spread).max().item(), cache, twin


@BOTH_ATTENTIONS
def test_eager_step_of_a_tree_equals_the_general_forward_in_float32(attention: str) -> None:
    """Ragged rows, each with its own random tree: the step's mask, positions and K/V slots
    are the general forward's (a wrong ancestor, depth or slot changes the logits)."""
    model = apply_format(make_tiny_model(3, **FORMAT_DIMS), "float32")
    lengths = [5, 17, 9]
    cache = _ragged_cache(model, lengths)
    twin = _clone(cache)
    tokens, mask, positions = _trees(lengths, 7, seed=3)
    hidden = DecodeStep(model)(tokens, cache, mask, positions)
    assert model.decode_step is None  # the reference below is the eager general forward
    ref_hidden = model.hidden_states(tokens, twin, tree_mask=mask, positions=positions)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
    assert cache.num_pending == [7, 7, 7]
    for mine, theirs in zip(cache.keys + cache.values, twin.keys + twin.values):
        for row, length in enumerate(lengths):
            torch.testing.assert_close(mine[row, :, : length + 7], theirs[row, :, : length + 7], rtol=1e-5, atol=1e-5)
    chain = DecodeStep(model)(tokens[:, :3], _ragged_cache(model, lengths))  # no mask: a causal chain
    ref_chain = model.hidden_states(tokens[:, :3], _ragged_cache(model, lengths))
    torch.testing.assert_close(chain, ref_chain, rtol=1e-5, atol=1e-5)


def test_the_forward_uses_an_attached_step_up_to_its_token_limit() -> None:
    model = apply_format(make_tiny_model(6, **FORMAT_DIMS), "float32")
    calls: list[tuple[int, int]] = []
    step = DecodeStep(model)

    class Counting(DecodeStep):
        def __call__(self, tokens: torch.Tensor, cache: KVCache, tree_mask: torch.Tensor | None = None,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
            calls.append(tuple(tokens.shape))
            return step(tokens, cache, tree_mask, positions)

    model.decode_step = Counting(model)
    cache = _ragged_cache(model, [6, 6], capacity=DecodeStep.max_new + 20)  # a 6-token prefill
    model(torch.tensor([[1], [2]]), cache)  # a decode step
    cache.truncate(0, 6), cache.truncate(1, 6)
    model(torch.tensor([[1, 2], [3, 4]]), cache)  # two new tokens
    cache.truncate(0, 6), cache.truncate(1, 6)
    model(torch.ones(2, DecodeStep.max_new + 1, dtype=torch.long), cache)  # a prefill: the eager forward
    assert calls == [(2, 6), (2, 1), (2, 2)]


@pytest.mark.parametrize(("name", "attention"), [("q4_1", "kernel"), ("bfloat16", "kernel"), ("bfloat16", "torch")],
                         indirect=["attention"])
def test_compiled_step_matches_eager_saves_and_loads(tmp_path: Path, name: str, attention: str) -> None:
    """One compile serves every batch size and sequence length; a second process-like load
    of the saved file computes the same logits. (The compiled path of the served formats:
    the int4 kernel, and the prepacked oneDNN kernel behind its opaque op.)"""
    model = apply_format(make_tiny_model(8, **FORMAT_DIMS), name)
    artifact = tmp_path / artifact_name(model)
    step = DecodeStep(model, artifact=artifact)
    step.prepare()
    assert step.is_compiled and artifact.exists() and step.compile_seconds is not None
    eager_step = DecodeStep(model)
    for lengths, num_nodes in STEP_CASES:
        # bf16 activations: inductor keeps fused intermediates in float32 where eager rounds
        # them, so the two differ by bf16 rounding (relative to the logits' spread, as in
        # test_formats); a wrong slot, mask or row would differ by the spread itself.
        assert _against_eager(step, lengths, num_nodes)[0] <= 0.05
    loaded = DecodeStep(model, artifact=artifact)
    loaded.prepare()
    assert loaded.load_seconds is not None and loaded.compile_seconds is None
    cache = _ragged_cache(model, [7, 19])
    twin = _clone(cache)
    torch.testing.assert_close(_step_logits(loaded, torch.tensor([1, 2]), cache)[0],
                               _step_logits(step, torch.tensor([1, 2]), twin)[0])
    # In the background (a server's verifier): the first call runs eagerly and only then
    # starts the load; later calls switch to the loaded function.
    background = DecodeStep(model, artifact=artifact)
    background.prepare_in_background(idle_s=3600.0)
    cache = _ragged_cache(model, [7, 19])
    twin = _clone(cache)
    assert not background.is_compiled
    first = _step_logits(background, torch.tensor([1, 2]), cache)[0]
    torch.testing.assert_close(first, _step_logits(eager_step, torch.tensor([1, 2]), twin)[0], rtol=0, atol=0)
    deadline = time.monotonic() + 120
    while not background.is_compiled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert background.is_compiled and background.load_seconds is not None
    if name == "bfloat16":  # a truncated file is replaced by a fresh compile, not served
        broken = tmp_path / "broken.aot"
        broken.write_bytes(artifact.read_bytes()[:100])
        recovered = DecodeStep(model, artifact=broken)
        recovered.prepare()
        assert recovered.is_compiled and recovered.compile_seconds is not None and broken.stat().st_size > 100


@pytest.mark.parametrize("head_dim", [8, 16])
def test_fused_step_matches_eager_and_writes_the_same_cache(head_dim: int) -> None:
    """Every block in one C++ op (the q4_1 format on the int8-row kernels): the eager step's logits
    within bf16 rounding, for one token per row, ragged rows and trees, the same new K/V at each
    row's own slots and nothing else of the cache touched. A wrong rotation, slot, mask or
    residual differs by the logits' spread. Head sizes 8 and 16: half a head under and at a
    whole eight-lane vector (the default model's 64 is four)."""
    dims = {**FORMAT_DIMS, "head_dim": head_dim, "num_heads": FORMAT_DIMS["dim"] // head_dim}
    model = apply_format(make_tiny_model(8, **dims), "q4_1")
    fused = DecodeStep(model)
    if not fused.fuse():
        pytest.skip("needs the q4_1 int8-row kernels (AVX2, or AVX512-VNNI) and a C++ compiler")
    assert fused.is_fused and not fused.is_compiled
    fused.prepare()  # nothing to compile
    assert fused.compile_seconds is None
    for lengths, num_nodes in STEP_CASES:
        gap, cache, twin = _against_eager(fused, lengths, num_nodes)
        # Measured on these cases: 0.007-0.065 of the spread (the compiled step 0.008-0.037; the
        # 16-node trees are the far end of both). Dropping the MLP's residual, swapping K and V
        # or turning RoPE's second half fails this.
        assert gap <= 0.1
        assert torch.equal(cache.lengths, twin.lengths) and cache.num_pending == twin.num_pending
        for mine, theirs in zip(cache.keys + cache.values, twin.keys + twin.values):
            for row, length in enumerate(lengths):
                assert torch.equal(mine[row, :, :length], theirs[row, :, :length])
                assert torch.equal(mine[row, :, length + num_nodes:], theirs[row, :, length + num_nodes:])
                new, want = mine[row, :, length:length + num_nodes].float(), theirs[row, :, length:length + num_nodes].float()
                # bf16 roundings apart, compounded through the layers (the int8 rows of q4_mm
                # turn a rounding of x into a step of its quantized value); a wrong slot differs
                # by the values themselves.
                assert (new - want).abs().max() <= 0.15 * want.abs().max()
    hooked = apply_format(make_tiny_model(8, **dims), "q4_1")
    hooked.layers[1].mlp.down_proj.register_forward_hook(lambda module, args, out: None)
    assert not DecodeStep(hooked).fuse()  # tensor parallelism's all-reduce is such a hook: it must run


def test_artifact_name_follows_the_format() -> None:
    a = apply_format(make_tiny_model(0, **FORMAT_DIMS), "q4_1")
    b = apply_format(make_tiny_model(0, **FORMAT_DIMS), "bfloat16")
    c = apply_format(make_tiny_model(0, **{**FORMAT_DIMS, "num_layers": 2}), "q4_1")
    assert len({artifact_name(a), artifact_name(b), artifact_name(c)}) == 3


def test_an_unformatted_model_steps_with_its_own_projections() -> None:
    """Without a format's fused q|k|v (a feature drafter on a GPU), the step runs the three
    projections and computes the model's forward."""
    model = make_tiny_model(0, **FORMAT_DIMS)
    cache, twin = _ragged_cache(model, [3, 6]), _ragged_cache(model, [3, 6])
    tokens = torch.tensor([[1], [2]])
    positions = cache.lengths[:, None].clone()
    hidden = step_hidden(model, tokens, positions, torch.ones(2, 1, 1, dtype=torch.bool), cache.lengths,
                         cache.keys, cache.values, torch.empty(7))
    torch.testing.assert_close(hidden, model.hidden_states(tokens, twin), rtol=1e-5, atol=1e-5)

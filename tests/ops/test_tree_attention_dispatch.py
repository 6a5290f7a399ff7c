"""The model's attention takes the CUDA tree kernel whenever a token tree runs on CUDA, and
never builds the dense slot mask there; chains and plain decode keep SDPA.

On the CPU the CUDA path is driven by faking the device rule (``uses_tree_kernel``) and
running the kernel's source under the CPU shim (:mod:`treeserve_testing.tree_attention_shim`)
in place of CuPy: the model's tree forward then goes through the very code a GPU would run,
and must give the SDPA path's logits.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from treeserve.ops import model as model_module
from treeserve.ops import tree_attention
from treeserve.ops.kernels import tree_attention_cuda
from treeserve.ops.model import Transformer
from treeserve.ops.tree_attention import tree_mask_from_parents, uses_tree_kernel
from treeserve_testing import tree_attention_shim

TREE = [-1, 0, 0, 1, 1, 2, 3, 3, 6, -1, 9]  # two roots, uneven depths
OTHER_TREE = [-1, 0, 1, 0, 3, 3, 5, 2, 7, 8, 1]


def test_rule_sends_trees_on_cuda_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree_attention, "is_cuda_kernel_available", lambda: True)
    cuda = torch.device("cuda", 0)  # a device object needs no GPU
    mask = tree_mask_from_parents(torch.tensor([TREE]))
    assert uses_tree_kernel(cuda, mask, len(TREE))
    assert not uses_tree_kernel(cuda, None, 5)  # a chain (or a prefill): SDPA
    assert not uses_tree_kernel(torch.device("cpu"), mask, len(TREE))  # the CPU has its own step
    assert not uses_tree_kernel(cuda, torch.ones(1, 65, 65, dtype=torch.bool), 65)  # beyond one word
    monkeypatch.setattr(tree_attention, "is_cuda_kernel_available", lambda: False)
    assert not uses_tree_kernel(cuda, mask, len(TREE))  # no cupy: SDPA on CUDA too


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to emulate the kernel")
    try:
        return tree_attention_shim.build(Path(tmp_path_factory.mktemp("kernel")))
    except RuntimeError as exc:
        pytest.skip(f"the shim does not build here: {str(exc)[:200]}")


def tree_step_logits(model: Transformer, dtype: torch.dtype) -> torch.Tensor:
    """Two rows with different committed prefixes (a chain prefill each), then one tree forward
    of two different trees: logits ``(2, T, V)``."""
    gen = torch.Generator().manual_seed(3)
    model = model.to(dtype)
    cache = model.new_cache(2, capacity=64)
    for row, length in enumerate((7, 30)):
        prefix = torch.randint(0, model.config.vocab_size, (1, length), generator=gen).expand(2, -1)
        model(prefix, cache)
        cache.commit(row, range(length))
    mask = tree_mask_from_parents(torch.tensor([TREE, OTHER_TREE]))
    positions = cache.lengths[:, None] + mask.sum(-1) - 1
    tokens = torch.randint(0, model.config.vocab_size, (2, len(TREE)), generator=gen)
    return model(tokens, cache, tree_mask=mask, positions=positions).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_model_tree_forward_runs_the_kernel_on_cuda(shim: Any, tiny_model_factory: Callable[..., Transformer],
                                                    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    exact = tree_step_logits(tiny_model_factory(seed=1), torch.float32)  # SDPA under the dense mask
    model = tiny_model_factory(seed=1)
    expected = tree_step_logits(model, dtype)
    calls: list[str] = []

    def kernel_on_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_lengths: torch.Tensor,
                      ancestor_bits: torch.Tensor, *, max_prefix_length: int | None = None) -> torch.Tensor:
        assert max_prefix_length == int(prefix_lengths.max())  # the model's host-known length, no sync
        assert k.shape[2] == 64  # the whole cache storage, read in place
        return tree_attention_cuda.run_tree_attention(
            q, k, v, prefix_lengths, ancestor_bits, launch=tree_attention_shim.launcher(shim, calls), num_sms=4,
            max_prefix_length=max_prefix_length)

    real_mask = model_module.build_attention_mask

    def mask_only_for_chains(prefix_lengths: torch.Tensor, tree_mask: torch.Tensor | None, num_new: int,
                             num_slots: int) -> torch.Tensor:
        assert tree_mask is None, "the CUDA tree path built the dense mask"
        return real_mask(prefix_lengths, tree_mask, num_new, num_slots)

    # The device rule as on a GPU with cupy: a tree of at most 64 nodes.
    monkeypatch.setattr(model_module, "uses_tree_kernel", lambda device, tree_mask, num_new: tree_mask is not None)
    monkeypatch.setattr(tree_attention_cuda, "tree_attention_cuda", kernel_on_cpu)
    monkeypatch.setattr(model_module, "build_attention_mask", mask_only_for_chains)
    got = tree_step_logits(model, dtype)
    assert calls.count(f"tree_attention_{tree_attention_cuda.DTYPES[dtype]}_r{tree_attention_cuda.ROWS}") == model.config.num_layers
    if dtype == torch.float32:
        assert (got - expected).abs().max().item() < 1e-4
    else:  # bf16 rounds differently in each path: as close to float32 as SDPA's bf16 is
        sdpa_error = (expected - exact).abs().max().item()
        assert (got - exact).abs().max().item() < 1.5 * sdpa_error

"""Tensor parallelism: sharded forwards (threads with a fake all-reduce, and real gloo processes)
must give the unsharded model's logits."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from treeserve.ops.tp import apply_tp, split_sizes

WORKER = Path(__file__).with_name("tp_gloo_worker.py")


def _load_worker():
    spec = importlib.util.spec_from_file_location("tp_gloo_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker()


class ThreadAllReduce:
    """Sums one tensor per rank across threads; every rank gets the total (like all_reduce)."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def for_rank(self, rank: int):
        def all_reduce(tensor: torch.Tensor) -> None:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            total = torch.stack([s for s in self.slots]).sum(0)
            self.barrier.wait()
            tensor.copy_(total)

        return all_reduce


def run_threaded(world_size: int, *, break_reduce: bool = False, **overrides: object) -> torch.Tensor:
    reducer = ThreadAllReduce(world_size)
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            reduce = reducer.for_rank(rank)
            if break_reduce:  # a deliberately wrong all-reduce: keeps only the local partial sum
                def reduce(tensor: torch.Tensor, _r=reduce) -> None:
                    pass
            model = apply_tp(worker.build_model(**overrides), rank, world_size, reduce)
            results[rank] = worker.run(model)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for rank in range(1, world_size if not break_reduce else 1):
        assert torch.equal(results[rank], results[0]), "ranks disagree on the replicated logits"
    return results[0]


def test_split_sizes_cover_total() -> None:
    assert split_sizes(3, 2) == [2, 1]
    assert split_sizes(1536, 2) == [768, 768]
    assert sum(split_sizes(10, 3)) == 10


@pytest.mark.parametrize("variant", [{}, worker.GEMMA3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_threaded_tp_equals_unsharded(world_size: int, variant: dict) -> None:
    reference = worker.run(worker.build_model(**variant))
    sharded = run_threaded(world_size, **variant)
    assert (sharded - reference).abs().max().item() <= 1e-4


def test_threaded_tp_without_all_reduce_differs() -> None:
    """The equality check above can fail: dropping the all-reduce changes the logits."""
    reference = worker.run(worker.build_model())
    reducer_free = run_threaded(2, break_reduce=True)
    assert (reducer_free - reference).abs().max().item() > 1e-2


def test_tp_larger_than_kv_heads_rejected() -> None:
    with pytest.raises(ValueError, match="KV heads"):
        apply_tp(worker.build_model(), 0, 4, lambda t: None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gloo_tp2_equals_tp1(tmp_path: Path) -> None:
    """TP=2 over real torch.distributed gloo processes equals the unsharded model (float32)."""
    port = _free_port()
    outs = [tmp_path / f"rank{r}.npy" for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(r), "2", str(port), str(outs[r])])
        for r in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    reference = worker.run(worker.build_model()).numpy()
    for out in outs:
        assert np.abs(np.load(out) - reference).max() <= 1e-4

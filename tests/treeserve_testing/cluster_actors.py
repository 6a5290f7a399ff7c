"""Actors used by the cluster tests (importable by child processes on any node)."""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from typing import Any

from treeserve.runtime.actor import Actor, handler

__all__ = ["GlooRankActor"]


def _all_reduce_blocking(init_method: str, rank: int, world_size: int, values: list[float],
                         timeout_s: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor)  # sum over every rank of the group
        return {
            "sum": tensor.tolist(),
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "pid": os.getpid(),
            "num_cuda_devices": int(torch.cuda.device_count()),
        }
    finally:
        dist.destroy_process_group()


class GlooRankActor(Actor):
    """One rank of a torch.distributed gloo group with a TCP rendezvous: ranks hosted
    by different processes (or nodes) form one group, as tensor-parallel verifier
    shards do. ``all_reduce {init_method, rank, world_size, values, timeout_s}`` joins
    the group, sums ``values`` over all ranks, leaves the group and returns
    ``{sum, rank, world_size, pid, num_cuda_devices}``. The blocking collective runs in
    a thread so the actor's node keeps answering heartbeats meanwhile."""

    async def on_start(self) -> None:
        # Importing torch holds the GIL for seconds: do it before the child reports
        # ready, while its supervisor is not yet judging its heartbeats.
        import torch.distributed  # noqa: F401

    @handler
    async def all_reduce(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ValueError("all_reduce needs a map {init_method, rank, world_size, values}")
        init_method, rank, world_size = body.get("init_method"), body.get("rank"), body.get("world_size")
        values = body.get("values")
        if not isinstance(init_method, str) or not init_method.startswith("tcp://"):
            raise ValueError(f"init_method must be 'tcp://HOST:PORT', got {init_method!r}")
        if not isinstance(rank, int) or not isinstance(world_size, int) or not 0 <= rank < world_size:
            raise ValueError(f"need ints 0 <= rank < world_size, got {rank!r}, {world_size!r}")
        if not isinstance(values, list) or not all(isinstance(v, int | float) for v in values):
            raise ValueError("values must be a list of numbers")
        timeout_s = float(body.get("timeout_s", 30.0))
        return await asyncio.to_thread(
            _all_reduce_blocking, init_method, rank, world_size, [float(v) for v in values], timeout_s)

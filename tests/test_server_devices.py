"""Devices: where the verifier ranks and speculators go, the clear refusals (more ranks than
GPUs, a CPU-only format on CUDA, no CUDA at all), and the process group every CUDA shard
joins (NCCL, world size 1 included; its world-size-1 path is run here with gloo)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from treeserve.actors.model_host import check_device
from treeserve.actors.verify_fns import process_group_backend
from treeserve.server import Server
from treeserve.server_config import ServerConfig
from treeserve.server_devices import DeviceUnavailableError, place_devices


def test_one_gpu_holds_the_verifier_and_the_speculators() -> None:
    placement = place_devices("cuda", 1, 2, num_gpus=1)
    assert placement.verifier_devices == ("cuda:0",)
    assert placement.speculator_devices == ("cuda:0", "cuda:0")


def test_ranks_own_one_gpu_each_and_speculators_take_the_free_ones_first() -> None:
    placement = place_devices("cuda", 2, 3, num_gpus=4)
    assert placement.verifier_devices == ("cuda:0", "cuda:1")
    assert placement.speculator_devices == ("cuda:2", "cuda:3", "cuda:0")
    assert place_devices("cuda:1", 2, 1, num_gpus=3).verifier_devices == ("cuda:1", "cuda:2")
    assert place_devices("cpu", 2, 1, num_gpus=8) == place_devices("cpu", 2, 1, num_gpus=0)
    assert place_devices("cpu", 2, 1, num_gpus=0).verifier_devices == ("cpu", "cpu")


def test_more_ranks_than_gpus_is_a_clear_error() -> None:
    with pytest.raises(DeviceUnavailableError, match=r"--tp 2 .* needs GPUs 0\.\.1.*has 1 GPU.*--tp 1"):
        place_devices("cuda", 2, 1, num_gpus=1)
    with pytest.raises(DeviceUnavailableError, match="has 2 GPU"):
        place_devices("cuda:2", 1, 1, num_gpus=2)
    with pytest.raises(DeviceUnavailableError, match="no CUDA device"):
        place_devices("cuda", 1, 1, num_gpus=0)


def test_config_refuses_cpu_formats_and_bad_devices_on_construction() -> None:
    for fmt in ("q4_1", "int8"):
        with pytest.raises(ValueError, match=f"{fmt} format has CPU kernels only"):
            ServerConfig(device="cuda", dtype=fmt)
    for fmt in ("float32", "bfloat16", "auto"):
        assert ServerConfig(device="cuda:1", dtype=fmt).device == "cuda:1"
    for bad in ("gpu", "cuda:x", "cudA", "cuda:"):
        with pytest.raises(ValueError, match="device must be"):
            ServerConfig(device=bad)
    assert check_device("cuda:12") == "cuda:12"


async def test_server_start_fails_before_spawning_with_too_few_gpus() -> None:
    """One rank more than the GPUs torch sees here (none on a CPU host): refused at start,
    before any process, with the placement's message."""
    config = ServerConfig(device="cuda", tp=torch.cuda.device_count() + 1, bind="tcp://127.0.0.1:0")
    server = Server(config)
    with pytest.raises(DeviceUnavailableError):
        async with server:
            pass
    assert server.verifiers == [] and server.speculators == []


def test_server_places_ranks_and_speculators_by_the_gpus_it_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    import treeserve.server as server_module

    monkeypatch.setattr(server_module, "count_gpus", lambda: 2)
    placement = Server(ServerConfig(device="cuda", num_speculator_actors=2))._place_devices()
    assert placement.verifier_devices == ("cuda:0",) and placement.speculator_devices == ("cuda:1", "cuda:0")
    on_nodes = Server(ServerConfig(device="cuda", tp=3, num_nodes=1))._place_devices()
    assert on_nodes.verifier_devices == ("cuda",) * 3  # each node resolves its own
    assert Server(ServerConfig(tp=2))._place_devices().verifier_devices == ("cpu", "cpu")


def test_every_cuda_shard_joins_nccl() -> None:
    assert process_group_backend("cuda:0", 1) == "nccl"  # one GPU: NCCL's path, world size 1
    assert process_group_backend("cuda:1", 2) == "nccl"
    assert process_group_backend("cpu", 2) == "gloo"
    assert process_group_backend("cpu", 1) is None


def test_world_size_one_group_broadcasts_the_decision() -> None:
    """What a lone CUDA shard runs, with gloo in place of NCCL: a process group of one over an
    in-process store, and the rank-0 decision broadcast of every step (own process: the group
    is global state)."""
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        from treeserve.actors.verify_fns import rank0_broadcast_verifier
        from treeserve.ops.sampling import SamplingParams, randomness_for
        from treeserve.ops.token_tree import TokenTree
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        tree = TokenTree.from_parents([-1, 0, 0, 1], [5, 7, 3, 2])
        logits = torch.full((4, 11), -9.0)
        logits[0, 7] = logits[1, 2] = logits[3, 4] = 9.0
        params = SamplingParams()
        result = rank0_broadcast_verifier(0, None)(tree, logits, params, randomness_for(params, 1, None))
        dist.destroy_process_group()
        print(result.accepted, result.bonus_token)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "[0, 1, 3] 4"

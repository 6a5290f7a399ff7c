"""Runtime micro-benchmark: ``ask`` latency and throughput vs a bare pyzmq floor.

    python bench/runtime.py [--json] [--iterations N]

For each transport it measures, in one run: the ``ask`` round trip of an actor in a
child process (caller here), and the *floor*: a bare pyzmq asyncio DEALER -> ROUTER
echo against a child process serving the same kind of endpoint. ``inproc`` is an actor
on the caller's own node vs a bare zmq ``inproc://`` echo in this process. The 16 MiB
float32 tensor goes both ways (argument and reply) over ipc and in-process. Latencies
are percentiles over sequential calls; ``msgs_per_s`` keeps ``--window`` calls in
flight. Everything runs under uvloop (this is a program, so it owns its loop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import uvloop
import zmq
import zmq.asyncio

from treeserve.runtime import ActorRef, ChildTransport, Runtime, RuntimeConfig

# The echo actor is a test helper, not installed: import it from tests/, here and in the child
# processes this bench starts (they re-create it from its module:Class path).
TESTS = str(Path(__file__).resolve().parents[1] / "tests")
sys.path.insert(0, TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
from treeserve_testing.runtime_actors import EchoActor  # noqa: E402

SMALL_BODY = {"tokens": [1, 2, 3, 4], "note": "x" * 16}
TENSOR_BYTES = 16 * 1024 * 1024


# ---------------------------------------------------------------------------- floor


async def _floor_server(endpoint: str) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    sys.stdout.write(sock.getsockopt_string(zmq.LAST_ENDPOINT) + "\n")
    sys.stdout.flush()
    while True:
        frames = await sock.recv_multipart(copy=False)
        await sock.send_multipart(frames, copy=False)


class FloorClient:
    """A bare DEALER to an echo server; one message = header-sized frame(s)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    async def echo(self, frames: list[Any]) -> list[zmq.Frame]:
        await self.sock.send_multipart(frames, copy=False)
        reply: list[zmq.Frame] = await self.sock.recv_multipart(copy=False)
        return reply

    def close(self) -> None:
        self.sock.close(linger=0)


def start_floor_process(endpoint: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--floor-server", endpoint], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


# ---------------------------------------------------------------------------- measuring


async def latencies_us(call: Callable[[], Awaitable[Any]], n: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        await call()
    out = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        await call()
        out.append((clock() - t0) / 1000)
    return out


async def throughput(call: Callable[[], Awaitable[Any]], n: int, window: int) -> float:
    remaining = n

    async def lane() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await call()

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(window)))
    return n / (time.perf_counter() - t0)


async def floor_throughput(client: FloorClient, n: int, window: int) -> float:
    """Pipelined bare echo: ``window`` messages outstanding on one DEALER."""
    frame = [b"x" * 64]
    sock = client.sock
    t0 = time.perf_counter()
    for _ in range(window):
        await sock.send_multipart(frame)
    sent = window
    for _ in range(n):
        await sock.recv_multipart(copy=False)
        if sent < n:
            await sock.send_multipart(frame)
            sent += 1
        elif sent - window >= n:
            break
    return n / (time.perf_counter() - t0)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(ours: list[float], floor: list[float], ours_rate: float, floor_rate: float) -> dict[str, float]:
    p50, p99 = pct(ours, 0.5), pct(ours, 0.99)
    f50, f99 = pct(floor, 0.5), pct(floor, 0.99)
    return {
        "ask_p50_us": round(p50, 1),
        "ask_p99_us": round(p99, 1),
        "floor_p50_us": round(f50, 1),
        "floor_p99_us": round(f99, 1),
        "ratio_p50": round(p50 / f50, 2),
        "ratio_p99": round(p99 / f99, 2),
        "msgs_per_s": round(ours_rate),
        "floor_msgs_per_s": round(floor_rate),
        "ratio_msgs_per_s": round(ours_rate / floor_rate, 2),
        "num_samples": len(ours),
    }


# ---------------------------------------------------------------------------- scenarios


async def remote_scenario(transport: ChildTransport, args: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="ts-bench-")
    floor_ep = f"ipc://{tmp}/floor.sock" if transport is ChildTransport.IPC else "tcp://127.0.0.1:0"
    proc, floor_ep = start_floor_process(floor_ep)
    ctx = zmq.asyncio.Context()
    client = FloorClient(ctx, floor_ep)
    try:
        async with Runtime(RuntimeConfig(child_transport=transport)) as rt:
            echo = await rt.spawn(EchoActor, name="echo", process="child")
            payload = [b"x" * 64]
            floor = await latencies_us(lambda: client.echo(payload), args.iterations, args.warmup)
            ours = await latencies_us(lambda: echo.ask("echo", SMALL_BODY), args.iterations, args.warmup)
            # Interleave a second pass so load drift on a shared machine hits both.
            floor += await latencies_us(lambda: client.echo(payload), args.iterations, 0)
            ours += await latencies_us(lambda: echo.ask("echo", SMALL_BODY), args.iterations, 0)
            floor_rate = await floor_throughput(client, args.iterations * 2, args.window)
            rate = await throughput(lambda: echo.ask("echo", SMALL_BODY), args.iterations * 2, args.window)
            result = summary(ours, floor, rate, floor_rate)
            if transport is ChildTransport.IPC:
                result["tensor"] = await tensor_scenario(echo, client, args)
            return result
    finally:
        client.close()
        ctx.destroy(linger=0)
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


async def tensor_scenario(echo: ActorRef, client: FloorClient, args: argparse.Namespace) -> dict[str, Any]:
    arr = np.random.default_rng(0).standard_normal(TENSOR_BYTES // 4, dtype=np.float32)
    back = await echo.ask("echo", arr, timeout=30)
    if not np.array_equal(back, arr):
        raise AssertionError("tensor came back different")
    ours = await latencies_us(lambda: echo.ask("echo", arr, timeout=30), args.tensor_iterations, 1)
    floor = await latencies_us(lambda: client.echo([arr.data]), args.tensor_iterations, 1)
    p50, f50 = statistics.median(ours), statistics.median(floor)
    return {
        "round_trip_ms_p50": round(p50 / 1000, 2),
        "floor_round_trip_ms_p50": round(f50 / 1000, 2),
        "ratio_p50": round(p50 / f50, 2),
        "gib_per_s_both_ways": round(2 * TENSOR_BYTES / (p50 / 1e6) / 2**30, 2),
        "num_samples": len(ours),
    }


async def inproc_scenario(args: argparse.Namespace) -> dict[str, Any]:
    async with Runtime() as rt:
        echo = await rt.spawn(EchoActor, name="echo")
        ctx = zmq.asyncio.Context()
        server = ctx.socket(zmq.ROUTER)
        server.bind("inproc://floor")

        async def serve() -> None:
            while True:
                frames = await server.recv_multipart(copy=False)
                await server.send_multipart(frames, copy=False)

        serving = asyncio.ensure_future(serve())
        client = FloorClient(ctx, "inproc://floor")
        try:
            payload = [b"x" * 64]
            floor = await latencies_us(lambda: client.echo(payload), args.iterations, args.warmup)
            ours = await latencies_us(lambda: echo.ask("echo", SMALL_BODY), args.iterations, args.warmup)
            floor_rate = await floor_throughput(client, args.iterations * 2, args.window)
            rate = await throughput(lambda: echo.ask("echo", SMALL_BODY), args.iterations * 2, args.window)
            result = summary(ours, floor, rate, floor_rate)
            arr = np.random.default_rng(0).standard_normal(TENSOR_BYTES // 4, dtype=np.float32)
            tensor = await latencies_us(lambda: echo.ask("echo", arr), args.tensor_iterations, 1)
            result["tensor_16mib_round_trip_ms_p50"] = round(statistics.median(tensor) / 1000, 3)
            return result
        finally:
            serving.cancel()
            client.close()
            server.close(linger=0)
            ctx.destroy(linger=0)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    results: dict[str, Any] = {
        "loop": type(asyncio.get_running_loop()).__module__,
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    results["inproc"] = await inproc_scenario(args)
    ipc = await remote_scenario(ChildTransport.IPC, args)
    results["tensor_16mib"] = ipc.pop("tensor")
    results["ipc"] = ipc
    results["tcp"] = await remote_scenario(ChildTransport.TCP, args)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    return results


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--iterations", type=int, default=2000, help="sequential calls per pass")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--window", type=int, default=32, help="calls in flight for msgs/s")
    parser.add_argument("--tensor-iterations", type=int, default=15)
    parser.add_argument("--floor-server", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_server:
        uvloop.run(_floor_server(args.floor_server))
        return
    results = uvloop.run(main(args))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for name in ("inproc", "ipc", "tcp"):
        r = results[name]
        print(f"{name:7s} ask p50 {r['ask_p50_us']:8.1f}us p99 {r['ask_p99_us']:8.1f}us | floor p50 "
              f"{r['floor_p50_us']:7.1f}us | ratio p50 {r['ratio_p50']:.2f} | {r['msgs_per_s']} msg/s "
              f"(floor {r['floor_msgs_per_s']})")
    print("tensor_16mib", results["tensor_16mib"])


if __name__ == "__main__":
    cli()

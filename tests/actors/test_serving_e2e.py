"""End to end through the whole actor system: Client -> gateway -> scheduler -> speculator and
verifier-shard child processes, on a tiny random model written to disk.

The reference is plain incremental decoding in this process (``generate_incremental``): in
float32 greedy decoding the served tokens must be identical for tree, chain and no
speculation, with TP=1 and TP=2. Faults: killing the speculator mid-generation keeps requests
correct; killing a verifier shard ends the running requests with a retryable error (nobody
hangs) and the restarted shards serve new requests. Cancelling a stream frees its KV row.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from treeserve.actors.scheduler.types import SchedulerSettings
from treeserve.client import Client, InvalidRequestError, ServerError
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental
from treeserve.server import Server, ServerConfig

import tiny_model_files as tiny  # registered by conftest.py

PROMPTS = [[5, 9, 11, 30, 7], [40, 41, 42, 43, 40, 41, 42], [3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
SPECULATORS = (
    {"kind": "ngram", "num_draft_tokens": 4},
    {"kind": "self", "layers": 2, "expansion": [1, 2, 1, 1]},
    {"kind": "suffix", "num_draft_tokens": 8},  # one index per speculator actor, fed by every request
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model")


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    model = tiny.make_tiny_model()
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=(tiny.EOS_ID,))
    return generate_incremental(model, prompt, params).token_ids


def config(folder: Path, **overrides: Any) -> ServerConfig:
    base: dict[str, Any] = dict(
        model=str(folder), bind="tcp://127.0.0.1:0", num_rows=4, row_capacity=160, max_tree_nodes=32,
        speculators=SPECULATORS, heartbeat_interval_s=0.25, step_timeout_s=60.0,
    )
    return ServerConfig(**{**base, **overrides})


async def wait_for_stats(server: Server, predicate: Any, timeout_s: float = 10.0) -> dict[str, Any]:
    """Poll the scheduler's stats until ``predicate`` holds (rows are freed just after the last item)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        stats = await server.scheduler.ask("stats")
        if predicate(stats) or loop.time() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def wait_restarted(supervisor: Any, name: str, old_pid: int, timeout_s: float = 120.0) -> None:
    """Wait until the supervisor has replaced ``old_pid`` and the new child is running."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while supervisor.pid(name) in (old_pid, None):
        assert loop.time() < deadline, f"{name} was not restarted"
        await asyncio.sleep(0.05)
    await supervisor.wait_running(name, max(1.0, deadline - loop.time()))


async def generate_all(client: Client, speculate: str, max_tokens: int) -> list[list[int]]:
    completions = await asyncio.gather(
        *(client.generate(p, speculate=speculate, max_tokens=max_tokens) for p in PROMPTS)
    )
    return [list(c.token_ids) for c in completions]


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "fixed-trees"])
async def test_greedy_output_identical_to_incremental(tiny_folder: Path, adaptive: bool) -> None:
    expected = [reference(p, 24) for p in PROMPTS]
    # Fixed trees also prefill every request in a call of its own (a 1-token budget: every
    # prompt is longer); adaptive shares calls between requests admitted together.
    max_prefill_tokens = 8192 if adaptive else 1
    async with Server(config(tiny_folder, scheduling=SchedulerSettings(adaptive_speculation=adaptive, max_prefill_tokens=max_prefill_tokens))) as server, \
            Client(server.endpoint) as client:
        plain_steps = 0
        for speculate in ("none", "chain", "tree"):
            assert await generate_all(client, speculate, 24) == expected, speculate
            if speculate == "none":
                plain_steps = (await server.scheduler.ask("stats"))["num_steps"]
        stats = await wait_for_stats(server, lambda st: st["num_free_rows"] == 4)
        assert stats["num_completed"] == 3 * len(PROMPTS)
        assert stats["num_free_rows"] == 4 and stats["num_running"] == 0
        if not adaptive:
            assert stats["num_prefill_calls"] == 3 * len(PROMPTS)
            # Emptying the suffix index (what benchmarks of fresh traffic do) keeps outputs exact.
            await server.forget_traffic()
            assert await generate_all(client, "tree", 24) == expected
        assert ("adaptive" in stats) is adaptive
        if adaptive:
            # The policy sized (and learned from) every step with a speculating row, and no
            # step of the plain requests: those would cost a plain step as a tree budget's.
            assert 0 < plain_steps < stats["num_steps"]
            assert stats["adaptive"]["num_steps"] == stats["num_steps"] - plain_steps


async def test_tp2_equals_tp1(tiny_folder: Path) -> None:
    expected = [reference(p, 16) for p in PROMPTS]
    async with Server(config(tiny_folder, tp=2)) as server, Client(server.endpoint) as client:
        assert await generate_all(client, "tree", 16) == expected


async def test_cancel_frees_the_row(tiny_folder: Path) -> None:
    # Decode-ahead calls of at most 8 steps: a stop string found in one call's tokens reaches
    # the scheduler while the next call runs, so the request ends a call later; with the
    # default's 32 (0.1 s of the tiny model's steps) that call would be the rest of the 40.
    async with Server(config(tiny_folder, num_rows=1, scheduling=SchedulerSettings(max_decode_steps=8))) as server, Client(server.endpoint) as client:
        stream = client.stream([5, 6, 7], speculate="none", max_tokens=100)
        async for chunk in stream:
            assert chunk.token_ids
            break
        await stream.aclose()
        stats = await wait_for_stats(server, lambda st: st["num_free_rows"] == 1 and st["num_running"] == 0)
        assert stats["num_free_rows"] == 1 and stats["num_cancelled"] == 1
        # With its only row freed, the next request runs (it would wait forever otherwise).
        completion = await asyncio.wait_for(client.generate(PROMPTS[0], max_tokens=8), 60)
        assert list(completion.token_ids) == reference(PROMPTS[0], 8)

        # A stop string ends the text where it first appears and the generation with it
        # (the scheduler finishes the request early), and the row is freed for the next one.
        full = await client.generate([5, 6, 7], speculate="none", max_tokens=40)  # one token per step
        assert full.finish_reason == "length" and len(full.text) > 30 and full.num_steps == 40
        stop = full.text[len(full.text) // 3:][:4]
        cut = await asyncio.wait_for(
            client.generate([5, 6, 7], speculate="none", max_tokens=40, stop=[stop, "never in it!"]), 60)
        assert cut.text == full.text[:full.text.index(stop)] and cut.matched_stop == stop
        assert cut.finish_reason == "stop" and cut.num_generated_tokens == len(cut.token_ids) < 40
        assert list(cut.token_ids) == list(full.token_ids[:len(cut.token_ids)]) and cut.num_steps < full.num_steps
        stats = await wait_for_stats(server, lambda st: st["num_free_rows"] == 1 and st["num_running"] == 0)
        assert stats["num_free_rows"] == 1 and stats["num_cancelled"] == 1 and stats["num_completed"] == 3
        assert list((await client.generate(PROMPTS[0], max_tokens=8)).token_ids) == reference(PROMPTS[0], 8)


async def test_bad_requests_get_errors_and_server_keeps_serving(tiny_folder: Path) -> None:
    async with Server(config(tiny_folder)) as server, Client(server.endpoint) as client:
        bad: list[dict[str, Any]] = [
            {"prompt": [], "max_tokens": 4},
            {"prompt": list(range(3, 90)) * 3, "max_tokens": 4},  # longer than the context
            {"prompt": [5, 6], "max_tokens": 0},
            {"prompt": [5, 6], "temperature": -1.0},
            {"prompt": [5, 6], "temperature": float("nan")},
            {"prompt": [5, 6], "top_p": 1.5},
            {"prompt": [5, 100000]},  # outside the vocabulary
        ]
        for case in bad:
            prompt = case.pop("prompt")
            with pytest.raises(InvalidRequestError):
                await client.generate(prompt, **case)
        completion = await client.generate(PROMPTS[0], max_tokens=8)
        assert list(completion.token_ids) == reference(PROMPTS[0], 8)


async def test_killed_speculator_requests_stay_correct(tiny_folder: Path) -> None:
    expected = [reference(p, 40) for p in PROMPTS]
    async with Server(config(tiny_folder)) as server, Client(server.endpoint) as client:
        sup = server.speculator_supervisor
        pid = sup.pid("speculator-0")
        tasks = [asyncio.ensure_future(client.generate(p, speculate="tree", max_tokens=40)) for p in PROMPTS]
        await asyncio.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert [list(c.token_ids) for c in results] == expected
        await wait_restarted(sup, "speculator-0", pid)
        # The restarted speculator serves (and stays lossless).
        assert await generate_all(client, "tree", 40) == expected


async def test_killed_verifier_fails_requests_retryably_then_recovers(tiny_folder: Path) -> None:
    """Kill the shard while requests are being admitted and mid-generation (once a request
    has streamed its first token, with 99 to go in decode-ahead calls): every request ends
    (nothing lost or left hanging) with a retryable error, then service resumes."""
    async with Server(config(tiny_folder, max_restarts=5)) as server, Client(server.endpoint) as client:
        sup = server.verifier_supervisor
        for mid_generation in (False, True):
            pid = sup.pid("verifier-0")
            streaming = asyncio.Event()

            async def run(prompt: list[int]) -> None:
                async for chunk in client.stream(prompt, speculate="none", max_tokens=100):
                    if chunk.token_ids:
                        streaming.set()

            tasks = [asyncio.ensure_future(run(p)) for p in PROMPTS]
            if mid_generation:
                await asyncio.wait_for(streaming.wait(), 60)
            os.kill(pid, signal.SIGKILL)
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
            failures = [o for o in outcomes if isinstance(o, BaseException)]
            assert failures, "killing the verifier mid-generation must fail the running requests"
            for failure in failures:
                assert isinstance(failure, ServerError) and failure.retryable, failure
            await wait_restarted(sup, "verifier-0", pid)
            completion = await asyncio.wait_for(client.generate(PROMPTS[1], max_tokens=8), 120)
            assert list(completion.token_ids) == reference(PROMPTS[1], 8)

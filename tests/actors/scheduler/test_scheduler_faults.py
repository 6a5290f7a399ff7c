"""Fault containment in the real server (tiny random model in child processes): a speculator, then
a verifier, answers a malformed reply (missing field, a tree that does not decode, wrong rows).
Every open stream must end with a non-retryable ``internal`` error within 2 s (a scheduler that
swallows the exception or whose loop dies hangs them instead), and the next request must succeed.
When even the recovery fails, the scheduler's supervisor restarts it.

The faults are injected by ``FaultProxy`` actors the test puts between the scheduler and the real
speculator / verifier (``Server._scheduler_peers``); each corrupts one reply of one method.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from treeserve.actors.scheduler.types import SchedulerSettings
from treeserve.actors.scheduler.actor import SchedulerActor
from treeserve.client import Client, ServerError
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental
from treeserve.runtime import Actor, ActorRef, handler
from treeserve.server import Server, ServerConfig

import tiny_model_files as tiny  # registered by conftest.py

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[5, 9, 11, 30, 7], [40, 41, 42, 43, 40, 41, 42], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
MAX_TOKENS = 100  # no prompt above reaches EOS within it: every stream is still open at the fault
Corruption = Callable[[Any], Any]


class FaultProxy(Actor):
    """Forwards a speculator's or verifier's calls to ``target``; ``arm(method, corrupt)`` makes the
    next reply of ``method`` go through ``corrupt`` first."""

    max_concurrency = 256
    mailbox_size = 4096

    def __init__(self, target: ActorRef) -> None:
        self.target = target
        self.faults: dict[str, Corruption] = {}
        self.num_corrupted = 0

    def arm(self, method: str, corrupt: Corruption) -> None:
        self.faults[method] = corrupt

    async def _forward(self, method: str, body: Any) -> Any:
        reply = await self.target.ask(method, body, timeout=60)
        corrupt = self.faults.pop(method, None)
        if corrupt is None:
            return reply
        self.num_corrupted += 1
        return corrupt(reply)

    @handler
    async def info(self) -> Any:
        return await self._forward("info", None)

    @handler
    async def start(self, body: Any) -> Any:
        return await self._forward("start", body)

    @handler
    async def propose(self, body: Any) -> Any:
        return await self._forward("propose", body)

    @handler
    async def prefill(self, body: Any) -> Any:
        return await self._forward("prefill", body)

    @handler
    async def step(self, body: Any) -> Any:
        return await self._forward("step", body)

    @handler
    async def release(self, body: Any) -> Any:
        return await self._forward("release", body)


class ProxiedServer(Server):
    """A real server whose scheduler reaches its speculator and verifier through ``FaultProxy``s."""

    speculator_proxy: FaultProxy
    verifier_proxy: FaultProxy

    async def _scheduler_peers(self) -> tuple[list[ActorRef], list[ActorRef]]:
        (verifier,), (speculator,) = self.verifiers, self.speculators
        self.verifier_proxy, self.speculator_proxy = FaultProxy(verifier), FaultProxy(speculator)
        node = self.runtime.node
        return ([await node.host("verifier-proxy", self.verifier_proxy)],
                [await node.host("speculator-proxy", self.speculator_proxy)])


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model")


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=(tiny.EOS_ID,))
    return generate_incremental(tiny.make_tiny_model(), prompt, params).token_ids


def config(folder: Path) -> ServerConfig:
    # Fixed trees: every step asks the speculator (adaptive sizing could fall back to plain steps).
    return ServerConfig(
        model=str(folder), bind="tcp://127.0.0.1:0", num_rows=4, row_capacity=160, max_tree_nodes=32,
        speculators=({"kind": "ngram", "num_draft_tokens": 4},), scheduling=SchedulerSettings(adaptive_speculation=False),
        heartbeat_interval_s=0.25, step_timeout_s=60.0,
    )


async def consume(client: Client, prompt: list[int], started: asyncio.Event) -> Any:
    """Read one stream to its end; its error (or "finished") is the outcome."""
    try:
        async for _chunk in client.stream(prompt, speculate="tree", max_tokens=MAX_TOKENS):
            started.set()
    except ServerError as exc:
        return exc
    return "finished"


async def streams_fail_at_fault(client: Client, arm: Callable[[], None], *, arm_first: bool = False) -> list[Any]:
    """Open a stream per prompt, arm the fault once all of them run (or before, for admission
    faults) and return every stream's outcome, which must come within 2 s of the fault."""
    if arm_first:
        arm()
    started = [asyncio.Event() for _ in PROMPTS]
    tasks = [asyncio.ensure_future(consume(client, p, e)) for p, e in zip(PROMPTS, started)]
    try:
        if not arm_first:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            arm()
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 2.0))
    finally:
        for task in tasks:
            task.cancel()


def drop_trees(reply: Any) -> Any:
    return {k: v for k, v in reply.items() if k != "trees"}


def garbage_trees(reply: Any) -> Any:
    return {**reply, "trees": [{"tokens": "not a tree"} for _ in reply["trees"]]}


def one_tree_short(reply: Any) -> Any:
    return {**reply, "trees": reply["trees"][:-1]}


def wrong_row(reply: Any) -> Any:
    rows = [dict(r) for r in reply["rows"]]
    rows[0]["row"] = 999
    return {**reply, "rows": rows}


def drop_new_tokens(reply: Any) -> Any:
    rows = [dict(r) for r in reply["rows"]]
    del rows[0]["new_tokens"]
    return {**reply, "rows": rows}


def assert_internal(outcomes: list[Any], what: str) -> None:
    for outcome in outcomes:
        assert isinstance(outcome, ServerError), f"{what}: a stream ended with {outcome!r}, not an error"
        assert outcome.code == "internal" and not outcome.retryable, f"{what}: {outcome!r}"


async def test_malformed_replies_fail_open_streams_and_the_next_request_succeeds(tiny_folder: Path) -> None:
    expected = reference(PROMPTS[0], 8)
    async with ProxiedServer(config(tiny_folder)) as server, Client(server.endpoint) as client:
        scenarios: list[tuple[str, FaultProxy, str, Corruption, bool]] = [
            ("speculator: missing field", server.speculator_proxy, "propose", drop_trees, False),
            ("speculator: tree that does not decode", server.speculator_proxy, "propose", garbage_trees, False),
            ("speculator: a tree short", server.speculator_proxy, "propose", one_tree_short, False),
            ("verifier: wrong row", server.verifier_proxy, "step", wrong_row, False),
            ("verifier: missing field", server.verifier_proxy, "step", drop_new_tokens, False),
            ("verifier: wrong row at admission", server.verifier_proxy, "prefill", wrong_row, True),
        ]
        for what, proxy, method, corrupt, arm_first in scenarios:
            before = proxy.num_corrupted
            outcomes = await streams_fail_at_fault(client, lambda: proxy.arm(method, corrupt), arm_first=arm_first)
            assert proxy.num_corrupted == before + 1, what
            assert_internal(outcomes, what)
            completion = await asyncio.wait_for(client.generate(PROMPTS[0], max_tokens=8), 60)
            assert list(completion.token_ids) == expected, what
        stats = await server.scheduler.ask("stats")
        assert stats["num_step_faults"] == len(scenarios)
        assert stats["num_running"] == 0 and stats["num_queued"] == 0


async def test_a_scheduler_whose_recovery_fails_is_restarted(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken_recover(self: SchedulerActor, exc: Exception) -> None:
        raise RuntimeError("recovery failed too") from exc

    monkeypatch.setattr(SchedulerActor, "_recover", broken_recover)
    async with ProxiedServer(config(tiny_folder)) as server, Client(server.endpoint) as client:
        proxy = server.verifier_proxy
        outcomes = await streams_fail_at_fault(client, lambda: proxy.arm("step", drop_new_tokens))
        for outcome in outcomes:  # the old incarnation stopped under them: retry is fine
            assert isinstance(outcome, ServerError) and outcome.retryable, outcome
        async with asyncio.timeout(10):  # the restart runs after the old incarnation stopped
            while server.scheduler_supervisor.num_restarts == 0:
                await asyncio.sleep(0.02)
        assert server.scheduler_supervisor.num_restarts == 1 and server.failures == []
        completion = await asyncio.wait_for(client.generate(PROMPTS[0], max_tokens=8), 60)
        assert list(completion.token_ids) == reference(PROMPTS[0], 8)

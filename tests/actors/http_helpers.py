"""Shared by the HTTP API tests: a tiny model with a chat template, a real server whose scheduler
reaches its verifier through a proxy (slowed down, or made to corrupt a reply, on demand), and
small waits. Not a test module: the tests load it by path (``load_helpers``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tiny_model_files as tiny  # registered by conftest.py

from treeserve.runtime import Actor, ActorRef, handler
from treeserve.server import Server, ServerConfig

MODEL = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %} w5 {{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %} w6{% endif %}")


def write_chat_model(folder: Path) -> Path:
    """The tiny random model (word tokens ``w3``..``w96``), with a chat template."""
    folder = tiny.write_tiny_hf_model(folder)
    settings_file = folder / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text(encoding="utf-8"))
    settings["chat_template"] = CHAT_TEMPLATE
    settings_file.write_text(json.dumps(settings), encoding="utf-8")
    return folder


def http_config(folder: Path, **overrides: Any) -> ServerConfig:
    base: dict[str, Any] = dict(
        model=str(folder), bind=None, http="127.0.0.1:0", served_model_name=MODEL, num_rows=2, row_capacity=160,
        max_tree_nodes=16, speculators=({"kind": "ngram", "num_draft_tokens": 4},), heartbeat_interval_s=0.25,
        step_timeout_s=60.0,
    )
    return ServerConfig(**{**base, **overrides})


class VerifierProxy(Actor):
    """Forwards the scheduler's verifier calls; ``step_delay_s`` slows each step down (so that a
    generation is still running while a test acts on it) and ``arm(method, corrupt)`` passes the
    next reply of ``method`` through ``corrupt``."""

    max_concurrency = 256
    mailbox_size = 4096

    def __init__(self, target: ActorRef) -> None:
        self.target = target
        self.step_delay_s = 0.0
        self.faults: dict[str, Callable[[Any], Any]] = {}

    def arm(self, method: str, corrupt: Callable[[Any], Any]) -> None:
        self.faults[method] = corrupt

    async def _forward(self, method: str, body: Any) -> Any:
        reply = await self.target.ask(method, body, timeout=60)
        corrupt = self.faults.pop(method, None)
        return reply if corrupt is None else corrupt(reply)

    @handler
    async def info(self) -> Any:
        return await self._forward("info", None)

    @handler
    async def prefill(self, body: Any) -> Any:
        return await self._forward("prefill", body)

    @handler
    async def step(self, body: Any) -> Any:
        if self.step_delay_s:
            await asyncio.sleep(self.step_delay_s)
        return await self._forward("step", body)

    @handler
    async def release(self, body: Any) -> Any:
        return await self._forward("release", body)


class ProxiedServer(Server):
    """A real server whose scheduler reaches its verifier shard through a :class:`VerifierProxy`;
    ``hold_start`` (when set) keeps the server starting until it is set."""

    verifier_proxy: VerifierProxy
    hold_start: asyncio.Event | None = None

    async def _scheduler_peers(self) -> tuple[list[ActorRef], list[ActorRef]]:
        if self.hold_start is not None:
            await self.hold_start.wait()
        (verifier,) = self.verifiers
        self.verifier_proxy = VerifierProxy(verifier)
        return [await self.runtime.node.host("verifier-proxy", self.verifier_proxy)], self.speculators


def wrong_row(reply: Any) -> Any:
    """A verifier reply naming a row nobody asked about: a step fault (internal error)."""
    rows = [dict(r) for r in reply["rows"]]
    rows[0]["row"] = 999
    return {**reply, "rows": rows}


async def wait_for_stats(server: Server, predicate: Callable[[dict[str, Any]], bool],
                         timeout_s: float = 20.0) -> dict[str, Any]:
    """Poll the scheduler's stats until ``predicate`` holds (or the time is up: the caller asserts)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        stats = dict(await server.scheduler.ask("stats"))  # type: ignore[union-attr]
        if predicate(stats) or loop.time() > deadline:
            return stats
        await asyncio.sleep(0.02)


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, by (name, sorted labels), parsed with
    ``prometheus_client``'s own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}

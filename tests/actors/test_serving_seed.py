"""Reproducible seeds end to end (PROTOCOL §11.3): the same seeded request gives the same text
alone, inside batches of two and three concurrent requests, and with ``speculate`` "none" or
"tree", on a real server (gateway, scheduler, speculator and verifier child processes) over a
tiny random float32 model.

A verifier that draws a seeded request's randomness from one stream per request fails this
(checked by hand against such a verifier, for every case here): the number of draws a step
takes depends on its tree, so "tree" and "none" diverge within a few tokens, and adaptive tree
sizes, which learn from earlier requests, make even repeated runs differ.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from treeserve.actors.scheduler.types import SchedulerSettings
from treeserve.client import Client, Completion
from treeserve.server import Server, ServerConfig

import tiny_model_files as tiny  # registered by conftest.py

PROMPT = [5, 9, 11, 30, 7]
SEEDED = {"temperature": 0.9, "seed": 42, "max_tokens": 40}
# Companions: other prompts, another seed and no seed, long enough to overlap the whole seeded
# request, so the scheduler batches them with it.
COMPANIONS: list[tuple[list[int], dict[str, Any]]] = [
    ([40, 41, 42, 43, 40, 41, 42], {"temperature": 1.0, "seed": 7, "max_tokens": 60}),
    ([60, 61, 62, 63, 64, 65, 66, 67], {"temperature": 0.7, "top_k": 20, "max_tokens": 60}),
]
SPECULATORS = (
    {"kind": "ngram", "num_draft_tokens": 4},
    {"kind": "self", "layers": 3, "expansion": [4, 2, 2, 1]},  # all 3 layers: q = p
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model")


def config(folder: Path, adaptive: bool) -> ServerConfig:
    return ServerConfig(
        model=str(folder), bind="tcp://127.0.0.1:0", num_rows=4, row_capacity=160, max_tree_nodes=32,
        speculators=SPECULATORS, scheduling=SchedulerSettings(adaptive_speculation=adaptive), heartbeat_interval_s=0.25, step_timeout_s=60.0,
    )


async def seeded_alongside(server: Server, client: Client, speculate: str, num_companions: int,
                           request: dict[str, Any]) -> tuple[Completion, bool]:
    """The seeded request, sent together with the first ``num_companions`` companions; also
    whether the requests shared verifier steps (fewer scheduler steps than their own steps)."""
    before = (await server.scheduler.ask("stats"))["num_decode_steps"]
    companions = [client.generate(p, speculate="tree", **kw) for p, kw in COMPANIONS[:num_companions]]
    done = await asyncio.gather(client.generate(PROMPT, speculate=speculate, **request), *companions)
    num_steps = (await server.scheduler.ask("stats"))["num_decode_steps"] - before
    return done[0], num_steps < sum(d.num_steps for d in done)


@pytest.mark.parametrize(
    ("adaptive", "top"),
    [(True, {}), (False, {}), (False, {"top_k": 12, "top_p": 0.9})],
    ids=["adaptive", "fixed-trees", "fixed-trees-top_k-top_p"],
)
async def test_seeded_text_is_the_same_alone_in_batches_and_with_or_without_speculation(
    tiny_folder: Path, adaptive: bool, top: dict[str, Any]
) -> None:
    request = {**SEEDED, **top}
    texts: dict[str, list[int]] = {}
    steps_saved = 0  # generated tokens minus verifier steps: drafts accepted under "tree"
    async with Server(config(tiny_folder, adaptive)) as server, Client(server.endpoint) as client:
        # First on a fresh server, then alone again, then in batches of two and three.
        for speculate in ("tree", "none"):
            for label, num_companions in (("alone", 0), ("alone again", 0), ("batch of 2", 1), ("batch of 3", 2)):
                done, shared_steps = await seeded_alongside(server, client, speculate, num_companions, request)
                assert shared_steps == (num_companions > 0), label  # a batch really was one
                texts[f"{speculate}, {label}"] = list(done.token_ids)
                if speculate == "tree":
                    steps_saved += done.num_generated_tokens - done.num_steps
    reference = texts["tree, alone"]
    assert len(reference) > 5, texts  # not an immediate stop: there is text to compare
    assert all(text == reference for text in texts.values()), texts
    if not adaptive:  # (the adaptive policy may find trees not worth their cost on this model)
        assert steps_saved > 0, steps_saved  # "tree" did speculate: some steps emitted several tokens

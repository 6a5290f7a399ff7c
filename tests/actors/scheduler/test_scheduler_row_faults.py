"""Faults stay where they happen: a numerical failure in one request's row ends that request alone,
with a non-retryable error, while the streams next to it finish with their exact greedy tokens.

The model is the tiny random one with the embedding of one token id (``POISON``) set to NaN: any
row that holds that token computes non-finite logits. ``temperature=1e-300`` (0 in float32: the
scaled logits overflow) is greedy by the rule of ``transport/PROTOCOL.md`` 11.3. The verifier's
per-row guard is also checked directly, on a verifier hosted in this process.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from treeserve.actors.gateway.request import MIN_SAMPLING_TEMPERATURE, parse_generate
from treeserve.actors.messages.tree_wire import params_to_wire, tree_to_wire
from treeserve.actors.verifier import VerifierShard
from treeserve.client import Client, ServerError
from treeserve.ops.sampling import SamplingParams
from treeserve.ops.speculative import generate_incremental
from treeserve.ops.token_tree import TokenTree
from treeserve.runtime import Runtime
from treeserve.server import Server, ServerConfig

import tiny_model_files as tiny  # registered by conftest.py

pytestmark = pytest.mark.timeout(240)

HEALTHY = [[5, 9, 11, 30, 7], [40, 41, 42, 43, 40, 41, 42], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
MAX_TOKENS = 40


def reference(prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=(tiny.EOS_ID,))
    return generate_incremental(tiny.make_tiny_model(), prompt, params).token_ids


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [reference(p) for p in HEALTHY]


@pytest.fixture(scope="module")
def poison(expected: list[list[int]]) -> int:
    """A token id that no healthy prompt or answer holds (so healthy rows never see NaN)."""
    used = {t for seq in HEALTHY + expected for t in seq}
    return min(set(range(3, tiny.TINY_CONFIG["vocab_size"])) - used)


@pytest.fixture(scope="module")
def poisoned_folder(tmp_path_factory: pytest.TempPathFactory, poison: int) -> Path:
    from safetensors.torch import load_file, save_file

    folder = tiny.write_tiny_hf_model(tmp_path_factory.mktemp("poisoned") / "model")
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.embed_tokens.weight"][poison] = math.nan
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def config(folder: Path, **overrides: Any) -> ServerConfig:
    base: dict[str, Any] = dict(
        model=str(folder), bind="tcp://127.0.0.1:0", num_rows=4, row_capacity=160, max_tree_nodes=16,
        speculators=({"kind": "ngram", "num_draft_tokens": 4},), heartbeat_interval_s=0.25, step_timeout_s=60.0,
    )
    return ServerConfig(**{**base, **overrides})


async def outcome(client: Client, prompt: list[int], **params: Any) -> Any:
    try:
        return list((await client.generate(prompt, max_tokens=MAX_TOKENS, **params)).token_ids)
    except ServerError as exc:
        return exc


async def test_a_non_finite_row_fails_alone_and_tiny_temperatures_are_greedy(
    poisoned_folder: Path, poison: int, expected: list[list[int]]
) -> None:
    async with Server(config(poisoned_folder)) as server, Client(server.endpoint) as client:
        # Three healthy streams share every step with a request whose row turns NaN.
        results = await asyncio.wait_for(asyncio.gather(
            *(outcome(client, p) for p in HEALTHY), outcome(client, [5, poison, *range(10, 30)], speculate="none"),
        ), 120)
        assert results[:3] == expected
        failure = results[3]
        assert isinstance(failure, ServerError) and failure.code == "internal" and not failure.retryable, failure
        assert "numerical failure" in failure.message
        assert await asyncio.wait_for(outcome(client, HEALTHY[0]), 60) == expected[0]

        # 1e-300 is 0 in float32: as a sampling temperature it would make every probability NaN.
        # Four requests fill all four rows: one reuses the failed row, whose cache holds NaN in
        # slots past its shorter prompt, read (masked, but 0 * NaN) when it is batched with longer
        # rows: the verifier must have zeroed it. (Healthy streams stay greedy here: a sampled one could draw the poisoned token.)
        results = await asyncio.wait_for(asyncio.gather(
            *(outcome(client, p) for p in HEALTHY), outcome(client, HEALTHY[0], temperature=1e-300, seed=3),
        ), 120)
        assert results == [*expected, expected[0]]  # the tiny temperature is greedy, as the rule says
        stats = await server.scheduler.ask("stats")
        assert stats["num_row_failures"] == 1 and stats["num_step_faults"] == 0 and stats["num_verifier_failures"] == 0


def test_temperature_rule_where_params_are_validated() -> None:
    def temperature(value: float) -> float:
        return parse_generate({"prompt": "x", "temperature": value}, vocab_size=10, context_length=8,
                              max_prompt_chars=10).temperature

    assert temperature(1e-300) == 0.0 and temperature(MIN_SAMPLING_TEMPERATURE / 2) == 0.0
    assert temperature(MIN_SAMPLING_TEMPERATURE) == MIN_SAMPLING_TEMPERATURE and temperature(0.7) == 0.7


async def test_verifier_answers_a_failed_row_and_verifies_the_others(tmp_path: Path) -> None:
    """Straight to a verifier (no gateway rule in between): a row sampled at 1e-300 answers an
    ``error``; the rows beside it are verified exactly as in a step without it."""
    folder = tiny.write_tiny_hf_model(tmp_path / "tiny")
    shard = {"model": str(folder), "num_rows": 3, "row_capacity": 64, "num_threads": 1}
    greedy, tiny_t = params_to_wire(SamplingParams()), params_to_wire(SamplingParams(temperature=1e-300, seed=1))

    def row(index: int, params: dict[str, Any], root: int) -> dict[str, Any]:
        tree = tree_to_wire(TokenTree.from_parents([-1], [root]))
        return {"row": index, "tree": tree, "params": params, "request_id": f"r{index}"}

    async with Runtime() as rt:
        alone = await rt.spawn(VerifierShard, shard, name="alone")
        mixed = await rt.spawn(VerifierShard, shard, name="mixed")
        prompts = [[5, 9, 11], [40, 41, 42], [60, 61, 62]]
        for verifier in (alone, mixed):
            await verifier.ask("prefill", {"rows": [{"row": i, "prompt_ids": p} for i, p in enumerate(prompts)]})
        want = await alone.ask("step", {"rows": [row(0, greedy, 11), row(2, greedy, 62)]})
        got = await mixed.ask("step", {"rows": [row(0, greedy, 11), row(1, tiny_t, 42), row(2, greedy, 62)]})
        assert got["rows"][1]["row"] == 1 and "numerical failure" in got["rows"][1]["error"]
        assert [got["rows"][0], got["rows"][2]] == want["rows"]
        # The next step of the healthy rows is still the same on both verifiers.
        nxt = [want["rows"][0]["bonus_token"], want["rows"][1]["bonus_token"]]
        want = await alone.ask("step", {"rows": [row(0, greedy, nxt[0]), row(2, greedy, nxt[1])]})
        got = await mixed.ask("step", {"rows": [row(0, greedy, nxt[0]), row(2, greedy, nxt[1])]})
        assert got == want


async def test_tensor_parallel_ranks_agree_on_a_failed_row(tmp_path: Path) -> None:
    """Rank 0 decides a row failed numerically and broadcasts it: every rank answers that row's
    error, commits the same for the others, and the group goes on (no hang, no divergence)."""
    import socket

    from treeserve.runtime import RuntimeConfig, SupervisorConfig

    folder = tiny.write_tiny_hf_model(tmp_path / "tiny")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    greedy, tiny_t = params_to_wire(SamplingParams()), params_to_wire(SamplingParams(temperature=1e-300, seed=1))

    def shard(rank: int) -> dict[str, Any]:
        return {"model": str(folder), "num_rows": 2, "row_capacity": 64, "num_threads": 1, "tp_rank": rank,
                "tp_size": 2, "dist_init": f"tcp://127.0.0.1:{port}"}

    def rows(*entries: tuple[int, dict[str, Any], int]) -> dict[str, Any]:
        return {"rows": [{"row": r, "tree": tree_to_wire(TokenTree.from_parents([-1], [root])), "params": p,
                          "request_id": f"r{r}"} for r, p, root in entries]}

    config = RuntimeConfig(supervisor=SupervisorConfig(start_timeout_s=90), default_timeout_s=90)
    async with Runtime(config) as rt:
        ranks = [await rt.spawn(VerifierShard, shard(rank), name=f"rank{rank}", process="child") for rank in (0, 1)]

        async def fan(method: str, body: Any) -> list[Any]:
            return list(await asyncio.gather(*(r.ask(method, body, timeout=60) for r in ranks)))

        await fan("prefill", {"rows": [{"row": 0, "prompt_ids": [5, 9, 11]}, {"row": 1, "prompt_ids": [40, 41, 42]}]})
        replies = await fan("step", rows((0, greedy, 11), (1, tiny_t, 42)))
        for reply in replies:
            assert "error" in reply["rows"][1] and "accepted" in reply["rows"][0]
        assert replies[0]["rows"][0] == replies[1]["rows"][0]
        bonus = replies[0]["rows"][0]["bonus_token"]
        again = await fan("step", rows((0, greedy, bonus)))
        assert again[0] == again[1]

"""SSJF end to end: the scheduler queues each request with the length predictor's guess, and the
shorter predicted job is admitted first; the predictor actor learns from completed requests.

The predictor here is a trained ``prompt_len`` head for a tiny random model (long prompts ->
short answers), so its order is known. The same scenario under ``fcfs`` is the control: it
admits in arrival order, so the SSJF assertion fails for a scheduler that ignores predictions.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from treeserve.actors.scheduler.types import SchedulerSettings
from treeserve.client import Client, Completion
from treeserve.ops.length_predictor import load_predictor
from treeserve.server import Server, ServerConfig

import tiny_model_files as tiny  # registered by conftest.py

SHORT_PROMPT = [5, 9, 11]  # predicted long
LONG_PROMPT = list(range(20, 44))  # predicted short
PREDICTOR_CAP = 24


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def predictor_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_prompt_len_predictor(tmp_path_factory.mktemp("predictor") / "tiny.npz",
                                           [2, 3, 3, 4, 20, 24, 28, 30], [20, 20, 19, 21, 4, 3, 4, 5], PREDICTOR_CAP)


def config(folder: Path, predictor: Path, scheduler: str) -> ServerConfig:
    return ServerConfig(
        model=str(folder), bind="tcp://127.0.0.1:0", num_rows=1, row_capacity=200, max_tree_nodes=16,
        speculators=(), heartbeat_interval_s=0.25, step_timeout_s=60.0,
        scheduling=SchedulerSettings(policy=scheduler, max_wait_s=600.0), predictor=str(predictor),
    )


async def blocked_pair(client: Client) -> tuple[Completion, Completion, list[str]]:
    """Occupy the only row, queue a predicted-long job then a predicted-short one.

    Returns both completions and the order they finished in. With one row a request runs only
    after the one before it has finished, so the finishing order is the admission order.
    ``queue_s`` alone cannot show that order: it is measured from each request's own arrival,
    and the earlier arrival may run its whole answer in less time than the gap between them.
    """
    finished: list[str] = []
    blocker = client.stream([3, 4], speculate="none", max_tokens=150)
    async for _ in blocker:  # the blocker holds the row from its first token on
        break
    first = asyncio.ensure_future(client.generate(SHORT_PROMPT, speculate="none", max_tokens=PREDICTOR_CAP))
    first.add_done_callback(lambda _: finished.append("early_long"))
    await asyncio.sleep(0.05)  # arrives strictly first
    second = asyncio.ensure_future(client.generate(LONG_PROMPT, speculate="none", max_tokens=PREDICTOR_CAP))
    second.add_done_callback(lambda _: finished.append("late_short"))
    async for _ in blocker:
        pass
    return await asyncio.wait_for(first, 120), await asyncio.wait_for(second, 120), finished


def test_the_trained_head_predicts_long_prompts_short(predictor_path: Path) -> None:
    predictor = load_predictor(predictor_path)
    short_answer = predictor.predict_from_prompt_ids(LONG_PROMPT)
    long_answer = predictor.predict_from_prompt_ids(SHORT_PROMPT)
    assert short_answer < 8 < 15 < long_answer <= PREDICTOR_CAP


async def test_ssjf_admits_the_shorter_predicted_job_first(tiny_folder: Path, predictor_path: Path) -> None:
    predictor = load_predictor(predictor_path)
    async with Server(config(tiny_folder, predictor_path, "ssjf")) as server, Client(server.endpoint) as client:
        assert server.predictor is not None
        early_long, late_short, finished = await blocked_pair(client)
        # The later, shorter-predicted request overtook the earlier one in the queue.
        assert finished == ["late_short", "early_long"]
        assert late_short.queue_s < early_long.queue_s
        assert late_short.predicted_len is not None and early_long.predicted_len is not None
        assert math.isclose(late_short.predicted_len, predictor.predict_from_prompt_ids(LONG_PROMPT), rel_tol=1e-6)
        assert math.isclose(early_long.predicted_len, predictor.predict_from_prompt_ids(SHORT_PROMPT), rel_tol=1e-6)
        stats: dict[str, Any] = await server.scheduler.ask("stats")
        assert stats["has_predictor"] and stats["num_predicted"] == 3 and stats["num_predictor_failures"] == 0
        # Every request ran to max_tokens == the predictor's cap: uncensored, so all are learnt from.
        for _ in range(100):
            learnt = await server.predictor.ask("stats")
            if learnt["num_observed"] == 3:
                break
            await asyncio.sleep(0.05)
        assert learnt["num_observed"] == 3 and learnt["num_pending"] == 0


async def test_fcfs_control_keeps_arrival_order(tiny_folder: Path, predictor_path: Path) -> None:
    async with Server(config(tiny_folder, predictor_path, "fcfs")) as server, Client(server.endpoint) as client:
        assert server.predictor is None  # fcfs needs no prediction
        early_long, late_short, finished = await blocked_pair(client)
        assert finished == ["early_long", "late_short"]
        assert early_long.predicted_len is None


async def test_a_predictor_for_another_model_fails_the_start(tiny_folder: Path) -> None:
    shipped = load_predictor()  # hidden features of the default model: 2 * 576 + 1 wide
    assert shipped.spec.kind == "hidden"
    bad = ServerConfig(**{**config(tiny_folder, Path("unused"), "ssjf").__dict__,
                          "predictor": str(Path(__file__).parents[2] / "ops" / "data" / "predictor_smollm2-135m-instruct.npz")})
    with pytest.raises(Exception, match="train one for this model"):
        async with Server(bad):
            pass


async def test_a_client_length_hint_orders_the_request_instead_of_the_predictor(
        tiny_folder: Path, predictor_path: Path) -> None:
    """Through the whole server: the same prompt twice behind a blocker, the later one with a
    short length hint; the hint, not the predictor (which says ~20 tokens for both), orders it."""
    async with Server(config(tiny_folder, predictor_path, "ssjf")) as server, Client(server.endpoint) as client:
        finished: list[str] = []
        blocker = client.stream([3, 4], speculate="none", max_tokens=150)
        async for _ in blocker:
            break
        plain = asyncio.ensure_future(client.generate(SHORT_PROMPT, speculate="none", max_tokens=PREDICTOR_CAP))
        plain.add_done_callback(lambda _: finished.append("plain"))
        await asyncio.sleep(0.05)
        hinted = asyncio.ensure_future(client.generate(SHORT_PROMPT, speculate="none", max_tokens=PREDICTOR_CAP,
                                                       length_hint=2))
        hinted.add_done_callback(lambda _: finished.append("hinted"))
        async for _ in blocker:
            pass
        plain_done, hinted_done = await asyncio.wait_for(asyncio.gather(plain, hinted), 120)
        assert finished == ["hinted", "plain"]
        assert hinted_done.predicted_len is None and plain_done.predicted_len is not None
        stats: dict[str, Any] = await server.scheduler.ask("stats")
        assert stats["num_hinted"] == 1 and stats["num_predicted"] == 2  # the blocker and "plain"

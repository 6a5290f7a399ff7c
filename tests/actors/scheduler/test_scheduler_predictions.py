"""Length predictions off the admission path, through the real scheduler actor with a stand-in
verifier and a stand-in predictor (no model): a request that finds a free row is admitted
without waiting for its prediction; a queued one is queued at once and re-keyed when its
prediction lands; predictions are batched; a failing predictor leaves requests served.

The scheduler before this change awaited each request's prediction before queueing it, so the
first test fails for it (the request waited the predictor's whole delay).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from treeserve.actors.scheduler.actor import SchedulerActor, SchedulerConfig
from treeserve.runtime import Actor, ActorRef, Runtime, handler
from treeserve_testing.verifier_fakes import StepVerifier

pytestmark = pytest.mark.timeout(60)

LONG_PROMPT = [1, 2, 3]  # the stand-in predictor says: long answer
SHORT_PROMPT = [4, 5, 6]  # short answer


class SlowPredictor(Actor):
    """Answers ``predict_batch`` after ``delay_s`` (``fail``: with an error): 40 tokens for
    ``LONG_PROMPT``, 3 for ``SHORT_PROMPT``, 20 for anything else. Records every batch."""

    max_concurrency = 8

    def __init__(self, delay_s: float, fail: bool = False) -> None:
        self.delay_s = delay_s
        self.fail = fail
        self.batches: list[list[str]] = []
        self.observed: list[str] = []

    @handler
    async def predict_batch(self, body: Any) -> Any:
        self.batches.append([r["request_id"] for r in body["requests"]])
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("the predictor is broken")
        sizes = {tuple(LONG_PROMPT): 40.0, tuple(SHORT_PROMPT): 3.0}
        return {"predicted_lens": [sizes.get(tuple(r["prompt_ids"]), 20.0) for r in body["requests"]]}

    @handler
    async def predict(self, body: Any) -> Any:
        """One request (what a scheduler that predicted one request at a time asked)."""
        reply = await self.predict_batch({"requests": [body]})
        return {"predicted_len": reply["predicted_lens"][0]}

    @handler
    async def observe(self, body: Any) -> None:
        self.observed.append(body["request_id"])


def body(rid: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"request_id": rid, "prompt_ids": prompt, "speculate": "none",
            "params": {"max_new_tokens": max_tokens}, **extra}


async def run(scheduler: ActorRef, rid: str, prompt: list[int], max_tokens: int,
              first_token: asyncio.Event | None = None, **extra: Any) -> dict[str, Any]:
    """Drain one generate stream; returns its final item (the summary)."""
    stream = scheduler.ask_stream("generate", body(rid, prompt, max_tokens, **extra))
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        async for item in stream:
            if item["token_ids"] and first_token is not None:
                first_token.set()
            if item.get("done"):
                return dict(item)
    raise AssertionError(f"{rid}: the stream ended without a final item")


def config(num_rows: int, **overrides: Any) -> SchedulerConfig:
    return SchedulerConfig(**{"num_rows": num_rows, "row_capacity": 256, "vocab_size": 100, "max_tree_nodes": 4,
                              "policy": "ssjf", "max_wait_s": 600.0, "step_timeout_s": 10.0,
                              "max_decode_steps": 1, **overrides})


async def host_scheduler(rt: Runtime, step_s: float, predictor: SlowPredictor, num_rows: int = 1,
                         **overrides: Any) -> ActorRef:
    """A scheduler on ``rt`` over a stand-in verifier taking ``step_s`` a step and ``predictor``."""
    verifier = await rt.node.host("verifier", StepVerifier(step_s=step_s))
    predictor_ref = await rt.node.host("predictor", predictor)
    return await rt.node.host("scheduler", SchedulerActor(config(num_rows, **overrides), [verifier],
                                                          predictor=predictor_ref))


async def test_a_request_at_an_idle_server_is_admitted_without_waiting_for_its_prediction() -> None:
    async with Runtime() as rt:
        slow = SlowPredictor(delay_s=2.0)
        scheduler = await host_scheduler(rt, 0.01, slow, num_rows=2)
        done = await asyncio.wait_for(run(scheduler, "a", LONG_PROMPT, 3), 10)
        assert done["queue_s"] < 0.5 and done["total_s"] < 1.0  # not the predictor's 2 s
        assert "predicted_len" not in done  # the prediction had not landed when it ended
        assert slow.batches == [["a"]]  # it was still asked (the learner and the summary use it)


async def test_a_queued_request_is_queued_at_once_and_rekeyed_when_its_prediction_lands() -> None:
    async with Runtime() as rt:
        slow = SlowPredictor(delay_s=0.2)
        scheduler = await host_scheduler(rt, 0.02, slow, num_rows=1)
        finished: list[str] = []
        holding = asyncio.Event()
        blocker = asyncio.ensure_future(run(scheduler, "blocker", [9, 9], 60, holding))  # ~1.2 s on the only row
        await asyncio.wait_for(holding.wait(), 10)
        early = asyncio.ensure_future(run(scheduler, "early-long", LONG_PROMPT, 50))
        early.add_done_callback(lambda _: finished.append("early-long"))
        await asyncio.sleep(0.05)  # arrives strictly first
        stats = await scheduler.ask("stats")
        assert stats["num_queued"] == 1  # queued while its prediction is still running
        late = asyncio.ensure_future(run(scheduler, "late-short", SHORT_PROMPT, 50))
        late.add_done_callback(lambda _: finished.append("late-short"))
        await asyncio.wait_for(blocker, 20)
        early_done, late_done = await asyncio.wait_for(asyncio.gather(early, late), 20)
        # Both were queued on max_tokens (a tie broken by arrival); the predictions re-keyed them.
        assert finished == ["late-short", "early-long"]
        assert late_done["predicted_len"] == 3.0 and early_done["predicted_len"] == 40.0
        stats = await scheduler.ask("stats")
        assert stats["num_rekeyed"] == 2 and stats["num_predicted"] == 3
        # Aging counts from arrival: the early request's wait includes its time before the re-key.
        assert early_done["queue_s"] > late_done["queue_s"] > 0.5


async def test_requests_that_arrive_during_a_prediction_share_the_next_batch() -> None:
    async with Runtime() as rt:
        slow = SlowPredictor(delay_s=0.3)
        scheduler = await host_scheduler(rt, 0.02, slow, num_rows=1, max_predict_batch=4)
        first = asyncio.ensure_future(run(scheduler, "r0", [9, 9], 30))
        await asyncio.sleep(0.1)  # r0's prediction is in flight
        rest = [asyncio.ensure_future(run(scheduler, f"r{i}", [10 + i], 5)) for i in range(1, 6)]
        await asyncio.wait_for(asyncio.gather(first, *rest), 20)
        # One call for r0, then the five that waited meanwhile: at most 4 a call, queued ones first.
        assert slow.batches[0] == ["r0"]
        assert [len(b) for b in slow.batches[1:]] == [4, 1]
        assert sorted(r for b in slow.batches for r in b) == sorted(f"r{i}" for i in range(6))


async def test_a_failing_predictor_leaves_requests_keyed_by_max_tokens_and_served() -> None:
    async with Runtime() as rt:
        scheduler = await host_scheduler(rt, 0.01, SlowPredictor(delay_s=0.0, fail=True))
        done = await asyncio.wait_for(asyncio.gather(*(run(scheduler, f"r{i}", [5, i], 4) for i in range(3))), 10)
        assert all(d["num_generated_tokens"] == 4 and "predicted_len" not in d for d in done)
        stats = await scheduler.ask("stats")
        assert stats["num_predictor_failures"] == 3 and stats["num_predicted"] == 0


async def test_a_client_length_hint_replaces_the_prediction() -> None:
    async with Runtime() as rt:
        slow = SlowPredictor(delay_s=0.05)
        scheduler = await host_scheduler(rt, 0.02, slow, num_rows=1)
        finished: list[str] = []
        holding = asyncio.Event()
        blocker = asyncio.ensure_future(run(scheduler, "blocker", [9, 9], 30, holding))
        await asyncio.wait_for(holding.wait(), 10)
        # SHORT_PROMPT is predicted 3 tokens, but its client says 45: the hint wins (and is not predicted).
        hinted = asyncio.ensure_future(run(scheduler, "hinted", SHORT_PROMPT, 50, length_hint=45))
        hinted.add_done_callback(lambda _: finished.append("hinted"))
        await asyncio.sleep(0.05)
        plain = asyncio.ensure_future(run(scheduler, "plain", LONG_PROMPT, 50))  # predicted 40 < 45
        plain.add_done_callback(lambda _: finished.append("plain"))
        await asyncio.wait_for(asyncio.gather(blocker, hinted, plain), 20)
        assert finished == ["plain", "hinted"]
        assert all("hinted" not in b for b in slow.batches)
        stats = await scheduler.ask("stats")
        assert stats["num_hinted"] == 1

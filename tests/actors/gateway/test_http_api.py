"""The OpenAI-compatible HTTP API against a real server (tiny random model in child processes),
driven by the official ``openai`` package, next to the ZeroMQ gateway on the same server.

One server serves the whole module (its loop is the module's). Tests compare with what the
ZeroMQ client gets for the same request, since both take one request path; counters are read as
differences, so the order of the tests does not matter.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

import http_helpers as helpers  # registered by conftest.py

from treeserve.client import Client

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

MODEL = helpers.MODEL
GREEDY = {"temperature": 0, "extra_body": {"treeserve": {"speculate": "none"}}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Any]:
    folder = helpers.write_chat_model(tmp_path_factory.mktemp("tiny") / "model")
    async with helpers.ProxiedServer(helpers.http_config(folder, bind="tcp://127.0.0.1:0")) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def api(server: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest_asyncio.fixture(loop_scope="module")
async def zmq(server: Any) -> AsyncIterator[Client]:
    async with Client(server.endpoint) as client:
        yield client


async def scrape(server: Any) -> dict[Any, float]:
    async with httpx.AsyncClient() as http:
        response = await http.get(f"{server.http_url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return dict(helpers.metric_samples(response.text))


def sample(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_models_and_health(server: Any, api: openai.AsyncOpenAI) -> None:
    listed = await api.models.list()
    assert [m.id for m in listed.data] == [MODEL] and listed.data[0].owned_by == "treeserve"
    assert (await api.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await api.models.retrieve("gpt-4o")
    async with httpx.AsyncClient() as http:
        health = await http.get(f"{server.http_url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ready", "failures": []}


async def test_chat_completion_is_the_zmq_gateways_answer(api: openai.AsyncOpenAI, zmq: Client) -> None:
    messages = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w7 w9"}]
    done = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY)  # type: ignore[arg-type]
    wire = await zmq.generate(messages, max_tokens=12, speculate="none")
    [choice] = done.choices
    assert choice.message.role == "assistant" and choice.message.content == wire.text
    assert choice.finish_reason == wire.finish_reason == "length"
    assert done.object == "chat.completion" and done.model == MODEL and done.id.startswith("chatcmpl-")
    # The template: " w5 w20 w21 w5 w7 w9 w6" is 7 tokens.
    assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (7, 12)
    assert done.usage.total_tokens == 19
    stats = (done.model_extra or {})["treeserve"]
    assert stats["speculate"] == "none" and stats["num_steps"] == 12 and stats["mean_accepted_per_step"] == 1.0
    # max_completion_tokens is the newer name of the same limit.
    newer = await api.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5, **GREEDY)  # type: ignore[arg-type]
    assert newer.usage is not None and newer.usage.completion_tokens == 5
    assert wire.text.startswith(newer.choices[0].message.content or "?")


async def test_completion_text_and_token_prompts(api: openai.AsyncOpenAI, zmq: Client) -> None:
    wire = await zmq.generate("w5 w9 w11", max_tokens=16, speculate="none")
    text = await api.completions.create(model=MODEL, prompt="w5 w9 w11", **GREEDY)  # OpenAI's default: 16 tokens
    ids = await api.completions.create(model=MODEL, prompt=[5, 9, 11], max_tokens=16, **GREEDY)
    for done in (text, ids):
        [choice] = done.choices
        assert done.object == "text_completion" and choice.text == wire.text
        assert choice.finish_reason == wire.finish_reason
        assert done.usage is not None and done.usage.completion_tokens == len(wire.token_ids)
        assert done.usage.prompt_tokens == 3


async def test_streaming_chat_with_usage(api: openai.AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": "w30 w31 w32"}]
    whole = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, **GREEDY)  # type: ignore[arg-type]
    stream = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, stream=True,  # type: ignore[call-overload]
                                               stream_options={"include_usage": True}, **GREEDY)
    chunks = [chunk async for chunk in stream]
    *choice_chunks, usage_chunk = chunks
    assert choice_chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in choice_chunks) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in choice_chunks][-1] == whole.choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert len([c for c in choice_chunks if c.choices[0].delta.content]) > 1  # it streamed, not one blob
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.model_dump() == whole.usage.model_dump() if whole.usage else False
    assert (choice_chunks[-1].model_extra or {})["treeserve"]["num_steps"] == 20
    # Without include_usage no chunk carries usage.
    plain = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True, **GREEDY)  # type: ignore[call-overload]
    assert all(c.usage is None and c.choices for c in [c async for c in plain])


async def test_stop_strings_end_the_text_before_them(api: openai.AsyncOpenAI) -> None:
    full = await api.completions.create(model=MODEL, prompt="w40 w41 w42", max_tokens=30, **GREEDY)
    text = full.choices[0].text
    assert len(text) > 40, text
    stop = text[len(text) // 2:][:4]
    cut = await api.completions.create(model=MODEL, prompt="w40 w41 w42", max_tokens=30, stop=[stop, "never!"],
                                       **GREEDY)
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage is not None and full.usage is not None and cut.usage.completion_tokens < 30
    assert (cut.model_extra or {})["treeserve"]["matched_stop"] == stop
    stream = await api.completions.create(model=MODEL, prompt="w40 w41 w42", max_tokens=30, stop=stop, stream=True,
                                          **GREEDY)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == cut.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_same_seed_same_text(api: openai.AsyncOpenAI) -> None:
    async def sampled(seed: int) -> str:
        done = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "w11 w12"}], max_tokens=24, temperature=0.9, seed=seed,
            extra_body={"treeserve": {"speculate": "none"}})
        return done.choices[0].message.content or ""

    first = await sampled(42)
    assert await sampled(42) == first
    assert await sampled(43) != first  # a different seed draws differently (24 tokens of ~94)


async def test_speculation_extension(api: openai.AsyncOpenAI) -> None:
    prompt = "w40 w41 w42 w43 w40 w41 w42 w43 w40 w41"
    plain = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
    tree = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"treeserve": {"speculate": "tree"}})
    assert tree.choices[0].text == plain.choices[0].text  # float32 greedy: speculation is lossless
    tree_stats, plain_stats = (tree.model_extra or {})["treeserve"], (plain.model_extra or {})["treeserve"]
    assert tree_stats["speculate"] == "tree" and plain_stats["speculate"] == "none"
    assert plain.usage is not None and tree.usage is not None
    num_tokens = plain.usage.completion_tokens
    assert tree.usage.completion_tokens == num_tokens and num_tokens > 3
    assert plain_stats["num_steps"] == num_tokens and plain_stats["mean_accepted_per_step"] == 1.0
    # Each step emits its accepted tokens (one at least); the last step may emit more than were kept.
    assert tree_stats["num_steps"] * tree_stats["mean_accepted_per_step"] >= num_tokens
    with pytest.raises(openai.BadRequestError, match="speculate"):
        await api.completions.create(model=MODEL, prompt=prompt, extra_body={"treeserve": {"speculate": "wide"}})


async def test_closing_a_stream_cancels_it_and_frees_its_row(server: Any, api: openai.AsyncOpenAI) -> None:
    """A client that leaves mid-stream, and one that leaves while its request still waits in
    the queue (nothing written to it yet), both cancel their request: the scheduler counts the
    cancels and every row is free again, although none of them ran to its end."""
    before = await server.scheduler.ask("stats")
    metrics_before = await scrape(server)
    server.verifier_proxy.step_delay_s = 0.1  # 120 tokens take 12 s: the streams are still running
    try:
        streams = []
        for prompt in ("w5 w6 w7", "w8 w9 w10"):  # both rows
            stream = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=120, stream=True, **GREEDY)
            async for chunk in stream:
                if chunk.choices[0].text:
                    break
            streams.append(stream)
        stats = await server.scheduler.ask("stats")
        assert stats["num_free_rows"] == 0 and stats["num_running"] == 2
        queued = asyncio.ensure_future(api.completions.create(model=MODEL, prompt="w11", max_tokens=120, **GREEDY))
        stats = await helpers.wait_for_stats(server, lambda st: st["num_queued"] == 1)
        assert stats["num_queued"] == 1
        queued.cancel()  # the client hangs up while its request waits for a row
        stats = await helpers.wait_for_stats(server, lambda st: st["num_queued"] == 0)
        assert stats["num_queued"] == 0 and stats["num_cancelled"] == before["num_cancelled"] + 1
        for stream in streams:
            await stream.close()
        stats = await helpers.wait_for_stats(server, lambda st: st["num_free_rows"] == 2 and st["num_running"] == 0)
    finally:
        server.verifier_proxy.step_delay_s = 0.0
    assert stats["num_free_rows"] == 2 and stats["num_running"] == 0
    assert stats["num_cancelled"] == before["num_cancelled"] + 3
    assert stats["num_completed"] == before["num_completed"]  # none of them ran to its end
    after = await scrape(server)
    cancelled = sample(after, "treeserve_http_requests_total", endpoint="completions", outcome="cancelled", code="none")
    assert cancelled == sample(metrics_before, "treeserve_http_requests_total", endpoint="completions",
                               outcome="cancelled", code="none") + 3
    # The freed rows serve the next request.
    done = await asyncio.wait_for(api.completions.create(model=MODEL, prompt="w5", max_tokens=4, **GREEDY), 30)
    assert done.usage is not None and done.usage.completion_tokens == 4


async def test_sse_framing_byte_for_byte(server: Any, api: openai.AsyncOpenAI) -> None:
    body = {"model": MODEL, "prompt": "w50 w51", "max_tokens": 9, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "treeserve": {"speculate": "none"}}
    async with httpx.AsyncClient() as http, \
            http.stream("POST", f"{server.http_url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        raw = b"".join([part async for part in response.aiter_raw()])
    assert raw.endswith(b"\n\ndata: [DONE]\n\n") and b"\r" not in raw
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    chunks = []
    for event in events[:-2]:
        assert event.startswith(b"data: {") and b"\n" not in event, event  # one data line per event
        chunks.append(json.loads(event[len(b"data: "):]))
    # Re-encoding compactly gives the same bytes: nothing else (comments, event names, ids) is sent.
    assert raw == b"".join(b"data: " + json.dumps(c, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
                           for c in chunks) + b"data: [DONE]\n\n"
    *text_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 9
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = await api.completions.create(model=MODEL, prompt="w50 w51", max_tokens=9, **GREEDY)
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole.choices[0].text


async def test_metrics_move_with_traffic(server: Any, api: openai.AsyncOpenAI, zmq: Client) -> None:
    before = await scrape(server)
    done = await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w60 w61"}],
                                             max_tokens=10, **GREEDY)  # type: ignore[arg-type]
    assert done.usage is not None
    await zmq.generate("w62 w63", max_tokens=6, speculate="none")
    with pytest.raises(openai.NotFoundError):
        await api.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "w1"}])
    after = await scrape(server)

    def moved(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert moved("treeserve_http_requests_total", endpoint="chat", outcome="completed", code="none") == 1
    assert moved("treeserve_http_requests_total", endpoint="chat", outcome="error", code="model_not_found") == 1
    assert moved("treeserve_zmq_requests_total", outcome="completed") == 1
    assert moved("treeserve_generated_tokens_total") == 10 + 6
    assert moved("treeserve_prompt_tokens_total") == done.usage.prompt_tokens + 2
    assert moved("treeserve_requests_finished_total", finish_reason="length") == 2
    # Without speculation every step emits one token per row: 16 observations of 1.
    assert moved("treeserve_accepted_tokens_per_step_count") == 16
    assert moved("treeserve_accepted_tokens_per_step_sum") == 16
    assert moved("treeserve_scheduler_step_seconds_count") >= 10  # the two may share steps
    for histogram in ("treeserve_time_to_first_token_seconds", "treeserve_request_latency_seconds",
                      "treeserve_time_per_output_token_seconds", "treeserve_request_queue_seconds"):
        assert moved(f"{histogram}_count") == 2, histogram
        assert moved(f"{histogram}_sum") > 0 or histogram == "treeserve_request_queue_seconds", histogram
    assert sample(after, "treeserve_queue_length") == 0 and sample(after, "treeserve_running_rows") == 0
    assert sample(after, "treeserve_free_rows") == 2 and sample(after, "treeserve_http_requests_in_flight") == 0
    assert sample(after, "treeserve_state", state="ready") == 1 and sample(after, "treeserve_state", state="starting") == 0
    restarts = {labels: value for (name, labels), value in after.items() if name == "treeserve_child_restarts_total"}
    assert {dict(k)["supervisor"] for k in restarts} == {"verifier-supervisor", "speculator-supervisor",
                                                         "scheduler-supervisor"}
    assert set(restarts.values()) == {0.0}

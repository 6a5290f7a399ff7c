"""Every bad input gets a typed error reply, and the gateway keeps serving others."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from treeserve.actors.gateway.actor import GatewayConfig
from treeserve_testing.gateway_fakes import fake_gateway
from treeserve.client import Client, InvalidRequestError, ServerError
from treeserve.transport.codec import decode, encode
from treeserve.transport.messages import Error, Message, Request, StreamEnd

pytestmark = pytest.mark.timeout(60)

CONTEXT = 64
PROMPT_CHARS = 100
CONFIG = GatewayConfig(bind="tcp://127.0.0.1:0", context_length=CONTEXT, max_prompt_chars=PROMPT_CHARS)

# (body, words the error message must contain)
BAD_BODIES: list[tuple[Any, str]] = [
    ("just a string", "must be a map"),
    ({}, "exactly one of"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one of"),
    ({"prompt": ""}, "'prompt' is empty"),
    ({"prompt": 7}, "'prompt' must be a str, got int"),
    ({"prompt": "x" * (PROMPT_CHARS + 1)}, "at most 100"),
    ({"prompt": "é" * (CONTEXT // 2)}, "the context holds 64 tokens"),  # 64 tokens
    ({"prompt_ids": []}, "'prompt_ids' is empty"),
    ({"prompt_ids": [260]}, "outside the vocabulary"),
    ({"prompt_ids": [-1]}, "outside the vocabulary"),
    ({"prompt_ids": [1.5]}, "must be an int"),
    ({"prompt_ids": list(range(CONTEXT))}, "at most 63"),
    ({"messages": []}, "non-empty array"),
    ({"messages": [{"role": "user"}]}, "content must be a str, got nil"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "unknown field"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role must be one of"),
    ({"prompt": "x", "max_tokens": 0}, "'max_tokens' must be in [1, 63]"),
    ({"prompt": "x", "max_tokens": -5}, "'max_tokens' must be in"),
    ({"prompt": "x", "max_tokens": CONTEXT}, "'max_tokens' must be in"),
    ({"prompt": "x", "max_tokens": 2.0}, "'max_tokens' must be an int"),
    ({"prompt": "x", "max_tokens": True}, "'max_tokens' must be an int"),
    ({"prompt": "x", "temperature": -0.1}, "'temperature' must be >= 0"),
    ({"prompt": "x", "temperature": math.nan}, "'temperature' must be finite"),
    ({"prompt": "x", "temperature": "hot"}, "'temperature' must be a number"),
    ({"prompt": "x", "top_p": 0}, "'top_p' must be in (0, 1]"),
    ({"prompt": "x", "top_p": 1.5}, "'top_p' must be in (0, 1]"),
    ({"prompt": "x", "top_k": 0}, "'top_k'"),
    ({"prompt": "x", "top_k": True}, "'top_k'"),
    ({"prompt": "x", "seed": -1}, "'seed'"),
    ({"prompt": "x", "stop_token_ids": [999]}, "outside the vocabulary"),
    ({"prompt": "x", "speculate": "beam"}, "'speculate' must be one of"),
    ({"prompt": "x", "stop": [""]}, "'stop'[0] must be a non-empty str"),
    ({"prompt": "x", "stops": ["\n"]}, "unknown field(s) ['stops']"),
    ({"prompt": "x", "temprature": 0.5}, "unknown field(s) ['temprature']"),
]


async def _raw_call(endpoint: str, *frames_list: list[bytes]) -> list[Message]:
    """Send raw messages from a fresh DEALER and collect one answer per message."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        answers = []
        for frames in frames_list:
            await sock.send_multipart(frames)
            assert await sock.poll(5000), "no answer from the gateway"
            answers.append(decode(await sock.recv_multipart()))
        return answers
    finally:
        sock.close(linger=0)
        ctx.term()


def _request(msg_id: int, body: Any, *, method: str = "generate", stream: bool = True,
             target: str = "gateway") -> list[bytes]:
    return [bytes(f) for f in encode(Request(msg_id, target, method, body, None, stream))]


@pytest.mark.parametrize(("body", "words"), BAD_BODIES, ids=[f"bad{i}" for i in range(len(BAD_BODIES))])
async def test_bad_body_gets_invalid_request_and_others_are_served(body: Any, words: str) -> None:
    async with fake_gateway(CONFIG) as (gw, fake):
        [answer] = await _raw_call(gw.endpoint, _request(7, body))
        assert isinstance(answer, Error), answer
        assert answer.id == 7 and answer.code == "invalid_request" and not answer.retryable
        assert words in answer.message
        async with Client(gw.endpoint, timeout=20) as other:  # a second client is served
            assert (await other.generate("ok", max_tokens=3)).text == "oko"
    assert len(fake.bodies) == 1, "a bad request reached the scheduler"


async def test_bad_override_raises_typed_error_in_the_client() -> None:
    async with fake_gateway(CONFIG) as (gw, _):
        async with Client(gw.endpoint, timeout=20) as client:
            with pytest.raises(InvalidRequestError, match="'top_p' must be in") as info:
                await client.generate("x", top_p=2.0)
            assert info.value.code == "invalid_request" and info.value.retryable is False
            with pytest.raises(InvalidRequestError, match="unknown field"):
                async for _ in client.stream("x", frequency_penalty=1.0):
                    pass
            assert (await client.generate("fine", max_tokens=4)).text == "fine"


async def test_protocol_level_errors_are_answered() -> None:
    big = "y" * (1024 * 1024 + 10)  # header above the gateway's 1 MiB limit
    bad_version = msgpack.packb({"v": 2, "kind": "request", "id": 5})
    async with fake_gateway(CONFIG) as (gw, _):
        answers = await _raw_call(
            gw.endpoint,
            [b"\xc1 not msgpack"],
            [bad_version],
            [msgpack.packb({"v": 1, "kind": "nope", "id": 6})],
            [*_request(8, {"prompt": "x"}), b"extra frame"],
            [msgpack.packb({"v": 1, "kind": "request", "id": 9, "target": "gateway",
                            "method": "generate", "body": {"prompt": big}, "stream": True})],
            _request(10, {"prompt": "x"}, target="scheduler"),
            _request(11, {"prompt": "x"}, method="shutdown"),
            _request(12, {"prompt": "x"}, stream=False),
            _request(13, None, method="info", stream=True),
            _request(14, None, method="info", stream=False),
        )
        codes = [(a.id, a.code) if isinstance(a, Error) else (a.id, type(a).__name__) for a in answers]
        assert codes == [
            (None, "bad_message"),
            (5, "unsupported_version"),
            (6, "unknown_kind"),
            (None, "too_large"),  # frame count is checked before the header is read
            (None, "too_large"),
            (10, "no_such_actor"),
            (11, "no_such_method"),
            (12, "invalid_request"),
            (13, "invalid_request"),
            (14, "Reply"),
        ]
        assert gw.stats_counters.num_bad_messages == 5
        async with Client(gw.endpoint, timeout=20) as other:
            assert (await other.generate("still", max_tokens=5)).text == "still"


async def test_request_id_reuse_while_open_is_refused() -> None:
    async with fake_gateway(CONFIG, scheduler={"delay_s": 0.2}) as (gw, _):
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(gw.endpoint)
        try:
            await sock.send_multipart(_request(1, {"prompt": "ab", "max_tokens": 2}))
            await sock.send_multipart(_request(1, {"prompt": "cd", "max_tokens": 2}))
            seen: list[Message] = []
            while not any(isinstance(m, StreamEnd) for m in seen):
                assert await sock.poll(5000)
                seen.append(decode(await sock.recv_multipart()))
            errors = [m for m in seen if isinstance(m, Error)]
            assert len(errors) == 1 and errors[0].code == "invalid_request" and "already in use" in errors[0].message
        finally:
            sock.close(linger=0)
            ctx.term()


async def test_oversized_request_is_refused_before_sending() -> None:
    async with fake_gateway(CONFIG) as (gw, _):
        async with Client(gw.endpoint, timeout=20) as client:
            with pytest.raises(InvalidRequestError) as info:
                await client.generate("z" * (2 * 1024 * 1024))
            assert info.value.code == "too_large"
            assert isinstance(info.value, ServerError)
            assert (await client.generate("ok", max_tokens=2)).text == "ok"


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="context_length"):
        GatewayConfig(context_length=0)
    with pytest.raises(ValueError, match="bind"):
        GatewayConfig(bind="http://x")
    with pytest.raises(ValueError, match="heartbeat"):
        GatewayConfig(disconnect_timeout_s=0.5, heartbeat_interval_s=0.5)

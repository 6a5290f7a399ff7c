"""``treeserve.client.Client`` against bare sockets: request bodies, error mapping,
liveness, deadlines and closing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from treeserve.client import (
    Client,
    ClientClosedError,
    ConnectionLostError,
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    RequestCancelledError,
    ServerError,
    UnavailableError,
    _request_body,
)
from treeserve.ops.sampling import SamplingParams
from treeserve.transport.codec import decode, encode
from treeserve.transport.messages import Cancel, Error, Heartbeat, Request
from treeserve.transport.wire import ErrorCode

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def router() -> AsyncIterator[tuple[str, zmq.asyncio.Socket]]:
    """A bare ROUTER standing in for the gateway; the test drives its answers."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:0")
    try:
        yield sock.getsockopt_string(zmq.LAST_ENDPOINT), sock
    finally:
        sock.close(linger=0)
        ctx.term()


async def _recv(sock: zmq.asyncio.Socket) -> tuple[bytes, object]:
    assert await sock.poll(5000), "nothing from the client"
    peer, *frames = await sock.recv_multipart()
    return peer, decode(frames)


def test_request_body_from_params_prompt_kinds_and_overrides() -> None:
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.8, seed=9, stop_token_ids=(3,), max_new_tokens=12)
    assert _request_body("hi", params, "tree", {"max_tokens": 5}) == {
        "prompt": "hi", "temperature": 0.5, "top_p": 0.8, "max_tokens": 5, "top_k": 4, "seed": 9,
        "stop_token_ids": [3], "speculate": "tree",
    }
    with pytest.warns(DeprecationWarning, match="max_new_tokens is deprecated"):
        assert _request_body("hi", None, "tree", {"max_new_tokens": 5})["max_tokens"] == 5
    with pytest.raises(TypeError, match="max_tokens only"):
        _request_body("hi", None, "tree", {"max_new_tokens": 5, "max_tokens": 5})
    assert _request_body([{"role": "user", "content": "x"}], None, "none", {}) == {
        "messages": [{"role": "user", "content": "x"}], "speculate": "none"}
    assert _request_body([1, 2], None, "chain", {"temperature": 0}) == {
        "prompt_ids": [1, 2], "speculate": "chain", "temperature": 0}
    with pytest.raises(TypeError):
        _request_body(3.5, None, "tree", {})  # type: ignore[arg-type]


def test_request_body_sends_a_length_hint_only_when_given() -> None:
    assert _request_body("hi", None, "none", {}, 40) == {"prompt": "hi", "speculate": "none", "length_hint": 40}
    assert "length_hint" not in _request_body("hi", None, "none", {}, None)  # old servers refuse unknown keys
    # The client sends what it is given: the gateway checks it once, where it enters
    # (tests/actors/gateway/test_gateway_body_rules.py).
    assert _request_body("hi", None, "none", {}, 0)["length_hint"] == 0


@pytest.mark.parametrize(("code", "cls", "retryable"), [
    (ErrorCode.INVALID_REQUEST, InvalidRequestError, False),
    (ErrorCode.OVERLOADED, OverloadedError, True),
    (ErrorCode.UNAVAILABLE, UnavailableError, True),
    (ErrorCode.DEADLINE_EXCEEDED, DeadlineExceededError, False),
    (ErrorCode.CANCELLED, RequestCancelledError, False),
    (ErrorCode.INTERNAL, ServerError, False),
])
async def test_server_errors_become_typed_exceptions(
    router: tuple[str, zmq.asyncio.Socket], code: ErrorCode, cls: type[ServerError], retryable: bool
) -> None:
    endpoint, sock = router
    async with Client(endpoint, timeout=10) as client:
        task = asyncio.create_task(client.generate("x"))
        peer, req = await _recv(sock)
        assert isinstance(req, Request) and req.target == "gateway" and req.method == "generate" and req.stream
        # The budget left after the wait for the connection (a few ms here).
        assert req.timeout_ms is not None and 9_000 < req.timeout_ms <= 10_000
        assert req.body == {"prompt": "x", "speculate": "tree"}
        await sock.send_multipart([peer, *encode(Error(req.id, code, "nope", retryable))])
        with pytest.raises(cls) as info:
            await task
    assert type(info.value) is cls
    assert (info.value.code, info.value.message, info.value.retryable) == (code.value, "nope", retryable)


async def test_silent_gateway_fails_calls_with_connection_lost(router: tuple[str, zmq.asyncio.Socket]) -> None:
    endpoint, sock = router
    # server_timeout_s is 20 heartbeats: the first heartbeat goes out even if this loop stalls.
    async with Client(endpoint, heartbeat_interval_s=0.05, server_timeout_s=1.0) as client:
        task = asyncio.create_task(client.generate("x"))
        _, req = await _recv(sock)
        _, beat = await _recv(sock)  # the client heartbeats while a call is open
        assert isinstance(beat, Heartbeat)
        with pytest.raises(ConnectionLostError) as info:
            await task
        assert info.value.retryable


async def test_a_dropped_gateway_connection_fails_calls_at_once(router: tuple[str, zmq.asyncio.Socket]) -> None:
    endpoint, sock = router
    # Far longer than the test may take: only the lost connection can end the call in time.
    async with Client(endpoint, heartbeat_interval_s=10, server_timeout_s=60) as client:
        task = asyncio.create_task(client.generate("x"))
        await _recv(sock)
        sock.close(linger=0)  # the gateway process is gone: its side of the connection closes
        async with asyncio.timeout(10):
            with pytest.raises(ConnectionLostError) as info:
                await task
        assert info.value.retryable and "lost" in info.value.message


async def test_client_deadline_and_cancel_on_give_up(router: tuple[str, zmq.asyncio.Socket]) -> None:
    endpoint, sock = router
    async with Client(endpoint, timeout=0.2, heartbeat_interval_s=10) as client:
        with pytest.raises(DeadlineExceededError):
            await client.generate("x")
        _, req = await _recv(sock)
        _, cancel = await _recv(sock)
        assert isinstance(req, Request) and cancel == Cancel(req.id)


async def test_aclose_is_idempotent_and_fails_open_calls(router: tuple[str, zmq.asyncio.Socket]) -> None:
    endpoint, sock = router
    client = Client(endpoint)
    client.connect()
    task = asyncio.create_task(client.generate("x"))
    await _recv(sock)
    await client.aclose()
    await client.aclose()
    with pytest.raises(ClientClosedError):
        await task
    with pytest.raises(ClientClosedError):
        await client.info()


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="timeout"):
        Client("tcp://127.0.0.1:5555", timeout=0)
    with pytest.raises(ValueError, match="heartbeat"):
        Client("tcp://127.0.0.1:5555", heartbeat_interval_s=-1)

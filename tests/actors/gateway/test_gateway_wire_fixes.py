"""The gateway's wire-level promises (``transport/PROTOCOL.md`` 2, 6, 11.5), driven from a bare
DEALER: an error never looks like the end of a request it does not end (an ``id`` only when it
ends that request); answers from a client are never answered; a stream the gateway ends for
client silence or a lost connection gets a final ``error``; ``info`` gives the liveness timeout;
nil for an optional header field is its default; ``timeout_ms: 0`` is the same for every method;
and error texts name wire types, never Python's."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from treeserve.actors.gateway.actor import GatewayConfig
from treeserve.client import Client
from treeserve_testing.gateway_fakes import fake_gateway
from treeserve.transport.codec import decode, encode
from treeserve.transport.messages import Error, Heartbeat, Message, Reply, Request, StreamEnd, StreamItem

pytestmark = pytest.mark.timeout(60)

CONFIG = GatewayConfig(bind="tcp://127.0.0.1:0", context_length=64, max_prompt_chars=100)
FAST_LIVENESS = GatewayConfig(bind="tcp://127.0.0.1:0", heartbeat_interval_s=0.1, disconnect_timeout_s=0.5)
SLOW = {"delay_s": 0.05, "chunk_sizes": [1]}

PYTHON_NAMES = re.compile(r"NoneType|\bTrue\b|\bFalse\b|\bNone\b|b'|b\"|\bdict\b|\blist\b|\bbytes\b|\btuple\b")


class RawClient:
    """A bare DEALER that sends whatever it is given and reports everything it receives."""

    def __init__(self, endpoint: str, identity: bytes | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(endpoint)
        self.beat_seq = 0

    async def send(self, msg: Message | dict[str, Any] | list[bytes]) -> None:
        if isinstance(msg, dict):
            await self.sock.send(msgpack.packb(msg, use_bin_type=True))
        elif isinstance(msg, list):
            await self.sock.send_multipart(msg)
        else:
            await self.sock.send_multipart(encode(msg))

    async def beat(self) -> None:
        await self.send(Heartbeat(self.beat_seq, time.time(), "raw"))
        self.beat_seq += 1

    async def recv(self, timeout_s: float = 5.0, *, heartbeats: bool = False) -> Message | None:
        """The next message (heartbeats skipped unless asked for), or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not await self.sock.poll(int(left * 1000) + 1):
                return None
            msg = decode(await self.sock.recv_multipart())
            if heartbeats or not isinstance(msg, Heartbeat):
                return msg
        return None

    async def until(self, done: Callable[[Message], bool], timeout_s: float = 10.0, *,
                    beat_every_s: float | None = None) -> list[Message]:
        """Everything received (no heartbeats) up to and including the first ``done`` message,
        heartbeating meanwhile when asked."""
        seen: list[Message] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if beat_every_s is not None:
                await self.beat()
            msg = await self.recv(beat_every_s or 0.2)
            if msg is None:
                continue
            seen.append(msg)
            if done(msg):
                return seen
        raise AssertionError(f"no final message within {timeout_s}s; got {seen}")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _generate(msg_id: int, body: dict[str, Any]) -> Request:
    return Request(msg_id, "gateway", "generate", body, None, True)


def _ends(msg_id: int) -> Callable[[Message], bool]:
    return lambda m: isinstance(m, StreamEnd | Error) and m.id == msg_id


# ------------------------------------------------------------------ fix 1: error ids


async def test_errors_about_messages_that_end_nothing_carry_no_id() -> None:
    async with fake_gateway(CONFIG, scheduler=SLOW) as (gw, _):
        raw = RawClient(gw.endpoint)
        try:
            await raw.send(_generate(1, {"prompt": "abcd", "max_tokens": 12}))
            assert isinstance(await raw.recv(), StreamItem)  # stream 1 is open
            bad_ext = msgpack.ExtType(9, b"")
            await raw.send({"v": 1, "kind": "cancel", "id": 1, "extra": bad_ext})  # malformed cancel
            await raw.send({"v": 2, "kind": "cancel", "id": 1})  # cancel of a version we do not speak
            await raw.send({"v": 1, "kind": "heartbeat", "id": 1, "seq": -1, "sent_at": 0.0})
            await raw.send(_generate(1, {"prompt": "zz"}))  # reuses the open id
            await raw.send({"v": 1, "kind": "request", "id": 1, "target": "gateway"})  # malformed, open id
            await raw.send({"v": 1, "kind": "request", "id": 5, "target": "gateway"})  # malformed, new id
            seen = await raw.until(_ends(1))
        finally:
            raw.close()
    errors = [m for m in seen if isinstance(m, Error)]
    assert sorted((e.code for e in errors if e.id is None)) == sorted(
        ["bad_message", "unsupported_version", "bad_message", "invalid_request", "bad_message"])
    assert [(e.id, e.code) for e in errors if e.id is not None] == [(5, "bad_message")]  # it ends request 5
    assert all("id 1" in e.message for e in errors if e.id is None)  # the text still names the id
    end = seen[-1]
    assert isinstance(end, StreamEnd) and end.id == 1, "stream 1 must go on to its end"
    assert end.body["text"] == "abcdabcdabcd"
    dup = next(e for e in errors if e.code == "invalid_request")
    assert "1" in dup.message and "already" in dup.message


# ------------------------------------------------------------------ fix 7: answers are never answered


async def test_malformed_answers_from_a_client_are_never_answered() -> None:
    async with fake_gateway(CONFIG) as (gw, _):
        raw = RawClient(gw.endpoint)
        try:
            for header in (
                {"v": 1, "kind": "reply", "id": "x"},
                {"v": 1, "kind": "reply", "id": 3, "body": msgpack.ExtType(9, b"")},
                {"v": 1, "kind": "stream_item", "id": 7},
                {"v": 1, "kind": "stream_end", "id": 7, "seq": -1},
                {"v": 1, "kind": "error", "id": 8},
                {"v": 1, "kind": "error", "id": 8, "code": 5, "message": "m"},
                {"v": 2, "kind": "reply", "id": 9},
            ):
                await raw.send(header)
            await raw.send(Request(20, "gateway", "info", None, None, False))
            first = await raw.recv()
            assert isinstance(first, Reply) and first.id == 20, f"an answer was answered: {first}"
            assert await raw.recv(0.3) is None
        finally:
            raw.close()
    assert gw.stats_counters.num_bad_messages == 7


# ------------------------------------------------------------------ fix 2: final errors, liveness in info


async def test_a_silent_client_gets_a_final_error_for_each_stream() -> None:
    async with fake_gateway(FAST_LIVENESS, scheduler={"delay_s": 30.0}) as (gw, fake):
        raw = RawClient(gw.endpoint)
        try:
            await raw.send(_generate(1, {"prompt": "abc", "max_tokens": 10}))
            await raw.send(_generate(2, {"prompt": "def", "max_tokens": 10}))
            errors = [await raw.recv(3.0), await raw.recv(3.0)]
        finally:
            raw.close()
    assert all(isinstance(e, Error) for e in errors), errors
    assert sorted(e.id for e in errors if isinstance(e, Error)) == [1, 2]
    for err in errors:
        assert isinstance(err, Error) and err.code == "cancelled" and err.retryable
        assert "0.5" in err.message and "heartbeat" in err.message
        assert err.details == {"reason": "client_silent", "disconnect_timeout_s": 0.5}
    assert len([e for e, _ in fake.events if e == "cancelled"]) == 2


async def test_a_stream_lost_to_a_reconnect_gets_a_final_error_after_it() -> None:
    # A frame above the gateway's 2 MiB makes ZeroMQ drop the connection; the DEALER reconnects
    # with the same routing id, and the open stream's end must reach it.
    async with fake_gateway(scheduler=SLOW) as (gw, fake):
        raw = RawClient(gw.endpoint, identity=b"raw-client-0123456789")
        try:
            await raw.send(_generate(1, {"prompt": "abc", "max_tokens": 1000}))
            assert isinstance(await raw.recv(), StreamItem)
            await raw.send([b"\x00" * (3 * 1024 * 1024)])
            seen = await raw.until(_ends(1), beat_every_s=0.1)
        finally:
            raw.close()
    err = seen[-1]
    assert isinstance(err, Error) and err.code == "cancelled" and err.retryable, seen
    assert err.details is not None and err.details["reason"] == "client_unreachable"
    assert [e for e, _ in fake.events].count("cancelled") == 1


async def test_info_reports_the_liveness_timeout_and_heartbeats_follow_the_spec() -> None:
    async with fake_gateway(FAST_LIVENESS, scheduler={"delay_s": 30.0}) as (gw, _):
        async with Client(gw.endpoint, timeout=20) as client:
            info = await client.info()
        assert info["disconnect_timeout_s"] == 0.5 and info["heartbeat_interval_s"] == 0.1
        raw = RawClient(gw.endpoint)
        try:
            await raw.send(_generate(1, {"prompt": "abc"}))
            beats = [await raw.recv(heartbeats=True) for _ in range(3)]
        finally:
            raw.close()
    assert all(isinstance(b, Heartbeat) for b in beats), beats
    assert [b.seq for b in beats if isinstance(b, Heartbeat)] == [0, 1, 2]
    assert all(b.node == "gateway" for b in beats if isinstance(b, Heartbeat))


# ------------------------------------------------------------------ fix 6: nil in headers


async def test_nil_optional_header_fields_are_their_defaults() -> None:
    async with fake_gateway(CONFIG) as (gw, _):
        raw = RawClient(gw.endpoint)
        try:
            await raw.send({"v": 1, "kind": "heartbeat", "seq": 0, "sent_at": 1.0, "node": None})
            await raw.send({"v": 1, "kind": "request", "id": 1, "target": "gateway", "method": "info",
                            "body": None, "timeout_ms": None, "stream": None})
            reply = await raw.recv()
            await raw.send({"v": 1, "kind": "request", "id": 2, "target": "gateway", "method": "generate",
                            "body": {"prompt": "ok", "max_tokens": 2}, "stream": True})
            seen = await raw.until(_ends(2))
        finally:
            raw.close()
    assert isinstance(reply, Reply) and reply.id == 1 and reply.body["model"] == ""
    assert isinstance(seen[-1], StreamEnd) and seen[-1].body["text"] == "ok"
    assert gw.stats_counters.num_bad_messages == 0


# ------------------------------------------------------------------ fix 8: timeout_ms 0


async def test_timeout_ms_zero_is_already_expired_for_every_method() -> None:
    async with fake_gateway(CONFIG) as (gw, fake):
        raw = RawClient(gw.endpoint)
        try:
            answers = []
            for msg_id, method, stream, body in ((1, "info", False, None), (2, "health", False, None),
                                                 (3, "generate", True, {"prompt": "x"}),
                                                 (4, "nope", False, None)):
                await raw.send(Request(msg_id, "gateway", method, body, 0, stream))
                answers.append(await raw.recv())
            await raw.send(Request(5, "gateway", "info", None, 1, False))  # 1 ms is still time
            last = await raw.recv()
        finally:
            raw.close()
    for msg_id, answer in enumerate(answers, 1):
        assert isinstance(answer, Error) and answer.id == msg_id, answer
        assert answer.code == "deadline_exceeded" and not answer.retryable
        assert answer.message == answers[0].message  # type: ignore[union-attr]
    assert isinstance(last, Reply) and last.id == 5
    assert fake.bodies == {}


# ------------------------------------------------------------------ fix 9: wire type names


@pytest.mark.parametrize(("header", "words"), [
    ({"v": True, "kind": "request", "id": 1}, "got bool"),
    ({"v": "1", "kind": "request", "id": 1}, "got str"),
    ({"v": 1, "kind": "request", "id": 1, "target": None, "method": "info"}, "'target' must be str, got nil"),
    ({"v": 1, "kind": "request", "id": 1, "target": "gateway", "method": b"info"}, "got bin"),
    ({"v": 1, "kind": "request", "id": 1, "target": "gateway", "method": "info", "stream": 1}, "got int"),
    ({"v": 1, "kind": "request", "id": 1, "target": "gateway", "method": "info", "timeout_ms": 1.5},
     "got float"),
    ({"v": 1, "kind": "request", "id": 1, "target": ["gateway"], "method": "info"}, "got array"),
    ({"v": 1, "kind": "request", "id": 1, "target": {"a": 1}, "method": "info"}, "got map"),
    ({"v": 1, "kind": 3, "id": 1}, "got int"),
    ({"v": 1, "kind": "request", "id": 1, "target": "gateway", "method": "info",
      "body": msgpack.ExtType(1, msgpack.packb({"dtype": "float32", "shape": [1], "frame": True}))}, "got bool"),
], ids=lambda x: str(x)[:40])
async def test_header_errors_name_wire_types(header: dict[str, Any], words: str) -> None:
    async with fake_gateway(CONFIG) as (gw, _):
        raw = RawClient(gw.endpoint)
        try:
            await raw.send(header)
            answer = await raw.recv()
        finally:
            raw.close()
    assert isinstance(answer, Error), answer
    assert words in answer.message, answer.message
    assert not PYTHON_NAMES.search(answer.message), answer.message

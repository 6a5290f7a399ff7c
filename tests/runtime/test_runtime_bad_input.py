"""Hostile bytes on a node's ROUTER: each gets an error reply or is dropped and
counted, and a well-behaved peer keeps being served throughout."""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from treeserve.runtime import Runtime, RuntimeConfig
from treeserve_testing.runtime_actors import EchoActor
from treeserve.transport.codec import decode, encode
from treeserve.transport.messages import Error, Reply, Request
from treeserve.transport.wire import ErrorCode, WireLimits

pytestmark = pytest.mark.timeout(60)

LIMITS = WireLimits(max_message_bytes=1 << 20, max_header_bytes=64 << 10, max_str_len=32 << 10)


def request_header(**changes: Any) -> bytes:
    """A valid request header frame with some fields changed."""
    header = msgpack.unpackb(encode(Request(9, "echo", "echo", "hi"))[0], raw=False)
    header.update(changes)
    return bytes(msgpack.packb(header, use_bin_type=True))


def bad_messages() -> list[tuple[str, list[bytes], ErrorCode | None]]:
    """(name, frames, expected error code or None when only dropping is acceptable)."""
    good = encode(Request(9, "echo", "echo", "hi"))
    tensor = encode(Request(9, "echo", "echo", np.zeros(16, np.float32)))
    bomb = b"\xdd\xff\xff\xff\xff"  # msgpack array header claiming 2**32-1 items
    nested = b"\x91" * 10_000 + b"\xc0"  # 10k nested arrays
    return [
        # Fixed bytes: os.urandom's occasionally began with an array/map header claiming a huge
        # length, which is answered (rightly) with TOO_LARGE, and failed this case by chance.
        ("random bytes", [random.Random(0).randbytes(64)], ErrorCode.BAD_MESSAGE),
        ("empty frame", [b""], ErrorCode.BAD_MESSAGE),
        ("wrong version", [request_header(v=99)], ErrorCode.UNSUPPORTED_VERSION),
        ("unknown kind", [request_header(kind="teleport")], ErrorCode.UNKNOWN_KIND),
        ("missing fields", [request_header(target=None)], None),
        ("oversized header", [request_header(body="x" * (100 << 10))], ErrorCode.TOO_LARGE),
        ("truncated", [bytes(good[0])[: len(good[0]) // 2]], ErrorCode.BAD_MESSAGE),
        ("tensor frame too short", [bytes(tensor[0]), bytes(tensor[1])[:10]], ErrorCode.BAD_TENSOR),
        ("tensor frame missing", [bytes(tensor[0])], ErrorCode.BAD_TENSOR),
        ("msgpack bomb", [bomb], None),
        ("deep nesting", [nested], None),
        ("unknown actor", [request_header(target="ghost")], ErrorCode.NO_SUCH_ACTOR),
        ("unknown method", [request_header(method="nope")], ErrorCode.NO_SUCH_METHOD),
    ]


async def recv_error(sock: zmq.asyncio.Socket, timeout_s: float = 2.0) -> Error | None:
    """The next message on the raw socket, if it is an Error (None when none came)."""
    try:
        frames = await asyncio.wait_for(sock.recv_multipart(), timeout_s)
    except TimeoutError:
        return None
    msg = decode(frames)
    assert isinstance(msg, Error), msg
    return msg


async def test_bad_input_gets_error_replies_and_good_peers_keep_working() -> None:
    async with Runtime(RuntimeConfig(limits=LIMITS)) as server, Runtime() as client:
        await server.spawn(EchoActor, name="echo")
        good_peer = client.ref(server.endpoint, "echo")  # a well-behaved remote caller
        ctx = zmq.asyncio.Context()
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(server.endpoint)
        try:
            for name, frames, code in bad_messages():
                before = server.node.stats.num_bad_messages + server.node.stats.num_dropped
                await bad.send_multipart(frames)
                err = await recv_error(bad, 2.0 if code is not None else 0.3)
                if code is not None:
                    assert err is not None, name
                    assert err.code is code, (name, err)
                elif err is not None:
                    assert err.code in (ErrorCode.BAD_MESSAGE, ErrorCode.TOO_LARGE), (name, err)
                stats = server.node.stats
                counted = stats.num_bad_messages + stats.num_dropped
                assert counted > before or code in (ErrorCode.NO_SUCH_ACTOR, ErrorCode.NO_SUCH_METHOD), name
                assert await good_peer.ask("echo", name, timeout=5) == name
            # The bad peer itself is still served once it behaves.
            await bad.send_multipart(encode(Request(77, "echo", "echo", "ok")))
            reply = decode(await asyncio.wait_for(bad.recv_multipart(), 5))
            assert isinstance(reply, Reply) and reply.id == 77 and reply.body == "ok"
            # A frame above MAXMSGSIZE makes zmq drop the connection; others are unaffected.
            await bad.send_multipart([b"\x00" * (2 << 20)])
            assert await recv_error(bad, 0.3) is None
            assert await good_peer.ask("echo", "still", timeout=5) == "still"
        finally:
            bad.close(linger=0)
            ctx.term()


async def test_flood_of_garbage_is_counted_and_does_not_starve_others() -> None:
    async with Runtime(RuntimeConfig(limits=LIMITS)) as server, Runtime() as client:
        await server.spawn(EchoActor, name="echo")
        good_peer = client.ref(server.endpoint, "echo")
        ctx = zmq.asyncio.Context()
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.setsockopt(zmq.SNDHWM, 100_000)
        bad.connect(server.endpoint)
        try:
            # The bad peer never reads its error replies: they must be dropped, not queued.
            for _ in range(3000):
                await bad.send_multipart([os.urandom(32)])
            answers = await asyncio.gather(*(good_peer.ask("echo", i, timeout=10) for i in range(50)))
            assert answers == list(range(50))
            async with asyncio.timeout(10):
                while server.node.stats.num_bad_messages < 3000:
                    await asyncio.sleep(0.05)
            assert server.node.stats.num_bad_messages == 3000
        finally:
            bad.close(linger=0)
            ctx.term()

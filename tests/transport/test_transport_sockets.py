"""Real ROUTER/DEALER exchanges over inproc, ipc and tcp loopback, limits and CURVE."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
import zmq
import zmq.asyncio

from treeserve.transport import (
    CurveAuthenticator,
    CurveClientConfig,
    CurveServerConfig,
    InsecureBindError,
    Reply,
    Request,
    WireLimits,
    bound_endpoint,
    decode,
    encode,
    generate_keypair,
    is_loopback_endpoint,
    make_dealer,
    make_router,
)

# Generous: these bound waits for messages that should arrive, on a shared 2-core box.
ARRIVE_S = 10.0
# How long we listen to be sure a message that must be dropped did not arrive.
SILENCE_S = 0.5


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


@pytest.fixture
def short_tmp() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tsx", dir="/tmp")  # ipc paths must stay < 107 chars
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def _recv(sock: zmq.asyncio.Socket, timeout: float = ARRIVE_S) -> list[zmq.Frame]:
    return await asyncio.wait_for(sock.recv_multipart(copy=False), timeout)


async def _is_silent(sock: zmq.asyncio.Socket) -> bool:
    return await sock.poll(timeout=int(SILENCE_S * 1000)) == 0


@pytest.mark.parametrize("scheme", ["inproc", "ipc", "tcp"])
async def test_request_reply_roundtrip(ctx: zmq.asyncio.Context, short_tmp: str, scheme: str) -> None:
    bind = {
        "inproc": "inproc://router-test",
        "ipc": f"ipc://{os.path.join(short_tmp, 's')}",
        "tcp": "tcp://127.0.0.1:0",
    }[scheme]
    limits = WireLimits(zero_copy_threshold=1024)
    router = make_router(ctx, bind, limits=limits)
    endpoint = bound_endpoint(router)
    if scheme == "tcp":
        assert not endpoint.endswith(":0")
    dealer = make_dealer(ctx, endpoint, identity=b"client-1", limits=limits)
    try:
        weights = np.arange(4096, dtype=np.float32)  # 16 KiB: sent zero-copy
        await dealer.send_multipart(encode(Request(1, "v", "verify", {"w": weights}, 500), limits))
        identity, *frames = await _recv(router)
        assert identity.bytes == b"client-1"
        request = decode(frames, limits)
        assert isinstance(request, Request) and request.timeout_ms == 500
        assert np.array_equal(request.body["w"], weights)

        reply = encode(Reply(1, request.body["w"] * 2), limits)
        assert isinstance(reply[1], memoryview)
        await router.send_multipart([identity.bytes, *reply], copy=False)
        answer = decode(await _recv(dealer), limits, tensor_type="torch")
        assert isinstance(answer, Reply) and answer.body.tolist() == (weights * 2).tolist()
    finally:
        dealer.close(linger=0)
        router.close(linger=0)


async def test_router_mandatory_reports_unknown_peer(ctx: zmq.asyncio.Context) -> None:
    router = make_router(ctx, "inproc://mandatory")
    try:
        with pytest.raises(zmq.ZMQError) as info:
            await router.send_multipart([b"nobody", *encode(Reply(1))])
        assert info.value.errno == zmq.EHOSTUNREACH
    finally:
        router.close(linger=0)


async def test_maxmsgsize_drops_oversized_and_router_keeps_serving(ctx: zmq.asyncio.Context) -> None:
    limits = WireLimits(max_message_bytes=64 * 1024, max_header_bytes=4096)
    router = make_router(ctx, "tcp://127.0.0.1:0", limits=limits)
    endpoint = bound_endpoint(router)
    big_sender = make_dealer(ctx, endpoint, identity=b"big")
    good_sender = make_dealer(ctx, endpoint, identity=b"good", limits=limits)
    try:
        # The sender uses default limits, so only the receiving router's MAXMSGSIZE stops it.
        await big_sender.send_multipart(encode(Reply(1, np.zeros(32 * 1024))))  # 256 KiB frame
        await good_sender.send_multipart(encode(Request(2, "t", "m"), limits))
        identity, *frames = await _recv(router)
        assert identity.bytes == b"good"
        assert decode(frames, limits) == Request(2, "t", "m")
        assert await _is_silent(router)
        # Still serving: a second round trip with the good peer works.
        await router.send_multipart([b"good", *encode(Reply(2, "ok"), limits)])
        assert decode(await _recv(good_sender), limits) == Reply(2, "ok")
        await good_sender.send_multipart(encode(Request(3, "t", "m"), limits))
        identity, *frames = await _recv(router)
        assert (identity.bytes, decode(frames, limits)) == (b"good", Request(3, "t", "m"))
    finally:
        for sock in (big_sender, good_sender, router):
            sock.close(linger=0)


@pytest.mark.parametrize("bind", ["tcp://0.0.0.0:0", "tcp://*:0", "tcp://eth0:0", "tcp://[::]:0"])
async def test_public_bind_is_refused(ctx: zmq.asyncio.Context, bind: str) -> None:
    with pytest.raises(InsecureBindError):
        make_router(ctx, bind)


async def test_public_bind_allowed_when_asked(ctx: zmq.asyncio.Context) -> None:
    router = make_router(ctx, "tcp://0.0.0.0:0", allow_public_bind=True)
    try:
        assert bound_endpoint(router).startswith("tcp://0.0.0.0:")
    finally:
        router.close(linger=0)


async def test_ipv6_loopback_bind(ctx: zmq.asyncio.Context) -> None:
    try:
        router = make_router(ctx, "tcp://[::1]:0")
    except zmq.ZMQError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    try:
        assert bound_endpoint(router).startswith("tcp://[::1]:")
    finally:
        router.close(linger=0)


def test_loopback_classification() -> None:
    assert is_loopback_endpoint("tcp://127.0.0.1:5555")
    assert is_loopback_endpoint("tcp://127.8.0.2:0")
    assert is_loopback_endpoint("tcp://localhost:1")
    assert is_loopback_endpoint("tcp://[::1]:1")
    assert is_loopback_endpoint("inproc://x") and is_loopback_endpoint("ipc:///tmp/x")
    assert not is_loopback_endpoint("tcp://10.0.0.1:1")
    assert not is_loopback_endpoint("tcp://example.com:1")
    assert not is_loopback_endpoint("udp://127.0.0.1:1")


async def test_unsupported_scheme_and_bad_identity(ctx: zmq.asyncio.Context) -> None:
    with pytest.raises(ValueError):
        make_router(ctx, "udp://127.0.0.1:1")
    with pytest.raises(ValueError):
        make_dealer(ctx, "pgm://x")
    with pytest.raises(ValueError):
        make_dealer(ctx, "inproc://x", identity=b"\x00starts-with-zero")


async def test_curve_allow_list(ctx: zmq.asyncio.Context) -> None:
    server_pub, server_sec = generate_keypair()
    good_pub, good_sec = generate_keypair()
    bad_pub, bad_sec = generate_keypair()
    server = CurveServerConfig(server_pub, server_sec, frozenset({good_pub}))
    async with CurveAuthenticator(ctx) as auth:
        router = make_router(ctx, "tcp://127.0.0.1:0", curve=server, authenticator=auth)
        endpoint = bound_endpoint(router)
        intruder = make_dealer(ctx, endpoint, identity=b"bad", curve=CurveClientConfig(server_pub, bad_pub, bad_sec))
        plain = make_dealer(ctx, endpoint, identity=b"plain")
        friend = make_dealer(ctx, endpoint, identity=b"good", curve=CurveClientConfig(server_pub, good_pub, good_sec))
        try:
            await intruder.send_multipart(encode(Request(1, "t", "steal")))
            await plain.send_multipart(encode(Request(2, "t", "steal")))
            await friend.send_multipart(encode(Request(3, "t", "ok")))
            identity, *frames = await _recv(router)
            assert identity.bytes == b"good" and decode(frames) == Request(3, "t", "ok")
            assert await _is_silent(router)
            await router.send_multipart([b"good", *encode(Reply(3, "hi"))])
            assert decode(await _recv(friend)) == Reply(3, "hi")
            with pytest.raises(zmq.ZMQError):  # never admitted, so not routable either
                await router.send_multipart([b"bad", *encode(Reply(1, "leak"))])
        finally:
            for sock in (intruder, plain, friend, router):
                sock.close(linger=0)
    assert not auth.is_running
    await auth.aclose()  # idempotent


async def test_curve_router_requires_running_authenticator(ctx: zmq.asyncio.Context) -> None:
    pub, sec = generate_keypair()
    config = CurveServerConfig(pub, sec, frozenset())
    with pytest.raises(ValueError, match="CurveAuthenticator"):
        make_router(ctx, "tcp://127.0.0.1:0", curve=config)
    auth = CurveAuthenticator(ctx)
    with pytest.raises(ValueError):
        make_router(ctx, "tcp://127.0.0.1:0", curve=config, authenticator=auth)


def test_curve_config_validation() -> None:
    pub, sec = generate_keypair()
    with pytest.raises(ValueError):
        CurveServerConfig(pub[:10], sec)
    with pytest.raises(ValueError):
        CurveServerConfig(pub, sec, {pub})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CurveClientConfig(pub, pub, "x" * 40)  # type: ignore[arg-type]


async def test_control_without_maxmsgsize_the_big_message_arrives(ctx: zmq.asyncio.Context) -> None:
    # Shows the MAXMSGSIZE test above can fail: same send, router with default limits.
    router = make_router(ctx, "tcp://127.0.0.1:0")
    big_sender = make_dealer(ctx, bound_endpoint(router), identity=b"big")
    try:
        await big_sender.send_multipart(encode(Reply(1, np.zeros(32 * 1024))))
        identity, *frames = await _recv(router)
        assert identity.bytes == b"big" and decode(frames).body.shape == (32 * 1024,)  # type: ignore[union-attr]
    finally:
        big_sender.close(linger=0)
        router.close(linger=0)


async def test_control_curve_without_zap_admits_anyone(ctx: zmq.asyncio.Context) -> None:
    # Why make_router insists on a running CurveAuthenticator: with no ZAP handler,
    # libzmq lets any CURVE client in, so the allow-list test above would fail.
    server_pub, server_sec = generate_keypair()
    bad_pub, bad_sec = generate_keypair()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.CURVE_SERVER, 1)
    router.setsockopt(zmq.CURVE_SECRETKEY, server_sec)
    router.bind("tcp://127.0.0.1:0")
    intruder = make_dealer(
        ctx, bound_endpoint(router), curve=CurveClientConfig(server_pub, bad_pub, bad_sec)
    )
    try:
        await intruder.send_multipart(encode(Request(1, "t", "steal")))
        _, *frames = await _recv(router)
        assert decode(frames) == Request(1, "t", "steal")
    finally:
        intruder.close(linger=0)
        router.close(linger=0)

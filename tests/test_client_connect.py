"""A client started before its server waits for it (``transport/PROTOCOL.md`` 11.5): each call
waits up to ``connect_timeout_s`` for the gateway to become reachable, then fails with an error
naming the endpoint and the wait. The Python client's names match the wire (``max_tokens``;
``max_new_tokens`` is a deprecated alias)."""

from __future__ import annotations

import asyncio
import socket
import time
import warnings

import pytest

from treeserve.actors.gateway.actor import GatewayConfig
from treeserve.client import Client, ConnectTimeoutError, UnavailableError
from treeserve_testing.gateway_fakes import fake_gateway

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_a_client_started_before_the_server_waits_for_it() -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    # server_timeout_s is far below the server's start-up: only waiting for the connection,
    # not judging the silence of a server that is not there yet, lets the calls through.
    async with Client(endpoint, timeout=20, server_timeout_s=0.5, heartbeat_interval_s=0.1) as client:
        info_call = asyncio.ensure_future(client.info())
        generate_call = asyncio.ensure_future(client.generate("early", max_tokens=5))
        await asyncio.sleep(1.5)
        assert not info_call.done() and not generate_call.done()
        async with fake_gateway(GatewayConfig(bind=endpoint, model_name="late")):
            info = await asyncio.wait_for(info_call, 10)
            done = await asyncio.wait_for(generate_call, 10)
    assert info["model"] == "late" and done.text == "early"


async def test_connecting_gives_up_after_the_connect_timeout_naming_endpoint_and_wait() -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    async with Client(endpoint, connect_timeout_s=0.5) as client:
        started = time.monotonic()
        with pytest.raises(ConnectTimeoutError) as info:
            await client.generate("x")
        assert 0.4 < time.monotonic() - started < 3.0
        with pytest.raises(ConnectTimeoutError):
            await client.info()
    err = info.value
    assert isinstance(err, UnavailableError) and err.retryable and err.code == "unavailable"
    assert endpoint in err.message and "0.5 s" in err.message


def test_connect_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="connect_timeout_s"):
        Client("tcp://127.0.0.1:5555", connect_timeout_s=0)
    assert Client("tcp://127.0.0.1:5555").connect_timeout_s == 60.0


async def test_max_new_tokens_is_a_deprecated_alias_of_max_tokens() -> None:
    async with fake_gateway() as (gw, fake):
        async with Client(gw.endpoint, timeout=20) as client:
            with pytest.warns(DeprecationWarning, match="max_new_tokens is deprecated; use max_tokens"):
                old = await client.generate("abcdef", max_new_tokens=3)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                new = await client.generate("abcdef", max_tokens=3)
            with pytest.raises(TypeError, match="max_tokens"):
                await client.generate("abcdef", max_tokens=3, max_new_tokens=3)
    assert old.text == new.text == "abc"
    assert [b["params"]["max_new_tokens"] for b in fake.bodies.values()] == [3, 3]

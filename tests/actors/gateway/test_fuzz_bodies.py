"""Malformed request bodies, generated (hypothesis), at every route of the HTTP API and at the
ZeroMQ gateway's ``generate``: each gets a 4xx (an ``invalid_request`` error on ZeroMQ), never a
500 or an internal error, and the server keeps serving.

The bodies mix the API's own field names with values of every JSON type, strings holding lone
surrogates (JSON's ``"\\ud800"``), raw bytes, and JSON nested thousands of levels deep: the two
last kinds reached a 500 before they were checked at the boundary.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import http_helpers as helpers  # registered by conftest.py
from treeserve.actors.gateway.actor import GatewayConfig
from treeserve.actors.gateway.http_api import ROUTES
from treeserve.client import Client
from treeserve_testing.gateway_fakes import fake_gateway
from treeserve.transport.codec import decode, encode
from treeserve.transport.messages import Error, Request, StreamEnd

pytestmark = [pytest.mark.timeout(300)]

MODEL = helpers.MODEL
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
"""Derandomized: CI runs the same examples every time (a failure reproduces)."""

API_FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
              "stop", "n", "stream", "stream_options", "treeserve", "logprobs", "frequency_penalty", "user", "role",
              "content"]
WIRE_FIELDS = ["prompt", "messages", "prompt_ids", "max_tokens", "temperature", "top_p", "top_k", "seed",
               "stop_token_ids", "stop", "speculate", "parse_special_tokens", "length_hint", "role", "content"]

POST_ROUTES = [path for method, path, _ in ROUTES if method == "POST"]
ANY_ROUTE = [re.sub(r"\{[^}]*\}", "{}", path) for _, path, _ in ROUTES] + ["/v1/{}", "/{}"]
"""Every route the API has (a new one is fuzzed too), its parameters filled by the fuzzer, and
routes it does not have."""

surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
texts = st.text(max_size=12) | st.builds(lambda a, b: a + b, st.text(max_size=4), surrogates)


def values(strings: st.SearchStrategy[str], integers: st.SearchStrategy[int]) -> st.SearchStrategy[Any]:
    scalars = (st.none() | st.booleans() | integers | st.floats(allow_nan=False, allow_infinity=False) | strings
               | st.sampled_from(["w7 w8", "user", "tree", MODEL]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage"]) | strings,
                                          inner, max_size=4), max_leaves=10)


def bodies(fields: list[str], strings: st.SearchStrategy[str], integers: st.SearchStrategy[int]) -> st.SearchStrategy[Any]:
    """Maps of the route's own field names (and some others) to any value; or any value at all."""
    value = values(strings, integers)
    return st.dictionaries(st.sampled_from(fields) | strings, value, max_size=6) | value


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def near_valid(content: str, prompt: bool, extra: dict[str, Any]) -> bytes:
    """A request valid but for its text or one more field."""
    body = {"model": MODEL, "max_tokens": 2, **({"prompt": content} if prompt else
                                                {"messages": [{"role": "user", "content": content}]})}
    return json.dumps({**body, **extra}).encode()


http_bodies = (bodies(API_FIELDS, texts, st.integers(-(2**70), 2**70)).map(lambda b: json.dumps(b).encode())
               | st.builds(near_valid, texts, st.booleans(),
                           st.dictionaries(st.sampled_from(API_FIELDS[3:]), values(texts, st.integers()), max_size=1))
               | st.binary(max_size=40) | st.integers(900, 30000).map(nested)
               | st.integers(900, 30000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return helpers.write_chat_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(folder: Path) -> AsyncIterator[Any]:
    # Generations the fuzzer makes valid by chance stay short (the model's context is small).
    config = helpers.http_config(folder, row_capacity=48, max_tree_nodes=8, speculators=())
    async with helpers.ProxiedServer(config) as running:
        yield running


def _answered(response: httpx.Response, what: object) -> None:
    assert response.status_code < 500, (what, response.status_code, response.text[:300])
    if response.status_code >= 400 and response.status_code != 405:
        error = response.json()["error"]
        assert error["message"] and error["code"], (what, error)


@pytest.mark.asyncio(loop_scope="module")
async def test_every_http_route_answers_malformed_bodies_with_4xx(server: Any) -> None:
    url = server.http_url

    @FUZZ
    @given(body=http_bodies, route=st.sampled_from(POST_ROUTES))
    def post(body: bytes, route: str) -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            _answered(http.post(route, content=body, headers={"content-type": "application/json"}), body[:200])

    @FUZZ
    @given(body=st.binary(max_size=40), model=texts, method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
           route=st.sampled_from(ANY_ROUTE))
    def other(body: bytes, model: str, method: str, route: str) -> None:
        path = route.format(urllib.parse.quote(model.encode("utf-8", "surrogatepass"), safe=""))
        with httpx.Client(base_url=url, timeout=60) as http:
            _answered(http.request(method, path, content=body), (method, path))

    await asyncio.to_thread(post)
    await asyncio.to_thread(other)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:  # still serving
        done = await http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 3, "temperature": 0,
                                                             "messages": [{"role": "user", "content": "w7 w8"}]})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] >= 1, done.text


CONFIG = GatewayConfig(bind="tcp://127.0.0.1:0", context_length=64, max_prompt_chars=100)
wire_integers = st.integers(-(2**63), 2**64 - 1)
wire_strings = st.text(max_size=12)  # msgpack carries UTF-8: a lone surrogate cannot be sent
wire_bodies = bodies(WIRE_FIELDS, wire_strings, wire_integers) | st.binary(max_size=20)


def _answers(sock: zmq.Socket[bytes], msg_id: int) -> list[Any]:
    seen: list[Any] = []
    while not seen or not isinstance(seen[-1], (Error, StreamEnd)):
        assert sock.poll(10_000), "no answer from the gateway"
        message = decode(sock.recv_multipart())
        assert message.id == msg_id, message
        seen.append(message)
    return seen


async def test_the_zeromq_generate_answers_malformed_bodies_with_invalid_request() -> None:
    async with fake_gateway(CONFIG) as (gw, _):
        counter = iter(range(1, 1_000_000))

        @FUZZ
        @given(body=wire_bodies)
        def generate(body: Any) -> None:
            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(gw.endpoint)
            try:
                msg_id = next(counter)
                sock.send_multipart([bytes(f) for f in encode(Request(msg_id, "gateway", "generate", body, None, True))])
                last = _answers(sock, msg_id)[-1]
                if isinstance(last, Error):
                    assert last.code == "invalid_request" and last.message, (body, last)
            finally:
                sock.close(linger=0)
                ctx.term()

        await asyncio.to_thread(generate)
        async with Client(gw.endpoint, timeout=20) as other:  # still serving
            assert (await other.generate("ok", max_tokens=3)).text == "oko"

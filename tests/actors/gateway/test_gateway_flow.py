"""Gateway + Python client round trips against a scripted scheduler (no model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from treeserve.actors.gateway.actor import GatewayActor, GatewayConfig
from treeserve_testing.gateway_fakes import (
    ByteTokenizer,
    expected_echo,
    fake_gateway,
    tiny_bpe_tokenizer,
)
from treeserve.client import (
    Chunk,
    Client,
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    ServerError,
    UnavailableError,
)
from treeserve.runtime import Runtime, RuntimeConfig
from treeserve.ops.sampling import SamplingParams
from treeserve.transport.sockets import CurveClientConfig, CurveServerConfig, generate_keypair

pytestmark = pytest.mark.timeout(60)

TEXT = "héllo 世界! ok"  # 2- and 3-byte characters: ByteTokenizer splits them over tokens


def _bind(kind: str, tmp_path: Path) -> str:
    return "tcp://127.0.0.1:0" if kind == "tcp" else f"ipc://{tmp_path}/gw.sock"


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
async def test_stream_and_generate_round_trip(kind: str, tmp_path: Path) -> None:
    tok = ByteTokenizer()
    prompt_ids = tok.encode(TEXT)
    max_tokens = 2 * len(prompt_ids) + 1  # ends one byte into "h": no broken tail
    want_ids = expected_echo(prompt_ids, max_tokens)
    config = GatewayConfig(bind=_bind(kind, tmp_path), context_length=256)
    async with fake_gateway(config, scheduler={"chunk_sizes": [1, 2, 3]}) as (gw, fake):
        async with Client(gw.endpoint, timeout=20) as client:
            chunks: list[Chunk] = [c async for c in client.stream(TEXT, max_tokens=max_tokens)]
            done = await client.generate(TEXT, max_tokens=max_tokens)
    assert all("\ufffd" not in c.text for c in chunks), "a chunk split a UTF-8 character"
    assert [t for c in chunks for t in c.token_ids] == want_ids
    assert "".join(c.text for c in chunks) == tok.decode(want_ids) == TEXT + TEXT + "h"
    assert done.text == TEXT + TEXT + "h"
    assert list(done.token_ids) == want_ids
    assert done.finish_reason == "length"
    assert done.num_prompt_tokens == len(prompt_ids)
    assert done.num_generated_tokens == len(want_ids)
    assert done.num_steps >= 1 and done.mean_accepted_per_step == pytest.approx(len(want_ids) / done.num_steps)
    assert done.client_total_s >= done.client_ttft_s > 0
    assert [e for e, _ in fake.events] == ["start", "done", "start", "done"]
    assert gw.num_active_streams == 0


async def test_stop_token_ends_with_stop() -> None:
    async with fake_gateway() as (gw, fake):
        async with Client(gw.endpoint, timeout=20) as client:
            done = await client.generate("abc!def", max_tokens=50, stop_token_ids=[ord("!")])
    assert done.text == "abc!"
    assert done.finish_reason == "stop"


async def test_sampling_params_and_stop_ids_reach_the_scheduler() -> None:
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3, max_new_tokens=7, stop_token_ids=(10,))
    async with fake_gateway() as (gw, fake):
        async with Client(gw.endpoint, timeout=20) as client:
            await client.generate("hello", params, speculate="chain")
            await client.generate("hello", params, max_tokens=3, temperature=0)  # overrides win
    first, second = fake.bodies.values()
    assert first["prompt_ids"] == list(b"hello")
    assert first["speculate"] == "chain"
    assert first["params"] == {
        "temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3,
        "stop_token_ids": [10, ByteTokenizer.EOS], "max_new_tokens": 7,
    }
    assert second["params"]["max_new_tokens"] == 3 and second["params"]["temperature"] == 0.0
    assert first["request_id"] != second["request_id"]


async def test_chat_messages_use_the_real_tokenizer_template() -> None:
    tok = tiny_bpe_tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    config = GatewayConfig(bind="tcp://127.0.0.1:0", context_length=256)
    async with fake_gateway(config, tokenizer=tok) as (gw, fake):
        async with Client(gw.endpoint, timeout=20) as client:
            prompt_ids = tok.encode_chat(messages)
            done = await client.generate(messages, max_tokens=len(prompt_ids))
            by_ids = await client.generate(prompt_ids[:4], max_tokens=4)
    (body, _) = fake.bodies.values()
    assert body["prompt_ids"] == prompt_ids
    assert sorted(body["params"]["stop_token_ids"]) == sorted(tok.stop_ids)
    # The echo stops at the first stop id (<|im_end|>); specials are not in the text.
    want = expected_echo(prompt_ids, len(prompt_ids), sorted(tok.stop_ids))
    assert list(done.token_ids) == want
    assert done.text == tok.decode(want, skip_special_tokens=True) == "system\nbe brief"
    assert done.finish_reason == "stop"
    assert list(by_ids.token_ids) == prompt_ids[:4]


async def test_info_describes_the_model() -> None:
    config = GatewayConfig(bind="tcp://127.0.0.1:0", model_name="fake-bytes", context_length=300)
    async with fake_gateway(config) as (gw, _):
        async with Client(gw.endpoint, timeout=20) as client:
            info = await client.info()
    assert info["model"] == "fake-bytes"
    assert info["vocab_size"] == ByteTokenizer.vocab_size
    assert info["context_length"] == 300
    assert info["eos_ids"] == [ByteTokenizer.EOS]


async def test_one_client_multiplexes_concurrent_streams() -> None:
    async with fake_gateway(scheduler={"chunk_sizes": [1, 3], "delay_s": 0.001}) as (gw, _):
        async with Client(gw.endpoint, timeout=30) as client:
            prompts = [f"stream-{i:02d}:" for i in range(24)]
            results = await asyncio.gather(*(client.generate(p, max_tokens=30) for p in prompts))
    for prompt, done in zip(prompts, results, strict=True):
        assert list(done.token_ids) == expected_echo(list(prompt.encode()), 30)


def test_works_under_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def main() -> str:
        async with fake_gateway() as (gw, _):
            async with Client(gw.endpoint, timeout=20) as client:
                chunks = [c.text async for c in client.stream("uv", max_tokens=4)]
        return "".join(chunks)

    assert uvloop.run(main()) == "uvuv"


async def test_curve_admits_only_allow_listed_clients() -> None:
    server_pub, server_sec = generate_keypair()
    client_pub, client_sec = generate_keypair()
    stranger_pub, stranger_sec = generate_keypair()
    curve = CurveServerConfig(server_pub, server_sec, frozenset({client_pub}))
    config = GatewayConfig(bind="tcp://127.0.0.1:0", curve=curve)
    async with fake_gateway(config) as (gw, _):
        good = CurveClientConfig(server_pub, client_pub, client_sec)
        async with Client(gw.endpoint, curve=good, timeout=20) as client:
            assert (await client.generate("secret", max_tokens=6)).text == "secret"
        bad = CurveClientConfig(server_pub, stranger_pub, stranger_sec)
        async with Client(gw.endpoint, curve=bad, timeout=0.5) as stranger:
            with pytest.raises(DeadlineExceededError):
                await stranger.generate("let me in", max_tokens=3)


@pytest.mark.parametrize(("fail_code", "error_cls", "code", "retryable"), [
    ("overloaded", OverloadedError, "overloaded", True),
    ("invalid_request", InvalidRequestError, "invalid_request", False),
    ("actor_dead", UnavailableError, "actor_dead", True),
    ("crash", ServerError, "internal", False),
])
async def test_scheduler_errors_reach_the_client_typed(
    fail_code: str, error_cls: type[ServerError], code: str, retryable: bool
) -> None:
    async with fake_gateway(scheduler={"fail_code": fail_code}) as (gw, _):
        async with Client(gw.endpoint, timeout=20) as client:
            with pytest.raises(error_cls) as info:
                await client.generate("x", max_tokens=2)
    assert (info.value.code, info.value.retryable) == (code, retryable)
    assert gw.num_active_streams == 0 and gw.stats_counters.num_failed == 1


async def test_missing_scheduler_is_unavailable() -> None:
    async with Runtime(RuntimeConfig()) as rt:
        missing = rt.ref(rt.endpoint, "no-scheduler-here")
        gw = GatewayActor(GatewayConfig(bind="tcp://127.0.0.1:0"), ByteTokenizer(), lambda: missing)
        await rt.node.host("gateway", gw)
        async with Client(gw.endpoint, timeout=20) as client:
            with pytest.raises(UnavailableError, match="not available") as info:
                await client.generate("x", max_tokens=2)
    assert info.value.retryable

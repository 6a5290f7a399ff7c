"""Stop strings: the gateway ends a generation where one first appears in its text.

The scripted scheduler echoes the prompt in chunks of 1-3 tokens of one UTF-8 byte each, so
stop strings straddle chunk boundaries and multi-byte characters.
"""

from __future__ import annotations

import pytest

from treeserve.actors.gateway.stream import StopMatcher
from treeserve_testing.gateway_fakes import fake_gateway
from treeserve.client import Client, InvalidRequestError

pytestmark = pytest.mark.timeout(60)

TEXT = "héllo wörld, hello world. end"


def _released(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], str]:
    out = [matcher.push(piece) for piece in pieces]
    return out, "".join(out) + ("" if matcher.matched is not None else matcher.flush())


def test_matcher_holds_back_what_could_start_a_stop_string() -> None:
    matcher = StopMatcher(["world"])
    out, whole = _released(matcher, ["hello w", "or", "ld", " and more"])
    assert out == ["hello ", "", "", ""] and matcher.matched == "world" and whole == "hello "
    matcher = StopMatcher(["world"])
    out, whole = _released(matcher, ["hello w", "ow", "!"])  # a "w" at the end could start it
    assert out == ["hello ", "wo", "w!"] and matcher.matched is None and whole == "hello wow!"
    matcher = StopMatcher(["abc"])
    assert _released(matcher, ["xa", "b"]) == (["x", ""], "xab")  # a held tail is flushed at the end


def test_matcher_cuts_at_the_earliest_stop_string_once_one_has_appeared() -> None:
    matcher = StopMatcher(["o", "lo w"])  # both in one piece: the one starting first wins
    assert matcher.push("hello world") == "hel" and matcher.matched == "lo w"
    matcher = StopMatcher(["\n\n", "END"])
    assert matcher.push("a\nEN") == "a\n" and matcher.push("D\n\n") == "" and matcher.matched == "END"
    assert matcher.push("more") == ""  # nothing after a match
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])


async def test_a_stop_string_ends_the_text_and_the_generation() -> None:
    async with fake_gateway() as (gw, fake), Client(gw.endpoint, timeout=20) as client:
        chunks = [chunk async for chunk in client.stream(TEXT, max_tokens=200, stop=["world"])]
        streamed = "".join(c.text for c in chunks)
        done = await client.generate(TEXT, max_tokens=200, stop=["world", "ö"])
    assert streamed == "héllo wörld, hello "
    assert "w" not in streamed[len("héllo wörld, hello"):]  # nothing of the stop string was streamed
    assert done.text == "héllo w" and done.matched_stop == "ö" and done.finish_reason == "stop"
    # The ids end with the token that completed the stop string: "ö" is two UTF-8 bytes.
    assert bytes(done.token_ids).decode() == "héllo wö" and done.num_generated_tokens == len(done.token_ids)
    events = [e for e, _ in fake.events]
    assert events.count("finish") == 2 and events.count("done") == 2 and "cancelled" not in events


async def test_a_stop_string_that_never_appears_changes_nothing() -> None:
    async with fake_gateway() as (gw, fake), Client(gw.endpoint, timeout=20) as client:
        done = await client.generate(TEXT, max_tokens=len(TEXT.encode()), stop="worlds")
    assert done.text == TEXT and done.finish_reason == "length" and done.matched_stop is None
    assert "finish" not in [e for e, _ in fake.events]


@pytest.mark.parametrize("stop, message", [
    (["ok", ""], "non-empty"), ([1], "non-empty"), ({"a": 1}, "a str or an array of str, got map"),
    (["x"] * 17, "at most 16"), (["x" * 257], "at most 256"),
])
async def test_bad_stop_strings_are_invalid_requests(stop: object, message: str) -> None:
    async with fake_gateway() as (gw, _), Client(gw.endpoint, timeout=20) as client:
        with pytest.raises(InvalidRequestError, match=message):
            await client.generate("hi", stop=stop)

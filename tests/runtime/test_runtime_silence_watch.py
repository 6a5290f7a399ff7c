"""``SilenceWatch`` driven by hand with a fake clock: heartbeats only while calls are open,
a peer silent past the timeout fails them, silence never counts from before the calls
began, and a tick after our own loop stalled judges nobody."""

from __future__ import annotations

from typing import Any, cast

import pytest

from treeserve.runtime.errors import ActorError, ConnectionLost
from treeserve.runtime.outbound import Outbound
from treeserve.runtime.silence_watch import SilenceWatch
from treeserve.transport.messages import Heartbeat

EP = "tcp://127.0.0.1:5555"


class FakeOutbound:
    """The four ``Outbound`` methods the watch uses, with state a test sets."""

    def __init__(self) -> None:
        self.has_calls = False
        self.heard: float | None = None
        self.beats: list[Heartbeat] = []
        self.failed: list[ActorError] = []

    def has_calls_to(self, endpoint: str) -> bool:
        assert endpoint == EP
        return self.has_calls

    def last_heard(self, endpoint: str) -> float | None:
        return self.heard

    def send_heartbeat(self, endpoint: str, beat: Heartbeat) -> None:
        self.beats.append(beat)

    def fail_calls_to(self, endpoint: str, exc: ActorError) -> None:
        self.failed.append(exc)
        self.has_calls = False


def watch(fake: FakeOutbound, now: float = 0.0) -> SilenceWatch:
    outbound = cast(Outbound, cast(Any, fake))
    return SilenceWatch(outbound, EP, interval_s=1.0, timeout_s=3.0, sender="client", now=now)


def test_heartbeats_only_while_calls_are_open() -> None:
    fake = FakeOutbound()
    w = watch(fake)
    assert w.tick(1.0) is False and fake.beats == []
    fake.has_calls = True
    w.tick(2.0)
    w.tick(3.0)
    assert [(b.seq, b.node) for b in fake.beats] == [(0, "client"), (1, "client")]
    fake.has_calls = False
    w.tick(4.0)
    assert len(fake.beats) == 2 and fake.failed == []


def test_a_peer_silent_past_the_timeout_fails_the_calls_once() -> None:
    fake = FakeOutbound()
    fake.heard = 0.0
    fake.has_calls = True
    w = watch(fake)
    assert [w.tick(float(t)) for t in range(1, 5)] == [False, False, False, False]
    fake.heard = 4.0  # an answer or a heartbeat came in
    assert [w.tick(float(t)) for t in range(5, 8)] == [False, False, False]
    assert w.tick(8.0) is True  # 4 s since 4.0 > 3 s
    [exc] = fake.failed
    assert isinstance(exc, ConnectionLost) and exc.retryable and "4.0s" in exc.message
    assert w.num_lost == 1 and w.tick(9.0) is False  # the calls are gone: nothing to judge


def test_silence_counts_from_when_the_calls_began() -> None:
    fake = FakeOutbound()
    fake.heard = 0.0  # long ago, while idle
    w = watch(fake)
    for t in range(1, 100):
        w.tick(float(t))
    fake.has_calls = True
    assert [w.tick(float(t)) for t in range(100, 104)] == [False] * 4  # 3 s since the first tick with calls
    assert w.tick(104.0) is True


def test_a_tick_after_our_own_stall_judges_nobody() -> None:
    fake = FakeOutbound()
    fake.heard = 0.0
    fake.has_calls = True
    w = watch(fake)
    w.tick(1.0)
    assert w.tick(10.0) is False  # our loop was blocked for 9 s: the peer's messages may sit unread
    assert fake.failed == [] and len(fake.beats) == 2
    assert w.tick(11.0) is True  # an ordinary tick: now it counts


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        SilenceWatch(cast(Outbound, object()), EP, interval_s=0, timeout_s=1, sender="x", now=0.0)

"""``StallGuard``: a tick more than two periods after the previous one means a blocked loop."""

from __future__ import annotations

from treeserve.runtime.stall import StallGuard


def test_only_a_late_tick_is_stalled_and_reset_restarts_the_count() -> None:
    guard = StallGuard(period_s=1.0, now=0.0)
    assert [guard.tick(t) for t in (1.0, 2.1, 4.0, 6.5)] == [False, False, False, True]
    assert guard.num_stalled == 1
    guard.reset(20.0)  # awaited work of the tick itself, not a blocked loop
    assert not guard.tick(21.0) and guard.num_stalled == 1

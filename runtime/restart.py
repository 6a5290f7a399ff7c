"""``RestartIntensity``: the pure policy deciding whether a supervisor may restart."""

from __future__ import annotations

from collections import deque

__all__ = ["RestartIntensity"]


class RestartIntensity:
    """Allows at most ``max_restarts`` restarts within any sliding window of
    ``within_s`` seconds (Erlang's restart intensity). Reads no clock: every decision
    takes ``now`` (seconds, any monotonic clock), so tests drive it with fake times."""

    def __init__(self, max_restarts: int, within_s: float) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        if not within_s > 0:
            raise ValueError(f"within_s must be > 0, got {within_s}")
        self.max_restarts = max_restarts
        self.within_s = within_s
        self._history: deque[float] = deque()

    def can_restart(self, now: float) -> bool:
        """True when one more restart at ``now`` stays within the intensity."""
        self._forget_before(now - self.within_s)
        return len(self._history) < self.max_restarts

    def record_restart(self, now: float) -> None:
        """Count a restart made at ``now``."""
        self._history.append(now)

    def try_restart(self, now: float) -> bool:
        """``can_restart`` and, when allowed, ``record_restart`` in one step."""
        if not self.can_restart(now):
            return False
        self.record_restart(now)
        return True

    @property
    def num_recent(self) -> int:
        """Restarts still inside the window as of the last decision."""
        return len(self._history)

    def _forget_before(self, cutoff: float) -> None:
        while self._history and self._history[0] <= cutoff:
            self._history.popleft()

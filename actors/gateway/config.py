"""Configuration, limits and counters of the public gateway (``GatewayActor``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from treeserve.runtime.stats import InboundStats
from treeserve.transport.sockets import CurveServerConfig
from treeserve.transport.wire import GATEWAY_LIMITS, GATEWAY_TARGET, WireLimits  # re-exported

__all__ = ["GATEWAY_LIMITS", "GATEWAY_TARGET", "GatewayConfig", "GatewayStats", "TokenizerLike"]


class TokenizerLike(Protocol):
    """What the gateway needs from a tokenizer (``treeserve.ops.tokenizer.Tokenizer``). Its
    ``encode`` must turn no special-token text into a control token: only a ``Tokenizer`` is
    asked to keep user text apart (``split_special_tokens``), any other one is taken as is."""

    @property
    def stop_ids(self) -> Iterable[int]:
        """Token ids that end a generation (EOS and turn-end specials)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Configuration of the public gateway.

    ``bind``: the ROUTER endpoint (loopback unless ``allow_public_bind``; then use
    ``curve``). ``context_length``/``vocab_size``: of the served model (vocab_size None:
    the tokenizer's ``vocab_size``). ``max_prompt_chars`` bounds prompt text;
    ``max_concurrent_streams`` bounds open generate streams (beyond it: ``overloaded``,
    retryable). While a client has a stream open, the gateway sends it a heartbeat every
    ``heartbeat_interval_s`` and cancels its streams once nothing was heard from it for
    ``disconnect_timeout_s`` (or a send to it fails). ``limits`` apply to received messages.
    ``scheduler_timeout_s`` bounds each wait for the scheduler's next item of a stream (the
    scheduler sends a keepalive at least every quarter of its step timeout; the server sets
    this to that step timeout): past it the stream ends with a non-retryable ``internal`` error.
    """

    bind: str = "tcp://127.0.0.1:5555"
    model_name: str = ""
    context_length: int = 2048
    vocab_size: int | None = None
    max_prompt_chars: int = 65_536
    max_concurrent_streams: int = 256
    heartbeat_interval_s: float = 0.5
    disconnect_timeout_s: float = 3.0
    curve: CurveServerConfig | None = None
    allow_public_bind: bool = False
    limits: WireLimits = field(default=GATEWAY_LIMITS)
    scheduler_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.bind, str) or not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"GatewayConfig.bind must be a tcp://, ipc:// or inproc:// endpoint, got {self.bind!r}")
        for name in ("context_length", "max_prompt_chars", "max_concurrent_streams"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GatewayConfig.{name} must be an int >= 1, got {value!r}")
        if self.context_length < 2:
            raise ValueError("GatewayConfig.context_length must be >= 2 (a prompt token and a generated one)")
        if self.vocab_size is not None and (
            isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1
        ):
            raise ValueError(f"GatewayConfig.vocab_size must be None or an int >= 1, got {self.vocab_size!r}")
        for name in ("heartbeat_interval_s", "disconnect_timeout_s", "scheduler_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and value > 0
            ):
                raise ValueError(f"GatewayConfig.{name} must be a positive number of seconds, got {value!r}")
        if self.disconnect_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError("GatewayConfig.disconnect_timeout_s must be at least 2 heartbeat intervals")
        if self.curve is not None and not isinstance(self.curve, CurveServerConfig):
            raise ValueError("GatewayConfig.curve must be a CurveServerConfig or None")
        if not isinstance(self.limits, WireLimits):
            raise ValueError("GatewayConfig.limits must be a WireLimits")


@dataclass
class GatewayStats(InboundStats):
    """Monotonic counters of one gateway (for tests and monitoring): its ROUTER's
    (``InboundStats``: requests, bad messages, drops, send failures...) and its own.
    ``num_cancels`` counts client cancels of open streams (``num_cancels_received``: all)."""

    num_invalid: int = 0
    num_overloaded: int = 0
    num_cancels: int = 0
    num_disconnects: int = 0
    num_completed: int = 0
    num_failed: int = 0
    num_stalled_ticks: int = 0
    """Liveness ticks on which the gateway's own loop had been blocked, so no client was judged."""

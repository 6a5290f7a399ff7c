"""``GatewayActor``: the public front door. It owns its own ROUTER socket speaking the
wire protocol (``transport/PROTOCOL.md``, section "Gateway messages"), validates and
tokenizes ``generate`` requests, streams the scheduler's tokens back as text + token ids,
and cancels the scheduler stream when a client cancels or goes away. ``info`` and ``health``
report whether the server behind it has failed for good (a supervisor gave up).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeAlias, cast

import zmq
import zmq.asyncio

from treeserve.actors.gateway_config import (
    GATEWAY_LIMITS,
    GATEWAY_TARGET,
    GatewayConfig,
    GatewayStats,
    TokenizerLike,
)
from treeserve.actors.gateway_request import GenerateRequest, InvalidRequest, parse_generate
from treeserve.actors.gateway_stream import prompt_ids_for, relay_generation, scheduler_body
from treeserve.runtime.actor import Actor, handler
from treeserve.runtime.errors import ActorError
from treeserve.runtime.ref import ActorRef
from treeserve.runtime.stall import StallGuard
from treeserve.transport.codec import DecodeError, decode, encode
from treeserve.transport.messages import (
    Cancel,
    Error,
    Heartbeat,
    Message,
    Reply,
    Request,
    StreamEnd,
    StreamItem,
)
from treeserve.transport.sockets import CurveAuthenticator, bound_endpoint, make_router
from treeserve.transport.wire import RETRYABLE_CODES, ErrorCode

__all__ = [
    "GATEWAY_LIMITS",
    "GATEWAY_TARGET",
    "GatewayActor",
    "GatewayConfig",
    "GatewayStats",
    "TokenizerLike",
]

_log = logging.getLogger(__name__)

_SEND_RETRY_S = 0.005


class _Why(enum.Enum):
    """Why a stream task was cancelled (decides what, if anything, the client is told)."""

    CLIENT_CANCEL = "client_cancel"
    DISCONNECT = "disconnect"
    SHUTDOWN = "shutdown"


class _Sent(enum.Enum):
    OK = "ok"
    FULL = "full"  # the peer's queue is at its high-water mark; retry later
    GONE = "gone"  # the peer is not connected (ROUTER_MANDATORY)


class _PeerGone(Exception):
    """Internal: the client stopped accepting messages mid-stream."""


class _Stream:
    """One open generate stream: its client, request id, task and items sent so far."""

    __slots__ = ("cancel_reason", "msg_id", "peer", "seq", "task")

    def __init__(self, peer: bytes, msg_id: int) -> None:
        self.peer = peer
        self.msg_id = msg_id
        self.seq = 0
        self.task: asyncio.Task[None] | None = None
        self.cancel_reason: _Why | None = None


class _Peer:
    """Liveness of one client that has streams open."""

    __slots__ = ("beat_seq", "keys", "last_seen")

    def __init__(self, now: float) -> None:
        self.last_seen = now
        self.beat_seq = 0
        self.keys: set[int] = set()


SchedulerSource: TypeAlias = ActorRef | Callable[[], ActorRef]

HealthSource: TypeAlias = Callable[[], list[str]]
"""Returns why the server can no longer serve (one line per supervisor that gave up); empty: healthy."""


class GatewayActor(Actor):
    """Serves the public ``generate`` / ``info`` protocol on its own ROUTER socket.

    Each ``generate`` gets a task (owned by the gateway's TaskGroup, at most
    ``config.max_concurrent_streams``) that tokenizes, calls
    ``scheduler.ask_stream("generate", ...)`` and forwards tokens as ``stream_item``s
    (new text, never a split UTF-8 character, plus token ids), then a ``stream_end`` with
    the full text and the scheduler's stats. A client ``cancel``, a failed send, or a
    client silent for ``disconnect_timeout_s`` cancels the scheduler stream, which frees
    the request's KV row. Bad messages get an error reply (or are dropped and counted when
    no reply is possible); everyone else keeps being served.

    ``failures`` (optional) says why the server behind the gateway can no longer serve; once
    it is non-empty, ``info`` and ``health`` report ``status: "failed"`` with those lines,
    ``generate`` is refused with a non-retryable ``unavailable``, and errors of streams that
    were running lose their ``retryable`` mark (a retry would meet the same dead server).
    """

    def __init__(
        self, config: GatewayConfig, tokenizer: TokenizerLike, scheduler: SchedulerSource,
        failures: HealthSource | None = None,
    ) -> None:
        if not isinstance(config, GatewayConfig):
            raise TypeError("GatewayActor needs a GatewayConfig")
        vocab_size = config.vocab_size
        if vocab_size is None:
            vocab_size = getattr(tokenizer, "vocab_size", None)
            if not isinstance(vocab_size, int):
                raise ValueError("GatewayConfig.vocab_size is None and the tokenizer has no int vocab_size")
        self.config = config
        self.stats_counters = GatewayStats()
        self._vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_ids = sorted({int(t) for t in tokenizer.stop_ids})
        self._scheduler = scheduler
        self._failures = failures
        self._ctx: zmq.asyncio.Context | None = None
        self._auth: CurveAuthenticator | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._endpoint = ""
        self._serve_task: asyncio.Task[None] | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._streams: dict[tuple[bytes, int], _Stream] = {}
        self._peers: dict[bytes, _Peer] = {}

    # ------------------------------------------------------------------ lifecycle

    @property
    def endpoint(self) -> str:
        """The bound public endpoint (the real port after a ``:0`` bind)."""
        return self._endpoint

    @property
    def num_active_streams(self) -> int:
        """Generate streams currently open."""
        return len(self._streams)

    async def on_start(self) -> None:
        """Bind the public socket and start the receive loop (owned task)."""
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        try:
            if cfg.curve is not None:
                self._auth = CurveAuthenticator(self._ctx)
                self._auth.start()
            self._sock = make_router(
                self._ctx,
                cfg.bind,
                limits=cfg.limits,
                curve=cfg.curve,
                authenticator=self._auth,
                allow_public_bind=cfg.allow_public_bind,
            )
            self._endpoint = bound_endpoint(self._sock)
        except BaseException:
            await self._close_sockets()
            raise
        started = asyncio.get_running_loop().create_future()
        self._serve_task = self.tasks.start(self._serve(started), f"serve:{self._endpoint}")
        await asyncio.wait([started, self._serve_task], return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            await self._close_sockets()
            raise RuntimeError("the gateway's receive loop ended before it served")
        _log.info("gateway serving on %s", self._endpoint)

    async def on_stop(self) -> None:
        """Cancel every stream (clients get ``unavailable``), the loop, close sockets."""
        for stream in self._streams.values():
            if stream.cancel_reason is None:
                stream.cancel_reason = _Why.SHUTDOWN
        task, self._serve_task = self._serve_task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=max(1.0, self.config.disconnect_timeout_s))
        await self._close_sockets()

    async def _close_sockets(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._auth is not None:
            await self._auth.aclose()
            self._auth = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    @handler
    async def stats(self) -> dict[str, Any]:
        """Counters, the bound endpoint and the number of open streams."""
        return {**asdict(self.stats_counters), "endpoint": self._endpoint,
                "num_active_streams": len(self._streams)}

    # ------------------------------------------------------------------ receive loop

    async def _serve(self, started: asyncio.Future[None]) -> None:
        sock = self._sock
        assert sock is not None
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            tg.create_task(self._watch_peers(), name="gateway:watch")
            started.set_result(None)
            while True:
                frames = await sock.recv_multipart(copy=False)
                try:
                    self._on_frames(frames)
                except Exception:  # one bad message must never stop the gateway
                    _log.exception("gateway: failed to handle a message")
                    self.stats_counters.num_dropped += 1

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        stats = self.stats_counters
        if len(frames) < 2:
            stats.num_dropped += 1
            return
        peer = frames[0].bytes
        try:
            msg = decode(frames[1:], self.config.limits)
        except DecodeError as exc:
            stats.num_bad_messages += 1
            err = Error(exc.msg_id, exc.code, exc.message, exc.code in RETRYABLE_CODES)
            if self._send_now(peer, err) is not _Sent.OK:
                stats.num_dropped += 1
            return
        known = self._peers.get(peer)
        if known is not None:
            known.last_seen = asyncio.get_running_loop().time()
        if isinstance(msg, Request):
            stats.num_requests += 1
            self._on_request(peer, msg)
        elif isinstance(msg, Cancel):
            stream = self._streams.get((peer, msg.id))
            if stream is not None:
                stats.num_cancels += 1
                self._cancel(stream, _Why.CLIENT_CANCEL)
        elif isinstance(msg, Heartbeat):
            pass  # any message counts as a sign of life (recorded above)
        else:  # answers never flow client -> gateway; never answer them (no loops)
            stats.num_dropped += 1

    def _refuse(self, peer: bytes, msg_id: int, code: ErrorCode, text: str) -> None:
        if code is ErrorCode.INVALID_REQUEST:
            self.stats_counters.num_invalid += 1
        self._send_now(peer, Error(msg_id, code, text, code in RETRYABLE_CODES))

    def _on_request(self, peer: bytes, req: Request) -> None:
        if req.target != GATEWAY_TARGET:
            self._refuse(peer, req.id, ErrorCode.NO_SUCH_ACTOR,
                         f"this endpoint only serves target {GATEWAY_TARGET!r}, not {req.target!r}")
            return
        if req.method in ("info", "health"):
            if req.stream:
                self._refuse(peer, req.id, ErrorCode.INVALID_REQUEST,
                             f"{req.method!r} is unary: send it with stream=false")
                return
            self._send_now(peer, Reply(req.id, self._info() if req.method == "info" else self._health()))
            return
        if req.method != "generate":
            self._refuse(peer, req.id, ErrorCode.NO_SUCH_METHOD,
                         f"unknown method {req.method!r} (methods: 'generate' (stream), 'info', 'health')")
            return
        if not req.stream:
            self._refuse(peer, req.id, ErrorCode.INVALID_REQUEST, "'generate' streams: send it with stream=true")
            return
        key = (peer, req.id)
        if key in self._streams:
            self._refuse(peer, req.id, ErrorCode.INVALID_REQUEST, f"request id {req.id} is already in use")
            return
        if req.timeout_ms == 0:
            self._refuse(peer, req.id, ErrorCode.DEADLINE_EXCEEDED, "request arrived with no time left")
            return
        failures = self._current_failures()
        if failures:
            self._send_now(peer, Error(req.id, ErrorCode.UNAVAILABLE, _failed_text(failures), False))
            return
        cfg = self.config
        try:
            parsed = parse_generate(
                req.body,
                vocab_size=self._vocab_size,
                context_length=cfg.context_length,
                max_prompt_chars=cfg.max_prompt_chars,
            )
        except InvalidRequest as exc:
            self._refuse(peer, req.id, ErrorCode.INVALID_REQUEST, str(exc))
            return
        if len(self._streams) >= cfg.max_concurrent_streams:
            self.stats_counters.num_overloaded += 1
            self._refuse(peer, req.id, ErrorCode.OVERLOADED,
                         f"{len(self._streams)} streams open (max {cfg.max_concurrent_streams}); retry later")
            return
        assert self._tg is not None
        stream = _Stream(peer, req.id)
        now = asyncio.get_running_loop().time()
        state = self._peers.setdefault(peer, _Peer(now))
        state.last_seen = now
        state.keys.add(req.id)
        self._streams[key] = stream
        timeout_s = None if req.timeout_ms is None else req.timeout_ms / 1000
        stream.task = self._tg.create_task(self._run_stream(stream, parsed, timeout_s),
                                           name=f"gateway:stream:{req.id}")

    def _current_failures(self) -> list[str]:
        return [] if self._failures is None else list(self._failures())

    def _health(self) -> dict[str, Any]:
        failures = self._current_failures()
        return {"status": "failed" if failures else "ok", "failures": failures}

    def _info(self) -> dict[str, Any]:
        cfg = self.config
        return {
            **self._health(),
            "model": cfg.model_name,
            "vocab_size": self._vocab_size,
            "context_length": cfg.context_length,
            "eos_ids": list(self._stop_ids),
            "max_prompt_chars": cfg.max_prompt_chars,
            "max_concurrent_streams": cfg.max_concurrent_streams,
            "heartbeat_interval_s": cfg.heartbeat_interval_s,
        }

    # ------------------------------------------------------------------ liveness

    async def _watch_peers(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        guard = StallGuard(cfg.heartbeat_interval_s, loop.time())
        while True:
            await asyncio.sleep(cfg.heartbeat_interval_s)
            now = loop.time()
            # If our own loop was blocked, the clients' heartbeats may sit unread in the socket:
            # judge nobody on this tick (the next one comes after they have been read).
            stalled = guard.tick(now)
            self.stats_counters.num_stalled_ticks += int(stalled)
            for peer, state in list(self._peers.items()):
                if not stalled and now - state.last_seen > cfg.disconnect_timeout_s:
                    _log.info("gateway: client silent for %.1fs; cancelling its streams", now - state.last_seen)
                    self._disconnect(peer)
                    continue
                beat = Heartbeat(state.beat_seq, time.time(), GATEWAY_TARGET)
                state.beat_seq += 1
                if self._send_now(peer, beat) is _Sent.GONE:
                    self._disconnect(peer)

    def _disconnect(self, peer: bytes, current: _Stream | None = None) -> None:
        """Cancel every stream of ``peer``; ``current`` (the caller's own stream, which
        is ending by itself) is only marked."""
        if current is not None:
            current.cancel_reason = _Why.DISCONNECT
        state = self._peers.pop(peer, None)
        if state is None:
            return
        self.stats_counters.num_disconnects += 1
        for msg_id in list(state.keys):
            stream = self._streams.get((peer, msg_id))
            if stream is not None and stream is not current:
                self._cancel(stream, _Why.DISCONNECT)

    def _cancel(self, stream: _Stream, why: _Why) -> None:
        if stream.cancel_reason is None:
            stream.cancel_reason = why
        if stream.task is not None:
            stream.task.cancel()

    def _forget(self, stream: _Stream) -> None:
        self._streams.pop((stream.peer, stream.msg_id), None)
        state = self._peers.get(stream.peer)
        if state is not None:
            state.keys.discard(stream.msg_id)
            if not state.keys:
                del self._peers[stream.peer]

    # ------------------------------------------------------------------ sending

    def _send_now(self, peer: bytes, msg: Message) -> _Sent:
        sock = self._sock
        if sock is None:
            return _Sent.GONE
        frames = encode(msg)
        # With DONTWAIT (and no blocking send ever queued) pyzmq answers at once with a
        # finished future, and keeps the receive side's edge-triggered wakeups right.
        fut = cast("asyncio.Future[Any]",
                   sock.send_multipart([peer, *frames], flags=zmq.DONTWAIT, copy=False))
        if not fut.done():  # pragma: no cover - cannot happen without blocking sends
            fut.cancel()
            return _Sent.FULL
        exc = fut.exception()
        if exc is None:
            return _Sent.OK
        self.stats_counters.num_send_failures += 1
        if isinstance(exc, zmq.Again):
            return _Sent.FULL
        return _Sent.GONE  # EHOSTUNREACH under ROUTER_MANDATORY, or the socket closed

    async def _send(self, stream: _Stream, msg: Message) -> None:
        """Send, retrying while the client's queue is full; raises ``_PeerGone`` when the
        client is gone or has not drained its queue within ``disconnect_timeout_s``."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.config.disconnect_timeout_s
        while True:
            sent = self._send_now(stream.peer, msg)
            if sent is _Sent.OK:
                return
            if sent is _Sent.GONE or loop.time() >= give_up:
                raise _PeerGone
            await asyncio.sleep(_SEND_RETRY_S)

    # ------------------------------------------------------------------ one stream

    async def _run_stream(self, stream: _Stream, req: GenerateRequest, timeout_s: float | None) -> None:
        try:
            error = await self._generate_guarded(stream, req, timeout_s)
            if stream.cancel_reason is _Why.DISCONNECT:
                pass  # nobody left to tell
            elif error is None:
                self.stats_counters.num_completed += 1
            else:
                self.stats_counters.num_failed += 1
                failures = self._current_failures()
                if failures and error.retryable:  # the server behind us is gone for good
                    error = Error(error.id, error.code, f"{error.message} ({_failed_text(failures)})", False)
                self._send_now(stream.peer, error)
        except asyncio.CancelledError:
            if stream.cancel_reason in (None, _Why.SHUTDOWN):
                self._send_now(stream.peer, Error(
                    stream.msg_id, ErrorCode.UNAVAILABLE, "the gateway is shutting down", True))
            raise
        finally:
            self._forget(stream)

    async def _generate_guarded(
        self, stream: _Stream, req: GenerateRequest, timeout_s: float | None
    ) -> Error | None:
        msg_id = stream.msg_id
        try:
            async with asyncio.timeout(timeout_s):
                await self._generate(stream, req, timeout_s)
        except InvalidRequest as exc:
            self.stats_counters.num_invalid += 1
            return Error(msg_id, ErrorCode.INVALID_REQUEST, str(exc))
        except _PeerGone:
            self._disconnect(stream.peer, current=stream)
            return None
        except ActorError as exc:  # from the scheduler: keep its code (overloaded, ...)
            if exc.code in (ErrorCode.NO_SUCH_ACTOR, ErrorCode.NO_SUCH_METHOD):
                # Internal wiring, not the client's business; a restart may fix it.
                return Error(msg_id, ErrorCode.UNAVAILABLE, f"the model is not available ({exc.message})", True)
            return Error(msg_id, exc.code, exc.message, exc.retryable)
        except TimeoutError:
            return Error(msg_id, ErrorCode.DEADLINE_EXCEEDED, f"no result within {timeout_s}s")
        except Exception as exc:
            _log.exception("gateway: generate failed")
            return Error(msg_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        return None

    async def _generate(self, stream: _Stream, req: GenerateRequest, timeout_s: float | None) -> None:
        prompt_ids = prompt_ids_for(self._tokenizer, req, self.config.context_length)
        scheduler = self._scheduler if isinstance(self._scheduler, ActorRef) else self._scheduler()

        async def send_item(body: dict[str, Any]) -> None:
            await self._send(stream, StreamItem(stream.msg_id, stream.seq, body))
            stream.seq += 1

        body = scheduler_body(req, prompt_ids, self._stop_ids)
        end_body = await relay_generation(scheduler, body, self._tokenizer, send_item, req.stop,
                                          timeout_s=timeout_s, item_timeout_s=self.config.scheduler_timeout_s)
        await self._send(stream, StreamEnd(stream.msg_id, stream.seq, end_body))


def _failed_text(failures: list[str]) -> str:
    return "the server has failed and will not recover: " + "; ".join(failures)

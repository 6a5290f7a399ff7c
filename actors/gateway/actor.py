"""``GatewayActor``: the public front door. It owns its own ROUTER socket speaking the
wire protocol (``transport/PROTOCOL.md``, section "Gateway messages") through the runtime's
ROUTER request path (``runtime/inbound.py``, as a node's does), validates and
tokenizes ``generate`` requests, streams the scheduler's tokens back as text + token ids,
and cancels the scheduler stream when a client cancels or goes away. ``info`` and ``health``
report whether the server behind it has failed for good (a supervisor gave up).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeAlias

import zmq
import zmq.asyncio

from treeserve.actors.gateway.config import (
    GATEWAY_LIMITS,
    GATEWAY_TARGET,
    GatewayConfig,
    GatewayStats,
    TokenizerLike,
)
from treeserve.actors.gateway.peers import CancelReason, ClientPeers, PeerGone, Stream, cut_off_error
from treeserve.actors.gateway.request import GenerateRequest, InvalidRequest, parse_generate
from treeserve.actors.gateway.stream import (
    chat_roles_for,
    check_fits,
    error_reply,
    prompt_ids_for,
    relay_generation,
    scheduler_body,
)
from treeserve.runtime.actor import Actor, handler
from treeserve.runtime.inbound import Inbound, Refusal, bind_router
from treeserve.runtime.pump import SendOutcome
from treeserve.runtime.ref import ActorRef
from treeserve.runtime.stall import StallGuard
from treeserve.transport.messages import Error, Heartbeat, Message, Reply, Request, StreamEnd, StreamItem
from treeserve.transport.sockets import CurveAuthenticator, bound_endpoint
from treeserve.transport.wire import DEFAULT_LIMITS, ErrorCode

__all__ = [
    "GATEWAY_LIMITS",
    "GATEWAY_TARGET",
    "GatewayActor",
    "GatewayConfig",
    "GatewayStats",
    "TokenizerLike",
]

_log = logging.getLogger(__name__)

_SEND_RETRY_S = 0.005  # polling a slow client's full queue: 256 streams must not spin the loop
_FINAL_RETRY_S = 0.05  # retrying a lost stream's final error until its client is back


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
    the request's KV row. A stream the gateway cuts off (silence, a failed send, a dropped
    connection) still gets a final ``cancelled`` error, retried for ``disconnect_timeout_s``
    until the client is reachable again (a client that keeps its routing id across a
    reconnect gets it). Bad messages get an error reply (or are dropped and counted when
    no reply is possible); everyone else keeps being served. Which clients are watched,
    and when each was last heard, is ``ClientPeers`` (``peers.py``).

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
        self._roles = chat_roles_for(tokenizer)
        self._scheduler = scheduler
        self._failures = failures
        self._ctx: zmq.asyncio.Context | None = None
        self._auth: CurveAuthenticator | None = None
        self._sock: zmq.asyncio.Socket | None = None  # until the Inbound owns it
        self._inbound: Inbound[Stream] | None = None  # the open streams, by (peer, request id)
        self._endpoint = ""
        self._serve_task: asyncio.Task[None] | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._is_stopping = False
        self._peers = ClientPeers()

    # ------------------------------------------------------------------ lifecycle

    @property
    def endpoint(self) -> str:
        """The bound public endpoint (the real port after a ``:0`` bind)."""
        return self._endpoint

    @property
    def num_active_streams(self) -> int:
        """Generate streams currently open."""
        return 0 if self._inbound is None else self._inbound.num_open

    async def on_start(self) -> None:
        """Bind the public socket, start the stream owner (owned task), then receive."""
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        try:
            self._sock, self._auth = await bind_router(
                self._ctx, cfg.bind, limits=cfg.limits, curve=cfg.curve, allow_public_bind=cfg.allow_public_bind,
                handover=True)
            self._endpoint = bound_endpoint(self._sock)
        except BaseException:
            await self._close_sockets()
            raise
        started = asyncio.get_running_loop().create_future()
        self._serve_task = self.tasks.start(self._serve(started), f"serve:{self._endpoint}")
        await asyncio.wait([started, self._serve_task], return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            await self._close_sockets()
            raise RuntimeError("the gateway's stream owner ended before it served")
        # Requests are read only now: every stream they start has its TaskGroup.
        sock, self._sock = self._sock, None
        self._inbound = Inbound(
            sock, f"gateway {self._endpoint}", limits=cfg.limits, stats=self.stats_counters,
            admit=self._admit, cancel=self._on_client_cancel, heard_from=self._heard_from,
            on_disconnect=self._on_connection_dropped, send_limits=DEFAULT_LIMITS, send_retry_s=_SEND_RETRY_S,
        )
        _log.info("gateway serving on %s", self._endpoint)

    async def on_stop(self) -> None:
        """Refuse new streams, cancel every open one (clients get ``unavailable``), then
        close the socket."""
        self._is_stopping = True
        if self._inbound is not None:
            for stream in self._inbound.open_calls():
                if stream.cancel_reason is None:
                    stream.cancel_reason = CancelReason.SHUTDOWN
        task, self._serve_task = self._serve_task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=max(1.0, self.config.disconnect_timeout_s))
        await self._close_sockets()

    async def _close_sockets(self) -> None:
        inbound, self._inbound = self._inbound, None
        if inbound is not None:
            inbound.close()
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
                "num_active_streams": self.num_active_streams}

    async def _serve(self, started: asyncio.Future[None]) -> None:
        """Own the stream tasks and the liveness watch until cancelled (``on_stop``)."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self._watch_peers(), name="gateway:watch")
                started.set_result(None)
                await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            self._tg = None

    # ------------------------------------------------------------------ requests

    def _invalid(self, text: str) -> Refusal:
        self.stats_counters.num_invalid += 1
        return Refusal(ErrorCode.INVALID_REQUEST, text)

    def _admit(self, peer: bytes, req: Request, deadline: float | None) -> Stream | Refusal | None:
        """Answer ``info``/``health`` at once, or start a ``generate`` stream (``Inbound``
        already refused undecodable messages, reused ids and expired deadlines)."""
        if req.target != GATEWAY_TARGET:
            return Refusal(ErrorCode.NO_SUCH_ACTOR,
                           f"this endpoint only serves target {GATEWAY_TARGET!r}, not {req.target!r}")
        if req.method in ("info", "health"):
            if req.stream:
                return self._invalid(f"{req.method!r} is unary: send it with stream=false")
            self._send_now(peer, Reply(req.id, self._info() if req.method == "info" else self._health()))
            return None
        if req.method != "generate":
            return Refusal(ErrorCode.NO_SUCH_METHOD,
                           f"unknown method {req.method!r} (methods: 'generate' (stream), 'info', 'health')")
        if not req.stream:
            return self._invalid("'generate' streams: send it with stream=true")
        failures = self._current_failures()
        if failures:
            return Refusal(ErrorCode.UNAVAILABLE, _failed_text(failures), retryable=False)
        cfg = self.config
        try:
            parsed = parse_generate(
                req.body,
                vocab_size=self._vocab_size,
                context_length=cfg.context_length,
                max_prompt_chars=cfg.max_prompt_chars,
                roles=self._roles,
            )
        except InvalidRequest as exc:
            return self._invalid(str(exc))
        if self.num_active_streams >= cfg.max_concurrent_streams:
            self.stats_counters.num_overloaded += 1
            return Refusal(ErrorCode.OVERLOADED,
                           f"{self.num_active_streams} streams open (max {cfg.max_concurrent_streams}); retry later")
        if self._tg is None or self._is_stopping:
            return Refusal(ErrorCode.UNAVAILABLE, "the gateway is shutting down")
        stream = Stream(peer, req.id)
        timeout_s = None if req.timeout_ms is None else req.timeout_ms / 1000
        stream.task = self._tg.create_task(self._run_stream(stream, parsed, timeout_s),
                                           name=f"gateway:stream:{req.id}")
        self._peers.opened(peer, req.id, asyncio.get_running_loop().time())
        return stream

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
            "disconnect_timeout_s": cfg.disconnect_timeout_s,
        }

    # ------------------------------------------------------------------ liveness

    def _heard_from(self, peer: bytes) -> None:
        if peer in self._peers:  # any message is a sign of life
            self._peers.heard_from(peer, asyncio.get_running_loop().time())

    def _on_client_cancel(self, stream: Stream) -> None:
        self.stats_counters.num_cancels += 1
        self._cancel(stream, CancelReason.CLIENT_CANCEL)

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
            if not stalled:
                for peer in self._peers.silent(now, cfg.disconnect_timeout_s):
                    _log.info("gateway: client silent for over %.1fs; cancelling its streams",
                              cfg.disconnect_timeout_s)
                    self._disconnect(peer, CancelReason.SILENT)
            self._beat_all()

    def _beat_all(self) -> None:
        """Heartbeat every watched client; one that cannot be reached loses its streams."""
        for peer, seq in self._peers.next_beats():
            if self._send_now(peer, Heartbeat(seq, time.time(), GATEWAY_TARGET)) is SendOutcome.GONE:
                self._disconnect(peer, CancelReason.UNREACHABLE)

    def _on_connection_dropped(self) -> None:
        """ZeroMQ dropped a client connection (it does not say whose: a frame above the size
        limit, a vanished process): what was queued to that client is lost. Probe everyone
        now, before a client that keeps its routing id is back, so none loses items silently."""
        self._beat_all()

    def _disconnect(self, peer: bytes, why: CancelReason, current: Stream | None = None) -> None:
        """Cancel every stream of ``peer`` for ``why``; ``current`` (the caller's own stream,
        which is ending by itself) is only marked."""
        if current is not None:
            current.cancel_reason = why
        msg_ids = self._peers.pop(peer)
        if msg_ids is None:
            return
        self.stats_counters.num_disconnects += 1
        for msg_id in list(msg_ids):
            stream = None if self._inbound is None else self._inbound.get(peer, msg_id)
            if stream is not None and stream is not current:
                self._cancel(stream, why)

    def _cancel(self, stream: Stream, why: CancelReason) -> None:
        if stream.cancel_reason is None:
            stream.cancel_reason = why
        if stream.task is not None:
            stream.task.cancel()

    def _forget(self, stream: Stream) -> None:
        if self._inbound is not None:
            self._inbound.release(stream.peer, stream.msg_id)
        self._peers.closed(stream.peer, stream.msg_id)

    # ------------------------------------------------------------------ sending

    def _send_now(self, peer: bytes, msg: Message) -> SendOutcome:
        return SendOutcome.GONE if self._inbound is None else self._inbound.send(peer, msg)

    async def _send(self, stream: Stream, msg: Message) -> None:
        """Send, retrying while the client's queue is full; raises ``PeerGone`` when the
        client is gone or has not drained its queue within ``disconnect_timeout_s``."""
        inbound = self._inbound
        if inbound is None or not await inbound.send_when_ready(
                stream.peer, inbound.encode(msg), give_up_s=self.config.disconnect_timeout_s):
            raise PeerGone

    # ------------------------------------------------------------------ one stream

    async def _run_stream(self, stream: Stream, req: GenerateRequest, timeout_s: float | None) -> None:
        try:
            error = await self._generate_guarded(stream, req, timeout_s)
            if stream.cancel_reason in (CancelReason.SILENT, CancelReason.UNREACHABLE):
                self._tell_cut_off(stream)
            elif error is None:
                self.stats_counters.num_completed += 1
            else:
                self.stats_counters.num_failed += 1
                failures = self._current_failures()
                if failures and error.retryable:  # the server behind us is gone for good
                    error = Error(error.id, error.code, f"{error.message} ({_failed_text(failures)})", False)
                self._send_now(stream.peer, error)
        except asyncio.CancelledError:
            if stream.cancel_reason in (None, CancelReason.SHUTDOWN):
                self._send_now(stream.peer, Error(
                    stream.msg_id, ErrorCode.UNAVAILABLE, "the gateway is shutting down", True))
            elif stream.cancel_reason in (CancelReason.SILENT, CancelReason.UNREACHABLE):
                self._tell_cut_off(stream)
            raise
        finally:
            self._forget(stream)

    def _tell_cut_off(self, stream: Stream) -> None:
        """Send the final error of a stream the gateway cut off, now or, when its client cannot
        be reached, from an owned task that retries until it can or ``disconnect_timeout_s``."""
        cfg = self.config
        error = cut_off_error(stream.msg_id, is_silent=stream.cancel_reason is CancelReason.SILENT,
                              disconnect_timeout_s=cfg.disconnect_timeout_s,
                              heartbeat_interval_s=cfg.heartbeat_interval_s)
        if self._send_now(stream.peer, error) is SendOutcome.SENT or self._tg is None or self._is_stopping:
            return
        retry = self._deliver_when_reachable(stream.peer, error)
        try:
            self._tg.create_task(retry, name=f"gateway:final:{stream.msg_id}")
        except RuntimeError:  # the stream owner is ending (shutdown): the client hears no more
            retry.close()

    async def _deliver_when_reachable(self, peer: bytes, error: Error) -> None:
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self.config.disconnect_timeout_s
        while loop.time() < give_up_at:
            await asyncio.sleep(_FINAL_RETRY_S)
            if self._send_now(peer, error) is SendOutcome.SENT:
                return


    async def _generate_guarded(
        self, stream: Stream, req: GenerateRequest, timeout_s: float | None
    ) -> Error | None:
        try:
            async with asyncio.timeout(timeout_s):
                await self._generate(stream, req, timeout_s)
        except PeerGone:
            self._disconnect(stream.peer, CancelReason.UNREACHABLE, current=stream)
            return None
        except Exception as exc:
            if isinstance(exc, InvalidRequest):
                self.stats_counters.num_invalid += 1
            return error_reply(stream.msg_id, exc, timeout_s)
        return None

    async def _generate(self, stream: Stream, req: GenerateRequest, timeout_s: float | None) -> None:
        prompt_ids = prompt_ids_for(self._tokenizer, req, self.config.context_length)
        check_fits(len(prompt_ids), req.max_tokens, self.config.context_length)
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

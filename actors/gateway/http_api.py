"""``HttpGateway``: the OpenAI-compatible HTTP API (aiohttp), hosted in the server's own event
loop next to the ZeroMQ gateway or alone.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (and
``/v1/models/{id}``), ``GET /health``, ``GET /metrics``. Generations take the ZeroMQ gateway's
request path (``http_generate.py``); the OpenAI shapes are ``openai_api.py``.

Lifecycle: :meth:`start` listens at once, before the model is loaded, so that ``/health`` can say
``starting`` and generations get 503 with ``Retry-After`` instead of a refused connection;
:meth:`serve` hands it the backend (``ready``). Once ``failures`` is non-empty (a supervisor
gave up) it reports ``failed`` and refuses generations with 503. :meth:`aclose` (idempotent,
bounded) ends every open generation with an error event, then closes the listener.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from treeserve.actors.gateway.http_config import HttpConfig, ServingState
from treeserve.actors.gateway.http_generate import (
    HttpBackend,
    SseStream,
    dumps,
    new_head,
    prepare_generation,
    run_generation,
)
from treeserve.actors.gateway.openai_api import ApiError, Endpoint, api_error_from, parse_openai
from treeserve.actors.metrics import CONTENT_TYPE, ServingMetrics

__all__ = ["ROUTES", "HttpBackend", "HttpBindError", "HttpGateway"]

_log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_ENDPOINT_LABELS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
_STATUS_ERRORS = {  # aiohttp's own refusals, in OpenAI's shape
    404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "too_large"),
}


class HttpBindError(OSError):
    """The HTTP API cannot listen on its address (in use, not this host's, no permission)."""


def _endpoint_label(path: str) -> str:
    if path.startswith("/v1/models"):
        return "models"
    return _ENDPOINT_LABELS.get(path, "other")


def error_response(error: ApiError) -> web.Response:
    """``error`` as an HTTP answer: its status, OpenAI's JSON shape, ``Retry-After`` when set
    and ``WWW-Authenticate`` on a 401."""
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return web.Response(status=error.status, text=dumps(error.body()), content_type="application/json",
                        headers=headers)


ROUTES: tuple[tuple[str, str, str], ...] = (
    ("POST", "/v1/chat/completions", "_chat"),
    ("POST", "/v1/completions", "_completions"),
    ("GET", "/v1/models", "_models"),
    ("GET", "/v1/models/{model_id:.+}", "_model"),
    ("GET", "/health", "_health"),
    ("GET", "/metrics", "_render_metrics"),
)
"""Every route of the HTTP API: method, path and :class:`HttpGateway`'s handler. A new endpoint
is a row here and its handler (the fuzz test, ``tests/actors/gateway/test_fuzz_bodies.py``,
sends malformed bodies to every row)."""


class HttpGateway:
    """Serves the OpenAI-compatible API on ``config.host:config.port`` (see the module docstring).

    ``metrics`` counts its requests and renders ``/metrics``; ``failures`` says why the server
    can no longer serve (one line per supervisor that gave up; empty: healthy)."""

    def __init__(self, config: HttpConfig, metrics: ServingMetrics,
                 failures: Callable[[], Sequence[str]] = tuple) -> None:
        if not isinstance(config, HttpConfig):
            raise TypeError("HttpGateway needs an HttpConfig")
        self.config = config
        self._metrics = metrics
        self._failures = failures
        self._backend: HttpBackend | None = None
        self._runner: web.AppRunner | None = None
        self._address = ""
        self._created = int(time.time())
        self._open: set[asyncio.Task[Any]] = set()  # handlers of generations in flight
        self._is_stopping = False
        self._is_closed = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        """``HOST:PORT`` it listens on (the real port after a port-0 bind)."""
        if not self._address:
            raise RuntimeError("the HTTP API is not started")
        return self._address

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` (the base URL of the OpenAI SDKs is this plus ``/v1``)."""
        return f"http://{self.address}"

    @property
    def state(self) -> ServingState:
        if self._is_stopping:
            return ServingState.STOPPING
        if self._failures():
            return ServingState.FAILED
        return ServingState.STARTING if self._backend is None else ServingState.READY

    @property
    def num_in_flight(self) -> int:
        return len(self._open)

    async def start(self) -> None:
        """Listen; generations are refused with 503 until :meth:`serve`."""
        if self._runner is not None or self._is_closed:
            raise RuntimeError("HttpGateway.start: already started (or closed)")
        app = web.Application(middlewares=[self._middleware], client_max_size=self.config.max_body_bytes)
        for method, path, handler in ROUTES:
            app.router.add_route(method, path, getattr(self, handler))
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=self.config.shutdown_timeout_s)
        await runner.setup()
        self._runner = runner
        try:
            site = web.TCPSite(runner, self.config.host, self.config.port)
            await site.start()
        except OSError as exc:
            await self.aclose()
            raise HttpBindError(exc.errno, f"the HTTP API cannot listen on {self.config.address}: "
                                           f"{exc.strerror or exc}") from None
        except BaseException:
            await self.aclose()
            raise
        host, port = runner.addresses[0][:2]
        self._address = f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
        _log.info("HTTP API listening on %s", self.url)

    def serve(self, backend: HttpBackend) -> None:
        """The server is up: serve generations with ``backend`` from now on."""
        self._backend = backend

    async def aclose(self) -> None:
        """End every open generation (a stream gets an ``unavailable`` error event), stop
        listening, and wait at most ``shutdown_timeout_s`` for the connections. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = self._is_stopping = True
        for task in list(self._open):
            task.cancel()
        if self._open:
            await asyncio.wait(list(self._open), timeout=self.config.shutdown_timeout_s)
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # ------------------------------------------------------------------ middleware
    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """API-key check for ``/v1/``; every refusal in OpenAI's error shape, counted."""
        label = _endpoint_label(request.path)
        try:
            if request.path.startswith("/v1/"):
                self._check_api_key(request)
            return await handler(request)
        except ApiError as exc:
            error = exc
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            type_, code = _STATUS_ERRORS.get(exc.status, ("invalid_request_error", "bad_request"))
            error = ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}", type_=type_, code=code)
        if label != "other":
            self._metrics.on_http_request(label, "error", error.code)
        return error_response(error)

    def _check_api_key(self, request: web.Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        # compare_digest: the time taken does not tell how much of a guess was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           type_="authentication_error", code="invalid_api_key")

    # ------------------------------------------------------------------ routes
    async def _health(self, request: web.Request) -> web.Response:
        """``{"status": starting|ready|failed|stopping, "failures": [...]}``; 200 only when ready."""
        state = self.state
        body = {"status": state.value, "failures": list(self._failures())}
        return web.Response(status=200 if state is ServingState.READY else 503, text=dumps(body),
                            content_type="application/json")

    async def _render_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=await self._metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def _model_object(self) -> dict[str, Any]:
        return {"id": self.config.model_name, "object": "model", "created": self._created, "owned_by": "treeserve"}

    async def _models(self, request: web.Request) -> web.Response:
        self._metrics.on_http_request("models", "completed", None)
        return web.Response(text=dumps({"object": "list", "data": [self._model_object()]}),
                            content_type="application/json")

    async def _model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id != self.config.model_name:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", type_="not_found_error", code="model_not_found")
        self._metrics.on_http_request("models", "completed", None)
        return web.Response(text=dumps(self._model_object()), content_type="application/json")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.CHAT)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.COMPLETIONS)

    # ------------------------------------------------------------------ generations
    def _ready_backend(self) -> HttpBackend:
        cfg = self.config
        state = self.state
        if state is ServingState.STARTING:
            raise ApiError(503, "the server is starting (loading the model); retry shortly", type_="server_error",
                           code="unavailable", retry_after_s=cfg.starting_retry_after_s)
        if state is ServingState.FAILED:
            raise ApiError(503, "the server has failed and will not recover: " + "; ".join(self._failures()),
                           type_="server_error", code="unavailable", retry_after_s=cfg.failed_retry_after_s)
        if state is ServingState.STOPPING or self._backend is None:
            raise ApiError(503, "the server is shutting down", type_="server_error", code="unavailable",
                           retry_after_s=cfg.starting_retry_after_s)
        return self._backend

    async def _read_json(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError.bad_request(f"the request body is not valid JSON: {exc}") from None
        except RecursionError:  # the decoder recurses once per level of nesting
            raise ApiError.bad_request("the request body is nested too deeply") from None

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        cfg = self.config
        label = "chat" if endpoint is Endpoint.CHAT else "completions"
        backend = self._ready_backend()
        parsed = parse_openai(endpoint, await self._read_json(request), cfg.model_name)
        generation = prepare_generation(backend, parsed)
        if len(self._open) >= cfg.max_concurrent_requests:
            raise ApiError(429, f"{len(self._open)} generations in flight (max {cfg.max_concurrent_requests}); "
                                "retry later", type_="rate_limit_error", code="overloaded",
                           retry_after_s=cfg.overloaded_retry_after_s)
        task = asyncio.current_task()
        assert task is not None  # aiohttp runs every handler in a task
        head = new_head(parsed, cfg.model_name)
        stream = SseStream(request, head, parsed.include_usage) if parsed.stream else None
        self._open.add(task)
        self._metrics.http_in_flight.inc()
        try:
            response = await run_generation(backend, generation, head, stream)
        except asyncio.CancelledError:
            if self._is_stopping:  # our shutdown, not the client's leaving: say so if we still can
                self._metrics.on_http_request(label, "error", "unavailable")
                if stream is not None and stream.is_open:
                    await self._try_fail(stream, ApiError(503, "the server is shutting down", type_="server_error",
                                                          code="unavailable"))
            else:
                self._metrics.on_http_request(label, "cancelled", None)
            raise
        except Exception as exc:
            if isinstance(exc, ConnectionResetError) and stream is not None and stream.is_open:
                # The client left between two writes (the relay has closed the scheduler stream).
                self._metrics.on_http_request(label, "cancelled", None)
                return stream.response
            error = api_error_from(exc, overloaded_retry_after_s=cfg.overloaded_retry_after_s,
                                   unavailable_retry_after_s=(cfg.failed_retry_after_s if self._failures()
                                                              else cfg.overloaded_retry_after_s))
            if stream is None or not stream.is_open:
                raise error from None  # answered (and counted) by the middleware
            self._metrics.on_http_request(label, "error", error.code)
            await self._try_fail(stream, error)
            return stream.response
        finally:
            self._open.discard(task)
            self._metrics.http_in_flight.dec()
        self._metrics.on_http_request(label, "completed", None)
        return response

    @staticmethod
    async def _try_fail(stream: SseStream, error: ApiError) -> None:
        try:
            async with asyncio.timeout(1.0):
                await stream.fail(error)
        except (ConnectionResetError, TimeoutError):
            pass  # the client is gone: nobody left to tell

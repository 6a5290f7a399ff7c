"""Embedding: ``async with treeserve.Server(ServerConfig(...)) as server`` runs the whole actor
system inside the caller's running event loop (asyncio or uvloop).

Placement: the verifier shards (one per tensor-parallel rank, supervised together
``one_for_all`` because a TP group cannot survive the loss of one rank) and the speculator
actors (supervised ``one_for_one``) run in child processes that die with this one. The
scheduler and the public gateway are light I/O actors and run in this process; the scheduler
is supervised too (a ``LocalSupervisor`` restarts it when its step loop dies).
``server.endpoint`` is the gateway's bound endpoint for :class:`treeserve.Client`. The
configuration is :class:`~treeserve.server_config.ServerConfig` (re-exported here).

HTTP: with ``ServerConfig.http`` the OpenAI-compatible API (``actors/gateway/http_api.py``) runs in
this loop too, next to the ZeroMQ gateway or alone (``bind=None``). It listens first, before
the model is loaded, so ``/health`` says ``starting`` meanwhile; ``server.http_url`` is its
base URL. ``server.metrics`` (``actors/metrics.py``, a registry of its own) is fed by the
scheduler and the HTTP API and rendered at ``/metrics``.

Giving up: past ``max_restarts`` within ``restart_window_s`` a supervisor stops restarting.
The server does not then pretend to serve: ``Server.failures`` lists why, the gateway's
``info`` and ``health`` report ``status: "failed"``, new requests are refused with a
non-retryable ``unavailable``, and :meth:`Server.run_until` returns. ``treeserve serve`` then
stops and exits with status 1, so that a process manager restarts it (the server itself does
not keep retrying).
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from treeserve.actors.gateway.http_config import ServingState
from treeserve.actors.metrics import ServingMetrics
from treeserve.actors.speculator_factory import SpeculatorKind, SpeculatorSpec
from treeserve.ops.loaders.registry import ModelLoadError
from treeserve.actors.verifier_config import VerifierConfig
from treeserve.runtime import ActorRef, RestartStrategy, Runtime, SupervisorGaveUp
from treeserve import server_wiring as wiring
from treeserve.server_config import ServerConfig
from treeserve.server_devices import DevicePlacement, count_gpus, place_devices

def _num_cores() -> int:
    """Cores this process may run on (its CPU affinity, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prepare_model(config: ServerConfig, progress: Callable[[Any], None] | None = None) -> Any:
    """Pull/convert the model once in this process (so child processes never race on the cache)
    and return its tokenizer."""
    from treeserve.models import CONFIG_FILE, REGISTRY, convert_gguf, converted_dir_for, pull
    from treeserve.ops.tokenizer import Tokenizer

    path = Path(config.model).expanduser()
    if config.model in REGISTRY:
        path = pull(config.model, config.cache_dir, progress=progress)
    if path.is_file() and path.suffix == ".gguf":
        folder = converted_dir_for(path, config.cache_dir)
        if not (folder / CONFIG_FILE).exists():
            convert_gguf(path, folder, progress=progress)
        path = folder
    if path.is_dir():
        tokenizer = Tokenizer.from_folder(path)
        tokenizer.warm()  # the first request must not build what it needs
        return tokenizer
    raise FileNotFoundError(f"model {config.model!r} is neither a known model name, a .gguf file nor a folder")


class Server:
    """The whole treeserve actor system, embedded in the caller's running loop.

    ``async with Server(config) as server:`` starts it (model pull/convert, child processes,
    scheduler, gateway) and ``server.endpoint`` is ready for clients; leaving the block (or
    ``await server.aclose()``, idempotent and bounded) stops everything. The library never
    creates or replaces the event loop.
    """

    def __init__(self, config: ServerConfig | None = None, *, progress: Callable[[Any], None] | None = None) -> None:
        self.config = config or ServerConfig()
        self._progress = progress
        self._runtime: Runtime | None = None
        self._gateway: Any = None
        self.scheduler: ActorRef | None = None
        self.verifiers: list[ActorRef] = []
        self.speculators: list[ActorRef] = []
        self.placement = DevicePlacement((), ())
        """Each verifier rank's and speculator actor's device, set at :meth:`start`."""
        self.model_info: dict[str, Any] = {}
        self.verifier_supervisor: Any = None
        self.speculator_supervisor: Any = None
        self.predictor: ActorRef | None = None
        self.predictor_supervisor: Any = None
        self.scheduler_supervisor: Any = None
        self.failures: list[str] = []
        """Why the server can no longer serve: one line per supervisor that gave up (empty: healthy)."""
        self._failed = asyncio.Event()
        self._closed = False
        self._is_ready = False
        self.metrics = ServingMetrics()
        """This server's Prometheus metrics (``GET /metrics`` of the HTTP API renders them)."""
        self._http: Any = None
        self.metrics.watch(restarts=self._restart_counts, state=lambda: self.state,
                           scheduler_stats=self._scheduler_stats,
                           zmq_stats=lambda: None if self._gateway is None else asdict(self._gateway.stats_counters))

    async def __aenter__(self) -> Server:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def endpoint(self) -> str:
        """The gateway's public endpoint (the real port after a ``:0`` bind)."""
        if self._gateway is None:
            raise RuntimeError("the server has no ZeroMQ gateway (ServerConfig.bind is None)"
                               if self.config.bind is None else "the server is not started")
        return str(self._gateway.endpoint)

    @property
    def http_url(self) -> str:
        """``http://HOST:PORT`` of the HTTP API (the real port after a port-0 bind); the OpenAI
        SDKs' ``base_url`` is this plus ``/v1``."""
        if self._http is None:
            raise RuntimeError("the server has no HTTP API (ServerConfig.http is None)"
                               if self.config.http is None else "the server is not started")
        return str(self._http.url)

    @property
    def state(self) -> ServingState:
        """``starting`` until :meth:`start` is done, then ``ready``; ``failed`` once a supervisor
        gave up; ``stopping`` once closing."""
        if self._closed:
            return ServingState.STOPPING
        if self.failures:
            return ServingState.FAILED
        return ServingState.READY if self._is_ready else ServingState.STARTING

    def _restart_counts(self) -> dict[str, int]:
        supervisors = (self.verifier_supervisor, self.speculator_supervisor, self.predictor_supervisor,
                       self.scheduler_supervisor)
        return {str(s.name): int(s.num_restarts) for s in supervisors if s is not None}

    async def _scheduler_stats(self) -> dict[str, Any]:
        if self.scheduler is None:
            raise RuntimeError("no scheduler yet")
        return dict(await self.scheduler.ask("stats", timeout=5.0))

    @property
    def runtime(self) -> Runtime:
        """The head process's actor runtime."""
        if self._runtime is None:
            raise RuntimeError("the server is not started")
        return self._runtime

    def _report(self, message: str) -> None:
        if self._progress is not None:
            self._progress(message)

    def _on_give_up(self, exc: SupervisorGaveUp) -> None:
        self.failures.append(exc.message)
        self._failed.set()
        self._report(f"failed: {exc.message}")

    async def run_until(self, stop: asyncio.Event) -> list[str]:
        """Serve until ``stop`` is set or a supervisor gives up; return :attr:`failures`
        (empty when stopped on request)."""
        waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._failed.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
        return list(self.failures)

    async def _scheduler_peers(self) -> tuple[list[ActorRef], list[ActorRef]]:
        """The verifier shards and speculators the scheduler talks to (a seam: fault-injection
        tests put proxies in between)."""
        return self.verifiers, self.speculators

    async def start(self) -> None:
        """Start everything, in this order: the HTTP API (it says ``starting`` meanwhile), the
        model (pulled and converted here, once), the runtime, the verifier shards beside the
        speculators, the scheduler, the front ends."""
        cfg = self.config
        await self._start_http()
        self.placement = await asyncio.to_thread(self._place_devices)  # too few GPUs: fail before anything starts
        try:
            tokenizer = await asyncio.to_thread(prepare_model, cfg, self._progress)
        except ModelLoadError as exc:  # an unsupported model: /health says failed, and why, until we close
            self.failures.append(f"model: {exc}")
            raise
        self._runtime = Runtime(wiring.runtime_config(cfg))
        await self._runtime.start()
        agents = await self._join_nodes()
        speculators, predictor = await self._start_model_actors(agents)
        await self._start_scheduler(speculators, predictor)
        await self._serve_front_ends(tokenizer)
        self._is_ready = True

    async def _start_http(self) -> None:
        """The HTTP API first: while everything else loads, /health says "starting" and requests get 503."""
        http_config = self.config.http_config()
        if http_config is not None:
            from treeserve.actors.gateway.http_api import HttpGateway

            self._http = HttpGateway(http_config, self.metrics, failures=lambda: self.failures)
            await self._http.start()
            self._report(f"HTTP API on {self._http.url} (starting)")

    async def _join_nodes(self) -> list[ActorRef]:
        """The agents of the ``num_nodes`` hosts that joined (none without them)."""
        cfg, rt = self.config, self.runtime
        if not cfg.num_nodes:
            return []
        from treeserve.runtime.cluster import start_registry

        registry = await start_registry(rt)
        self._report(f"waiting for {cfg.num_nodes} node(s): run `treeserve node --join {rt.endpoint}`")
        return list(await registry.wait_for_nodes(cfg.num_nodes, cfg.node_wait_timeout_s))

    async def _start_model_actors(self, agents: list[ActorRef]) -> tuple[tuple[SpeculatorSpec, ...], ActorRef | None]:
        """The verifier shards (then the length predictor, checked against the model they
        report) beside the speculators: each is a child process that spends seconds importing
        torch and loading, and neither needs the other."""
        cfg = self.config
        self._report(f"starting {cfg.tp} verifier shard(s)")
        verifier_sup = self.verifier_supervisor = self.runtime.supervisor(
            wiring.supervisor_config(cfg, RestartStrategy.ONE_FOR_ALL), name="verifier-supervisor",
            on_give_up=self._on_give_up)
        dist_init = None
        if cfg.tp > 1:
            host = cfg.cluster_bind.split("://", 1)[1].rsplit(":", 1)[0] if agents else "127.0.0.1"
            dist_init = f"tcp://{host}:{_free_port()}"
        threads = cfg.verifier_threads or max(1, _num_cores() // (1 if agents else cfg.tp))
        shards = wiring.verifier_configs(cfg, self.placement.verifier_devices, dist_init, threads)

        async def start_verifiers_then_predictor() -> ActorRef | None:
            self.verifiers = list(await asyncio.gather(*(self._spawn_shard(s, verifier_sup, agents) for s in shards)))
            self.model_info = await self.verifiers[0].ask("info", timeout=cfg.start_timeout_s)
            return await self._start_predictor()

        try:
            async with asyncio.TaskGroup() as group:  # one failing cancels the other
                predictor_started = group.create_task(start_verifiers_then_predictor())
                speculators_started = group.create_task(self._start_speculators(agents))
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0]  # what went wrong, not the group it was caught in
        return speculators_started.result(), predictor_started.result()

    async def _start_scheduler(self, speculators: tuple[SpeculatorSpec, ...], predictor: ActorRef | None) -> None:
        """The scheduler, under a supervisor of its own in this process."""
        from treeserve.actors.scheduler.actor import SchedulerActor

        cfg = self.config
        use_states = bool(self.speculators) and any(s.kind is SpeculatorKind.FEATURE for s in speculators)
        head, unfit = await asyncio.to_thread(wiring.remaining_head, cfg, int(self.model_info["dim"]))
        if unfit is not None:
            self._report(unfit)
        scheduler_config = wiring.scheduler_config(cfg, int(self.model_info["vocab_size"]), use_states, head)
        verifiers, speculator_refs = await self._scheduler_peers()
        self.scheduler_supervisor = self.runtime.local_supervisor(
            wiring.supervisor_config(cfg), name="scheduler-supervisor", on_give_up=self._on_give_up)
        self.scheduler = await self.scheduler_supervisor.start_child(
            "scheduler", lambda: SchedulerActor(scheduler_config, verifiers, speculator_refs, predictor,
                                                observer=self.metrics))

    async def _serve_front_ends(self, tokenizer: Any) -> None:
        """The ZeroMQ gateway (with ``bind``) and the HTTP API's requests (with ``http``)."""
        from treeserve.actors.gateway.actor import GatewayActor

        cfg = self.config
        gateway_config = wiring.gateway_config(cfg, int(self.model_info["vocab_size"]))
        if cfg.bind is not None:
            gateway = GatewayActor(gateway_config, tokenizer, self.scheduler, failures=lambda: self.failures)
            await self.runtime.node.host("gateway", gateway)
            self._gateway = gateway
            self._report(f"serving on {self.endpoint}")
        if self._http is not None:
            from treeserve.actors.gateway.http_api import HttpBackend
            from treeserve.actors.gateway.stream import chat_roles_for

            self._http.serve(HttpBackend(
                tokenizer=tokenizer, scheduler=self.scheduler, vocab_size=gateway_config.vocab_size or 0,
                context_length=gateway_config.context_length, max_prompt_chars=gateway_config.max_prompt_chars,
                scheduler_timeout_s=gateway_config.scheduler_timeout_s, roles=chat_roles_for(tokenizer),
            ))
            self._report(f"HTTP API ready on {self._http.url}")

    async def forget_traffic(self) -> None:
        """Empty the speculators' suffix indexes, which learn from every request served: later
        requests draft only from what follows. For benchmarks that replay prompts and must not
        let earlier passes' answers draft the later ones."""
        cfg = self.config
        await asyncio.gather(*(s.ask("forget_traffic", None, timeout=cfg.step_timeout_s) for s in self.speculators))

    async def _start_speculators(self, agents: list[ActorRef]) -> tuple[SpeculatorSpec, ...]:
        """Spawn the speculator actors (none without speculators or actors); returns the specs."""
        from treeserve.actors.speculator import SpeculatorActor

        cfg, rt = self.config, self.runtime
        speculators = cfg.speculator_specs()
        if not speculators or not cfg.num_speculator_actors:
            return speculators
        self._report(f"starting {cfg.num_speculator_actors} speculator actor(s)")
        spec_sup = self.speculator_supervisor = rt.supervisor(
            wiring.supervisor_config(cfg), name="speculator-supervisor", on_give_up=self._on_give_up)
        # One actor per device (see place_devices).
        spec_configs = wiring.speculator_configs(cfg, self.placement.speculator_devices, speculators)
        if agents:
            from treeserve.runtime.cluster import spawn_on

            self.speculators = list(await asyncio.gather(*(
                spawn_on(agents[i % len(agents)], SpeculatorActor, f"speculator-{i}", [spec_config],
                         timeout=cfg.start_timeout_s + 30)
                for i, spec_config in enumerate(spec_configs)
            )))
        else:
            self.speculators = list(await asyncio.gather(*(
                rt.spawn(SpeculatorActor, spec_config, name=f"speculator-{i}", process="child", supervisor=spec_sup)
                for i, spec_config in enumerate(spec_configs)
            )))
        return speculators

    async def _start_predictor(self) -> ActorRef | None:
        """Spawn the length predictor when the policy orders by predicted length (else None)."""
        from treeserve.actors.length_predictor import LengthPredictorActor
        from treeserve.ops.length_predictor import load_predictor

        cfg = self.config
        if not cfg.scheduling.uses_predictions:
            return None
        predictor = await asyncio.to_thread(load_predictor, cfg.predictor)
        if cfg.predictor is None and predictor.meta.get("model") != cfg.model:
            self._report(f"no length predictor for {cfg.model!r} (the shipped one is for {predictor.meta.get('model')!r}): "
                         f"{cfg.scheduling.policy} orders by max_tokens; train one with `treeserve train-predictor`")
            return None
        info = self.model_info
        if predictor.spec.needs_model and (
            predictor.mean.shape[0] != 2 * int(info["dim"]) + 1 or predictor.spec.num_layers > int(info["num_layers"])
        ):
            raise ValueError(f"predictor {cfg.predictor} reads {predictor.mean.shape[0]} features of "
                             f"{predictor.spec.num_layers} blocks, which model {cfg.model!r} does not give: "
                             "train one for this model (treeserve train-predictor)")
        self._report("starting the length predictor")
        supervisor = self.predictor_supervisor = self.runtime.supervisor(
            wiring.supervisor_config(cfg), name="predictor-supervisor", on_give_up=self._on_give_up)
        config = wiring.predictor_config(cfg, self.placement.verifier_devices[0])
        self.predictor = await self.runtime.spawn(
            LengthPredictorActor, config, name="length-predictor", process="child", supervisor=supervisor)
        return self.predictor

    def _place_devices(self) -> DevicePlacement:
        """Each rank's and speculator's device (:func:`~treeserve.server_devices.place_devices`);
        with nodes, every actor keeps the configured device (each host resolves its own)."""
        cfg = self.config
        if cfg.device == "cpu" or cfg.num_nodes:
            return DevicePlacement((cfg.device,) * cfg.tp, (cfg.device,) * cfg.num_speculator_actors)
        return place_devices(cfg.device, cfg.tp, cfg.num_speculator_actors, count_gpus())

    async def _spawn_shard(self, config: VerifierConfig, supervisor: Any, agents: list[ActorRef]) -> ActorRef:
        """Rank 0 (and every rank without nodes) runs as a child here; other ranks on nodes."""
        from treeserve.actors.verifier import VerifierShard

        rank = config.tp_rank
        shard = config.to_wire()
        name = f"verifier-{rank}"
        if rank == 0 or not agents:
            return await self.runtime.spawn(VerifierShard, shard, name=name, process="child", supervisor=supervisor)
        from treeserve.runtime.cluster import spawn_on

        return await spawn_on(
            agents[(rank - 1) % len(agents)], VerifierShard, name, [shard],
            group="verifier", strategy="one_for_all", timeout=self.config.start_timeout_s + 30,
        )

    async def aclose(self) -> None:
        """Stop every actor and child process; safe to call twice, bounded by the runtime's timeout."""
        if self._closed:
            return
        self._closed = True
        http, self._http = self._http, None
        if http is not None:  # first: its open generations end while the scheduler still runs
            await http.aclose()
        if self._runtime is not None:
            await self._runtime.aclose()


__all__ = ["Server", "ServerConfig", "prepare_model"]

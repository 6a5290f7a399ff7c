"""``treeserve serve`` (run the server until interrupted) and ``treeserve node`` (offer this host's
devices to a head). Flag defaults are :class:`~treeserve.server_config.ServerConfig`'s.

Front ends: the ZeroMQ gateway on ``--bind`` (``--no-zmq`` turns it off) and, with
``--http HOST:PORT``, the OpenAI-compatible HTTP API (``--api-key``/``--api-key-file``: a bearer
token, required off loopback). ``--log-every-s`` prints a one-line load summary (0: never)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treeserve.actors.scheduler.policy import POLICY_NAMES, PREDICTION_POLICIES
from treeserve.actors.scheduler.types import SchedulerSettings
from treeserve.actors.speculator_factory import SPEC_SYNTAX, SpeculatorSpec, parse_speculator
from treeserve.cli_common import (
    UserError,
    add_expansion_flag,
    add_format_flag,
    add_model_flags,
    model_name,
    parse_expansion,
    progress,
)
from treeserve.server_config import ServerConfig

NO_SPECULATION = "none"
DEFAULT_LOG_EVERY_S = 10.0


def add_serve_parser(sub: Any) -> None:
    """The ``serve`` subcommand's flags."""
    defaults = ServerConfig()
    serve = sub.add_parser("serve", help="run the server until interrupted")
    add_model_flags(serve)
    serve.add_argument("--bind", default=defaults.bind, help="public ZeroMQ gateway endpoint")
    serve.add_argument("--no-zmq", action="store_true", help="no ZeroMQ gateway: serve only the HTTP API (needs --http)")
    serve.add_argument("--http", default=None, metavar="HOST:PORT",
                       help="also serve the OpenAI-compatible HTTP API there, e.g. 127.0.0.1:8000 (port 0: a free one)")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="HTTP API key (Authorization: Bearer KEY); required when --http is not loopback")
    serve.add_argument("--api-key-file", type=Path, default=None, metavar="PATH",
                       help="read the HTTP API key from this file (keeps it out of the process list)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model id the HTTP API lists and requests name (default: --model)")
    serve.add_argument("--log-every-s", type=float, default=DEFAULT_LOG_EVERY_S, metavar="S",
                       help="print a one-line load summary every S seconds (0: never; default %(default)s)")
    serve.add_argument(
        "--speculator", action="append", default=None, metavar="SPEC",
        help=f"speculator kind, repeatable, tried in this order: {SPEC_SYNTAX} (default: the server's default "
             f"set); '{NO_SPECULATION}' disables speculation",
    )
    add_expansion_flag(serve)
    serve.add_argument("--tp", type=int, default=defaults.tp, help="tensor-parallel verifier ranks")
    scheduling = serve.add_argument_group("scheduling", "the scheduler's own settings (SchedulerSettings: each "
                                          "flag's dest is its field)")
    scheduling.add_argument("--scheduler", dest="policy", choices=POLICY_NAMES, default=defaults.scheduling.policy,
                            help=f"admission order; {'/'.join(PREDICTION_POLICIES)} use the output-length predictor")
    scheduling.add_argument("--max-wait-s", type=float, default=defaults.scheduling.max_wait_s,
                            help=f"aging bound of {'/'.join(PREDICTION_POLICIES)}: a request waits at most about "
                                 "this long behind later ones")
    serve.add_argument("--predictor", type=Path, default=None,
                       help="length predictor .npz from `treeserve train-predictor` (default: the shipped one)")
    serve.add_argument("--no-online-predictor", action="store_true",
                       help="do not refine the predictor from completed requests")
    serve.add_argument("--remaining-head", default=None, metavar="NPZ",
                       help="with --preempt-rows: the head that re-predicts running requests from their hidden "
                            "states (default: the shipped one, for the default model; none: from their tokens alone)")
    scheduling.add_argument("--no-adaptive", dest="adaptive_speculation", action="store_false",
                            help="always draft max-size token trees instead of sizing them by batch and measured gain")
    add_format_flag(serve)
    serve.add_argument("--device", default=defaults.device,
                       help="cpu or cuda[:N]: tensor-parallel rank r on GPU N+r (NCCL, also for --tp 1), speculators "
                            "on the GPUs no rank holds first")
    serve.add_argument("--num-rows", type=int, default=defaults.num_rows, help="concurrent requests (KV-cache rows; default %(default)s)")
    serve.add_argument("--row-capacity", type=int, default=defaults.row_capacity, help="tokens per KV-cache row")
    serve.add_argument("--no-prefix-reuse", action="store_true",
                       help="prefill every prompt whole, instead of reusing the K/V of what its row held before "
                            "where they start alike (reused only where it gives the same answer: the int formats)")
    scheduling.add_argument("--max-queue", type=int, default=defaults.scheduling.max_queue, metavar="N",
                            help="requests waiting for a row before new ones are refused as overloaded "
                                 "(default %(default)s)")
    scheduling.add_argument("--max-prefill-tokens", type=int, default=defaults.scheduling.max_prefill_tokens,
                            help="prompt tokens per prefill call: requests admitted together share batched forwards")
    scheduling.add_argument("--decode-ahead", dest="max_decode_steps", type=int,
                            default=defaults.scheduling.max_decode_steps, metavar="STEPS",
                            help="when nothing speculates or waits, run up to this many plain decode steps per "
                                 "verifier call (about 0.1 s of them; 1: off; default %(default)s)")
    scheduling.add_argument("--preempt-rows", type=int, default=defaults.scheduling.preempt_rows, metavar="N",
                            help="limited preemption (ssjf/hrrn): N more KV-cache rows where a running request with a "
                                 "long predicted remainder waits, its cache kept, while a far shorter queued one runs "
                                 "(0: off; default %(default)s)")
    scheduling.add_argument("--max-preemptions", type=int, default=defaults.scheduling.max_preemptions, metavar="N",
                            help="times one request may be preempted (default %(default)s)")
    serve.add_argument("--allow-public-bind", action="store_true", help="allow a non-loopback --bind")
    serve.add_argument("--max-restarts", type=int, default=defaults.max_restarts,
                       help=f"restarts a supervisor makes within {defaults.restart_window_s:g} s before the server "
                            "fails and exits with status 1")
    serve.add_argument("--nodes", type=int, default=defaults.num_nodes, help="wait for this many `treeserve node` hosts to join")
    serve.add_argument("--cluster-bind", default=defaults.cluster_bind, help="endpoint nodes join")


def add_node_parser(sub: Any) -> None:
    """The ``node`` subcommand's flags."""
    node = sub.add_parser("node", help="offer this host's devices to a head server")
    node.add_argument("--join", required=True, metavar="tcp://HEAD:PORT", help="the head's --cluster-bind endpoint")
    node.add_argument("--advertise-host", default="127.0.0.1", help="address of this host that the head can reach")
    node.add_argument("--allow-public-bind", action="store_true", help="allow a non-loopback --advertise-host")
    node.add_argument("--devices", default=None, help="comma-separated, e.g. cuda:0,cuda:1 (default: detect)")


def speculators_from_flags(specs: Sequence[str] | None, expansion: tuple[int, ...]) -> tuple[SpeculatorSpec, ...] | None:
    """The ``--speculator`` flags as specs (None: the server's defaults; ``none``: no speculation)."""
    if specs is None:
        return None
    if NO_SPECULATION in specs:
        return ()
    try:
        return tuple(parse_speculator(spec, expansion) for spec in specs)
    except ValueError as exc:
        raise UserError(f"--speculator: {exc}") from None


def scheduler_settings(args: argparse.Namespace) -> SchedulerSettings:
    """The scheduler's settings from the flags whose ``dest`` is a field of
    :class:`~treeserve.actors.scheduler.types.SchedulerSettings`; a bad value is a
    :class:`UserError`."""
    try:
        return SchedulerSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SchedulerSettings)
                                    if hasattr(args, f.name)})
    except ValueError as exc:
        raise UserError(str(exc)) from None


def server_config(**fields: Any) -> ServerConfig:
    """A :class:`ServerConfig`, its ``ValueError`` as a :class:`UserError`."""
    try:
        return ServerConfig(**fields)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def api_key_from_flags(key: str | None, key_file: Path | None) -> str | None:
    """``--api-key``, or the first line of ``--api-key-file`` (not both)."""
    if key is not None and key_file is not None:
        raise UserError("give --api-key or --api-key-file, not both")
    if key_file is None:
        return key
    try:
        lines = key_file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UserError(f"--api-key-file: cannot read {key_file}: {exc.strerror}") from None
    if not lines or not lines[0].strip():
        raise UserError(f"--api-key-file: {key_file} is empty")
    return lines[0].strip()


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; status 1 when a supervisor gave up (the process manager restarts us)."""
    import time

    import uvloop

    from treeserve.actors.load_log import log_load_every
    from treeserve.server import Server

    if args.no_zmq and args.http is None:
        raise UserError("--no-zmq leaves nothing to serve: add --http HOST:PORT")
    if not args.log_every_s >= 0:
        raise UserError(f"--log-every-s must be >= 0, got {args.log_every_s}")
    specs = speculators_from_flags(args.speculator, parse_expansion(args.expansion))
    config = server_config(
        model=model_name(args),
        cache_dir=None if args.cache_dir is None else str(args.cache_dir),
        compile_in_background=True,  # a long-lived server: serve eagerly while a first compile runs
        bind=None if args.no_zmq else args.bind,
        http=args.http,
        api_key=api_key_from_flags(args.api_key, args.api_key_file),
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=args.device,
        tp=args.tp,
        scheduling=scheduler_settings(args),
        predictor=None if args.predictor is None else str(args.predictor),
        online_predictor=not args.no_online_predictor,
        remaining_head=args.remaining_head,
        num_rows=args.num_rows,
        row_capacity=args.row_capacity,
        reuse_prefixes=not args.no_prefix_reuse,
        speculators=None if specs is None else tuple(s.to_wire() for s in specs),
        allow_public_bind=args.allow_public_bind,
        num_nodes=args.nodes,
        cluster_bind=args.cluster_bind,
        max_restarts=args.max_restarts,
    )

    async def serve() -> list[str]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with Server(config, progress=progress) as server:
            where = [] if config.bind is None else [f"clients connect to {server.endpoint}"]
            if config.http is not None:
                where.append(f"OpenAI clients use {server.http_url}/v1")
            progress(f"ready: {', '.join(where)} (Ctrl-C stops)")
            async with asyncio.TaskGroup() as tasks:
                if args.log_every_s > 0:
                    log_task = tasks.create_task(
                        log_load_every(args.log_every_s, server.metrics, progress, time.monotonic))
                failures = await server.run_until(stop)
                if args.log_every_s > 0:
                    log_task.cancel()
            progress("stopping")
        return failures

    from treeserve.actors.gateway.http_api import HttpBindError
    from treeserve.server_devices import DeviceUnavailableError

    try:
        failures = uvloop.run(serve())
    except HttpBindError as exc:  # a port in use is the user's to fix, not a crash
        raise UserError(str(exc.strerror)) from None
    except DeviceUnavailableError as exc:  # more ranks than GPUs, or no CUDA: fails before anything starts
        raise UserError(str(exc)) from None
    if failures:  # a supervisor gave up: let the process manager restart us
        print(f"treeserve: error: the server failed: {'; '.join(failures)}", file=sys.stderr)
        return 1
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    """Join a head until it drops us (status 3) or we are interrupted (status 0)."""
    import uvloop

    from treeserve.runtime.cluster import JoinError, join
    from treeserve.runtime.cluster_config import NodeConfig, NodeExit

    try:
        devices = None if args.devices is None else tuple(d.strip() for d in args.devices.split(",") if d.strip())
        config = NodeConfig(advertise_host=args.advertise_host, allow_public_bind=args.allow_public_bind, devices=devices)
    except (TypeError, ValueError) as exc:
        raise UserError(str(exc)) from None

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        joined = asyncio.ensure_future(
            join(args.join, node_config=config, on_ready=lambda agent: progress(f"joined {args.join} as {agent.endpoint}"))
        )
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({joined, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not joined.done():
                joined.cancel()
                try:
                    await joined
                except asyncio.CancelledError:
                    pass
                return 0
        try:
            outcome = joined.result()
        except JoinError as exc:
            raise UserError(str(exc)) from None
        progress(f"node exits: {outcome.value}")
        return 3 if outcome is NodeExit.DROPPED_BY_HEAD else 0

    return int(uvloop.run(run()))


__all__ = ["add_node_parser", "add_serve_parser", "api_key_from_flags", "cmd_node", "cmd_serve", "server_config",
           "speculators_from_flags"]

"""Entry point of a child process: ``python -m treeserve.runtime.child PARENT_PID [--prestarted]``.

With ``--prestarted`` (:func:`~treeserve.runtime.process.prestart`) it first reads a
``Warmup`` from stdin, imports the actor's module and runs the warm-up hook, and exits quietly
if the parent closes stdin before a spec follows. Then it reads a ``ChildLaunch`` spec from
stdin, hosts the one actor it names on a fresh node under uvloop, reports readiness to the
parent's runtime, beats heartbeats to it, and exits when stdin reaches EOF (the parent closed
it, or died) or on SIGTERM. This module is a program entry point, so it owns its event loop;
library code never does.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import sys
import threading

from treeserve.runtime.process import (
    ChildLaunch,
    Warmup,
    decode_args,
    read_launch,
    read_warmup,
    set_parent_death_signal,
)

__all__ = ["main"]

_READY_TIMEOUT_S = 10.0


def _warm_up(warmup: Warmup) -> None:
    """Import the actor's module and run the hook. A failure only costs its time: the start
    that follows imports the actor again and raises what is wrong.

    The hook runs on a thread of its own, not on this main thread (the event loop's, later):
    a verifier whose main thread had read its model before serving decoded 15-20% slower for
    good (55-62 against 65-80 tokens/s, 128-token runs, 2 cores), and on a thread it did not.
    """
    try:
        importlib.import_module(warmup.actor.partition(":")[0])
        if not warmup.hook:
            return
        module_name, _, name = warmup.hook.partition(":")
        hook = getattr(importlib.import_module(module_name), name)
    except Exception:
        logging.getLogger(__name__).warning("warming up %s failed; starting without it", warmup.actor,
                                            exc_info=True)
        return

    def run() -> None:
        try:
            hook(**warmup.hook_args)
        except Exception:
            logging.getLogger(__name__).warning("warming up %s failed; starting without it", warmup.actor,
                                                exc_info=True)

    thread = threading.Thread(target=run, name="warm-up")
    thread.start()
    thread.join()


def _import_actor(path: str) -> type:
    module_name, _, qualname = path.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TypeError(f"{path} is not a class")
    return obj


async def _serve(spec: ChildLaunch) -> None:
    from treeserve.runtime.actor import Actor
    from treeserve.runtime.config import RuntimeConfig
    from treeserve.runtime.runtime import SYSTEM_ACTOR, Runtime
    from treeserve.transport.messages import ActorAddress

    actor_cls = _import_actor(spec.actor)
    if not issubclass(actor_cls, Actor):
        raise TypeError(f"{spec.actor} is not an Actor subclass")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_stdin() -> None:
        try:
            data = os.read(0, 4096)
        except OSError:
            data = b""
        if not data:  # EOF: the parent closed the death pipe or died
            loop.remove_reader(0)
            stop.set()

    loop.add_reader(0, on_stdin)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    config = RuntimeConfig(
        bind=spec.bind,
        parent_endpoint=spec.parent_endpoint,
        node_name=spec.node_name,
        heartbeat_interval_s=spec.heartbeat_interval_s,
        close_timeout_s=2.0,
        allow_public_bind=spec.allow_public_bind,
        curve=spec.curve,
    )
    async with Runtime(config) as rt:
        await rt.spawn(actor_cls, *decode_args(spec.args, rt.node), name=spec.name)
        parent = rt.node.ref(ActorAddress(spec.parent_endpoint, SYSTEM_ACTOR))
        await parent.ask(
            "child_ready",
            {"node": spec.node_name, "endpoint": rt.endpoint, "pid": os.getpid()},
            timeout=_READY_TIMEOUT_S,
        )
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    """Run one child; returns the process exit status."""
    args = sys.argv[1:] if argv is None else argv
    prestarted = args[1:] == ["--prestarted"]
    if not (len(args) == 1 or prestarted) or not args[0].isdigit():
        sys.stderr.write("usage: python -m treeserve.runtime.child PARENT_PID [--prestarted] (spec on stdin)\n")
        return 2
    # Ctrl-C reaches the whole process group; the parent decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if prestarted:
        set_parent_death_signal()
        if os.getppid() != int(args[0]):
            return 1
        _warm_up(read_warmup(sys.stdin.buffer))
        try:
            spec = read_launch(sys.stdin.buffer)
        except EOFError:  # never claimed: the parent discarded this child (or died)
            return 0
    else:
        spec = read_launch(sys.stdin.buffer)
    if spec.use_pdeathsig:
        set_parent_death_signal()
    # The parent may have died before prctl took effect: then we were re-parented.
    if os.getppid() != int(args[0]):
        return 1
    import uvloop

    uvloop.run(_serve(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Launching and killing child processes that each host one actor on their own node.

The launch spec is a msgpack map written to the child's stdin behind a 4-byte length;
nothing is pickled. stdin then stays open as the *death pipe*: when this process dies,
the kernel closes its end and the child sees EOF and exits. On Linux the child also asks
for ``PR_SET_PDEATHSIG``/``SIGKILL``, which works even when its loop is hung.

**Prestarted children.** A child's start is mostly imports (torch alone takes about 2 s on
this project's 2 cores) and loading. :func:`prestart` starts a child before its spec exists,
so that it imports its actor's module and runs a warm-up hook (a command-line tool prestarts
its verifier before importing anything heavy itself) while the parent is still starting; the
next :meth:`ChildProcess.launch` of the same actor class hands its spec to that child instead
of starting a new one. A prestarted child that is never claimed exits when
:func:`discard_prestarted` (or this process's exit) closes its death pipe.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

import msgpack

# Nothing heavier at import: the command line imports this module first, to prestart a child
# before anything else (see "Prestarted children" above).
if TYPE_CHECKING:
    from treeserve.runtime.curve import LinkCurve
    from treeserve.runtime.node import Node

__all__ = [
    "ChildLaunch",
    "ChildProcess",
    "Warmup",
    "decode_args",
    "discard_prestarted",
    "encode_args",
    "prestart",
    "read_launch",
    "read_warmup",
    "set_parent_death_signal",
]

_LEN = struct.Struct(">I")
_MAX_SPEC_BYTES = 60_000  # stays below a pipe buffer, so writing it never blocks
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class ChildLaunch:
    """What a child process needs to start: the actor class as ``"pkg.module:Class"``,
    msgpack-able ``args``, the actor ``name``, the child node's ``node_name`` (sent in
    its heartbeats) and ``bind`` endpoint, the parent's endpoint and pid, and the
    heartbeat interval. ``args`` holds the constructor arguments as one encoded wire
    frame (see ``encode_args``), so refs can be passed to a child actor.
    ``use_pdeathsig=False`` leaves only the death pipe (tests). ``allow_public_bind``
    lets the child bind a non-loopback ``bind`` address (nodes of a cluster); ``curve``
    is its parent's ``LinkCurve`` (the child's links are secured as its parent's are)."""

    actor: str
    name: str
    node_name: str
    bind: str
    parent_endpoint: str
    parent_pid: int
    heartbeat_interval_s: float
    args: bytes = b""
    use_pdeathsig: bool = True
    allow_public_bind: bool = False
    curve: LinkCurve | None = None

    def __post_init__(self) -> None:
        module, sep, qualname = self.actor.partition(":")
        if not sep or not module or not qualname:
            raise ValueError(f"actor class must be given as 'pkg.module:Class', got {self.actor!r}")

    def to_bytes(self) -> bytes:
        """The length-prefixed msgpack form written to the child's stdin."""
        try:
            payload = msgpack.packb(
                {
                    "actor": self.actor,
                    "args": self.args,
                    "name": self.name,
                    "node_name": self.node_name,
                    "bind": self.bind,
                    "parent_endpoint": self.parent_endpoint,
                    "parent_pid": self.parent_pid,
                    "heartbeat_interval_s": self.heartbeat_interval_s,
                    "use_pdeathsig": self.use_pdeathsig,
                    "allow_public_bind": self.allow_public_bind,
                    "curve": None if self.curve is None else self.curve.to_map(),
                },
                use_bin_type=True,
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"child launch spec is not msgpack-able: {exc}") from exc
        assert isinstance(payload, bytes)
        if len(payload) > _MAX_SPEC_BYTES:
            raise ValueError(f"child launch spec is {len(payload)} bytes > {_MAX_SPEC_BYTES}")
        return _LEN.pack(len(payload)) + payload


def encode_args(args: list[Any]) -> bytes:
    """Encode actor constructor args (msgpack-able values and ``ActorRef``s, no
    tensors) as one wire frame, reusing the message codec's validation."""
    from treeserve.runtime.bodies import body_to_wire
    from treeserve.transport.codec import encode
    from treeserve.transport.messages import Request

    frames = encode(Request(0, "", "__init__", body_to_wire(list(args))))
    if len(frames) != 1:
        raise ValueError("child actor args must not contain tensors")
    return bytes(frames[0])


def decode_args(data: bytes, node: Node) -> list[Any]:
    """Inverse of ``encode_args`` in the child, with refs bound to ``node``."""
    from treeserve.runtime.bodies import body_from_wire
    from treeserve.transport.codec import decode
    from treeserve.transport.messages import Request

    msg = decode([data])
    if not isinstance(msg, Request) or not isinstance(msg.body, list):
        raise ValueError("malformed child actor args")
    result: list[Any] = body_from_wire(msg.body, node)
    return result


@dataclass(frozen=True, slots=True)
class Warmup:
    """What a prestarted child does before its spec arrives: import ``actor``'s module
    (``"pkg.module:Class"``), then call ``hook`` (``"pkg.module:function"``, or empty) with
    the msgpack-able keyword arguments ``hook_args``. The hook only prepares: a failure is
    logged and the child starts as usual, and what the hook did must be redone by the actor
    when it does not match (it caches, it does not configure)."""

    actor: str
    hook: str = ""
    hook_args: Mapping[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """The length-prefixed msgpack form written to a prestarted child's stdin, before its spec."""
        payload = msgpack.packb({"actor": self.actor, "hook": self.hook, "hook_args": dict(self.hook_args)},
                                use_bin_type=True)
        assert isinstance(payload, bytes)
        if len(payload) > _MAX_SPEC_BYTES:
            raise ValueError(f"warm-up spec is {len(payload)} bytes > {_MAX_SPEC_BYTES}")
        return _LEN.pack(len(payload)) + payload


def _read_frame(stream: BinaryIO, what: str) -> dict[str, Any]:
    head = stream.read(_LEN.size)
    if not head:
        raise EOFError(f"parent closed the launch pipe before sending a {what}")
    if len(head) != _LEN.size:
        raise ValueError(f"parent closed the launch pipe in the middle of a {what}")
    (size,) = _LEN.unpack(head)
    if size > _MAX_SPEC_BYTES:
        raise ValueError(f"{what} of {size} bytes is too large")
    raw = msgpack.unpackb(stream.read(size), raw=False)
    if not isinstance(raw, dict):
        raise ValueError(f"{what} is not a map")
    return raw


def read_warmup(stream: BinaryIO) -> Warmup:
    """Read the warm-up written by :func:`prestart` (child side, before :func:`read_launch`)."""
    raw = _read_frame(stream, "warm-up spec")
    return Warmup(actor=str(raw["actor"]), hook=str(raw.get("hook", "")), hook_args=dict(raw.get("hook_args") or {}))


def read_launch(stream: BinaryIO) -> ChildLaunch:
    """Read the spec written by ``ChildProcess.launch`` (child side); ``EOFError`` if the
    pipe closed before it began."""
    raw = _read_frame(stream, "launch spec")
    curve = raw.pop("curve", None)
    from treeserve.runtime.curve import LinkCurve

    return ChildLaunch(**raw, curve=None if curve is None else LinkCurve.from_map(curve))


def set_parent_death_signal() -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return int(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)) == 0


class ChildProcess:
    """One launched child (``python -m treeserve.runtime.child``). Owns the process
    and its death pipe; ``kill`` is idempotent and reaps the process."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc

    @classmethod
    def launch(cls, spec: ChildLaunch) -> ChildProcess:
        """Start the child and hand it ``spec`` (never blocks on the child); a child
        :func:`prestart`-ed for the same actor class gets the spec instead, if one is alive."""
        data = spec.to_bytes()
        child = _claim_prestarted(spec.actor) if spec.parent_pid == os.getpid() else None
        if child is not None:
            try:
                child._write(data)
                return child
            except OSError:  # it died during its warm-up: start a fresh one
                child.kill_now()
        child = cls(subprocess.Popen(_child_argv(), stdin=subprocess.PIPE, close_fds=True))
        child._write(data)
        return child

    def _write(self, data: bytes) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        stdin.write(data)
        stdin.flush()

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the process ended (reaps it), else None."""
        return self._proc.poll()

    def send_signal(self, sig: int) -> None:
        """Signal the child unless it already ended."""
        if self._proc.poll() is None:
            self._proc.send_signal(sig)

    def kill_now(self) -> None:
        """SIGKILL without waiting (last resort when a bounded shutdown ran out of
        time); the process is reaped by whoever polls it next, or by init."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        if self._proc.poll() is None:
            self._proc.kill()

    async def kill(self, grace_s: float = 0.0) -> None:
        """End the child: close the death pipe (a clean exit), then SIGKILL after
        ``grace_s`` seconds; returns once the process has been reaped."""
        proc = self._proc
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while proc.poll() is None and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
        while proc.poll() is None:
            await asyncio.sleep(0.005)


_prestarted: list[tuple[str, ChildProcess]] = []
"""Children started by :func:`prestart`, not yet claimed: (actor path, process)."""


def _child_argv(*flags: str) -> list[str]:
    return [sys.executable, "-m", "treeserve.runtime.child", str(os.getpid()), *flags]


def prestart(warmup: Warmup) -> ChildProcess:
    """Start a child for ``warmup.actor`` now, before its launch spec exists: it imports the
    actor's module and runs the warm-up hook, then waits for the spec that the next
    :meth:`ChildProcess.launch` of that actor class writes. Such a child always asks for
    ``PR_SET_PDEATHSIG`` (it cannot know its spec's choice yet)."""
    ChildLaunch(actor=warmup.actor, name="-", node_name="-", bind="-", parent_endpoint="-", parent_pid=0,
                heartbeat_interval_s=1.0)  # validates the actor path
    data = warmup.to_bytes()
    child = ChildProcess(subprocess.Popen(_child_argv("--prestarted"), stdin=subprocess.PIPE, close_fds=True))
    child._write(data)
    _prestarted.append((warmup.actor, child))
    return child


def _claim_prestarted(actor: str) -> ChildProcess | None:
    for i, (path, child) in enumerate(_prestarted):
        if path == actor and child.returncode is None:
            del _prestarted[i]
            return child
    return None


def discard_prestarted() -> int:
    """End every prestarted child nobody claimed (closing its death pipe; it exits by itself)
    and return how many there were."""
    count = 0
    while _prestarted:
        _, child = _prestarted.pop()
        child.kill_now()
        try:
            child._proc.wait(timeout=2.0)  # reap it: nothing else holds it any more
        except subprocess.TimeoutExpired:
            pass
        count += 1
    return count

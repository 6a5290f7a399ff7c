"""Launching and killing child processes that each host one actor on their own node.

The launch spec is a msgpack map written to the child's stdin behind a 4-byte length;
nothing is pickled. stdin then stays open as the *death pipe*: when this process dies,
the kernel closes its end and the child sees EOF and exits. On Linux the child also asks
for ``PR_SET_PDEATHSIG``/``SIGKILL``, which works even when its loop is hung.
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

import msgpack

from treeserve.runtime.curve import LinkCurve
from treeserve.transport.codec import decode, encode
from treeserve.transport.messages import Request

if TYPE_CHECKING:
    from treeserve.runtime.node import Node

__all__ = [
    "ChildLaunch",
    "ChildProcess",
    "decode_args",
    "encode_args",
    "read_launch",
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

    frames = encode(Request(0, "", "__init__", body_to_wire(list(args))))
    if len(frames) != 1:
        raise ValueError("child actor args must not contain tensors")
    return bytes(frames[0])


def decode_args(data: bytes, node: Node) -> list[Any]:
    """Inverse of ``encode_args`` in the child, with refs bound to ``node``."""
    from treeserve.runtime.bodies import body_from_wire

    msg = decode([data])
    if not isinstance(msg, Request) or not isinstance(msg.body, list):
        raise ValueError("malformed child actor args")
    result: list[Any] = body_from_wire(msg.body, node)
    return result


def read_launch(stream: BinaryIO) -> ChildLaunch:
    """Read the spec written by ``ChildProcess.launch`` (child side)."""
    head = stream.read(_LEN.size)
    if len(head) != _LEN.size:
        raise ValueError("parent closed the launch pipe before sending a spec")
    (size,) = _LEN.unpack(head)
    if size > _MAX_SPEC_BYTES:
        raise ValueError(f"launch spec of {size} bytes is too large")
    raw = msgpack.unpackb(stream.read(size), raw=False)
    if not isinstance(raw, dict):
        raise ValueError("launch spec is not a map")
    curve = raw.pop("curve", None)
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
        """Start the child and hand it ``spec`` (never blocks on the child)."""
        data = spec.to_bytes()
        argv = [sys.executable, "-m", "treeserve.runtime.child", str(os.getpid())]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, close_fds=True)
        assert proc.stdin is not None
        proc.stdin.write(data)
        proc.stdin.flush()
        return cls(proc)

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

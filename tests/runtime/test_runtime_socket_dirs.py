"""Temporary socket folders (``/tmp/ts-<pid>-*``) never outlive their runtime: removed on
``aclose``, at interpreter exit without it, and, for a SIGKILLed owner, when the next runtime
creates its own folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from treeserve.runtime import Runtime
from treeserve.runtime.socket_dirs import remove_stale_socket_dirs

pytestmark = pytest.mark.timeout(60)

# Starts a runtime (its node listens in a fresh socket folder), prints that folder, then either
# leaves without aclose once told to on stdin ("exit") or idles until killed ("idle").
PROGRAM = textwrap.dedent("""
    import asyncio, sys, time
    from pathlib import Path
    from treeserve.runtime import Runtime

    async def main() -> None:
        rt = Runtime()
        await rt.start()
        print(Path(rt.endpoint.removeprefix("ipc://")).parent, flush=True)
        if sys.argv[1] == "idle":
            await asyncio.sleep(3600)
        else:
            sys.stdin.readline()  # the parent has seen the folder: leave

    asyncio.run(main())
""")


def start(mode: str) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    folder = Path(proc.stdout.readline().strip())
    assert folder.name.startswith(f"ts-{proc.pid}-") and folder.is_dir(), folder
    return proc, folder


def test_folder_is_removed_when_the_process_exits_without_aclose() -> None:
    proc, folder = start("exit")
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.close()
    assert proc.wait(30) == 0
    assert not folder.exists()


async def test_folder_of_a_killed_process_is_removed_at_the_next_start() -> None:
    proc, folder = start("idle")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert folder.is_dir()  # nothing ran in the killed process
    mine = Path(tempfile.mkdtemp(prefix=f"ts-{os.getpid()}-"))  # a live owner's folder stays
    try:
        async with Runtime() as rt:  # its node listens in a new socket folder
            own = Path(rt.endpoint.removeprefix("ipc://")).parent
            assert own.is_dir() and not folder.exists() and mine.is_dir()
        assert not own.exists()
    finally:
        mine.rmdir()


def test_only_dead_owners_folders_of_this_user_are_removed(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    dead = tmp_path / f"ts-{proc.pid}-abc"
    live = tmp_path / f"ts-{os.getpid()}-abc"
    other = tmp_path / "ts-notapid"
    for folder in (dead, live, other):
        folder.mkdir()
    (dead / "node.sock").write_text("")
    assert remove_stale_socket_dirs(str(tmp_path)) == [dead]
    assert not dead.exists() and live.is_dir() and other.is_dir()

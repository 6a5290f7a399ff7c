"""The temporary folders that hold a runtime's ``ipc://`` sockets, and their cleanup.

A folder is named ``ts-<owner pid>-<random>`` in the system's temporary directory. Its
runtime removes it on ``aclose``, and an ``atexit`` hook removes it when the interpreter
exits without that (a loop torn down early, an unhandled exception at the top). A
SIGKILLed process runs no code, so each new folder's creation first removes the folders
of this user whose owner process is gone.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

__all__ = ["SOCKET_DIR_PREFIX", "SocketDir", "remove_stale_socket_dirs"]

_log = logging.getLogger(__name__)

SOCKET_DIR_PREFIX = "ts-"
_NAME = re.compile(rf"^{SOCKET_DIR_PREFIX}(\d+)-")


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def remove_stale_socket_dirs(root: str | None = None) -> list[Path]:
    """Remove ``ts-<pid>-*`` folders in ``root`` (default: the temporary directory) that
    belong to this user and whose owner pid no longer runs; return the removed paths.
    Folders of live processes, of other users and of other names are left alone."""
    base = Path(root if root is not None else tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        match = _NAME.match(entry.name)
        if match is None:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        if _is_alive(int(match.group(1))):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    if removed:
        _log.info("removed %d socket folder(s) left by killed processes", len(removed))
    return removed


class SocketDir:
    """One runtime's socket folder: created by :meth:`create`, removed by :meth:`remove`
    (idempotent) or, failing that, at interpreter exit."""

    def __init__(self, path: str, owner_pid: int) -> None:
        self.path = path
        self._owner_pid = owner_pid
        self._at_exit = functools.partial(_remove_if_owner, path, owner_pid)
        atexit.register(self._at_exit)

    @classmethod
    def create(cls, root: str | None = None) -> SocketDir:
        """Clean up stale folders in ``root``, then create a fresh folder owned by this process."""
        remove_stale_socket_dirs(root)
        pid = os.getpid()
        return cls(tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{pid}-", dir=root), pid)

    def remove(self) -> None:
        """Delete the folder and its sockets; safe to call twice."""
        atexit.unregister(self._at_exit)
        _remove_if_owner(self.path, self._owner_pid)


def _remove_if_owner(path: str, owner_pid: int) -> None:
    # A forked child inherits atexit hooks: only the creating process removes the folder.
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)

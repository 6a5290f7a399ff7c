"""treeserve: an asyncio actor runtime that serves LLMs with tree-based speculative inference.

The public names load lazily, so ``import treeserve`` stays cheap (the client never imports
torch): ``Client``, ``Chunk``, ``Completion`` and the client errors, ``Server`` and
``ServerConfig`` (embedding), ``SamplingParams``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Client": "treeserve.client",
    "Chunk": "treeserve.client",
    "Completion": "treeserve.client",
    "ClientError": "treeserve.client",
    "ClientClosedError": "treeserve.client",
    "ServerError": "treeserve.client",
    "InvalidRequestError": "treeserve.client",
    "OverloadedError": "treeserve.client",
    "UnavailableError": "treeserve.client",
    "ConnectionLostError": "treeserve.client",
    "ConnectTimeoutError": "treeserve.client",
    "DeadlineExceededError": "treeserve.client",
    "RequestCancelledError": "treeserve.client",
    "Server": "treeserve.server",
    "ServerConfig": "treeserve.server",
    "SamplingParams": "treeserve.ops.sampling",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'treeserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

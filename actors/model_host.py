"""What the actors that host a model share (verifier shard, speculator, length predictor):
checks of the config and body fields they receive, and :class:`SerialOffload`, which runs
their compute in a worker thread one call at a time.

The checks raise ``ValueError`` with a message naming the field, which the runtime turns into
an ``invalid_request`` error reply (or a failed spawn, for a config).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from treeserve.ops.format_names import FORMAT_NAMES

if TYPE_CHECKING:
    from treeserve.ops.model import Transformer

T = TypeVar("T")

DTYPES: tuple[str, ...] = FORMAT_NAMES
"""Accepted ``dtype`` config values: the weight formats (``treeserve.ops.formats``)."""


def check_int(value: Any, name: str, *, minimum: int = 0) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_model_name(value: Any) -> str:
    """``value`` if it is a non-empty string (a registry name, ``.gguf`` path or folder)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"model must be a registry name, .gguf path or folder, got {value!r}")
    return value


def check_device(value: Any) -> str:
    """``value`` if it names a torch device this project serves on: ``cpu`` or ``cuda[:N]``."""
    if not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:[0-9]+)?", value):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {value!r}")
    return value


def load_on_device(model: str, *, weight_format: str, device: str, cache_dir: str | None) -> Transformer:
    """``model`` in ``weight_format`` on ``device``, without a compiled decode step (what a
    speculator drafts with). The format is applied where the model runs: on CUDA the float32
    weights move first and are formatted there (a CPU format's prepacked kernels do not move)."""
    from treeserve.ops.loaders.load import load_model, prepare_for_serving

    if device == "cpu":
        return load_model(model, weight_format=weight_format, compile_decode=False, cache_dir=cache_dir).model
    loaded = load_model(model, cache_dir=cache_dir)
    return prepare_for_serving(loaded.model.to(device), loaded.source, weight_format, cache_dir=cache_dir,
                               compile_decode=False)


def check_str_or_none(value: Any, name: str) -> str | None:
    """``value`` if it is a string or None."""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a string or null, got {value!r}")
    return value


def check_body(body: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    """``body`` if it is a map with every ``required`` field and no field outside ``optional``."""
    if not isinstance(body, Mapping):
        raise ValueError(f"the request body must be a map with fields {list(required)}, got {type(body).__name__}")
    missing = [k for k in required if k not in body]
    unknown = sorted(str(k) for k in body if k not in required and k not in optional)
    if missing or unknown:
        raise ValueError(f"request body: missing fields {missing}, unknown fields {unknown}")
    return body


class SerialOffload:
    """Runs blocking compute in a worker thread, one call at a time, cancellation-safe.

    A cancelled caller stops waiting, but its compute runs to completion (shielded) and the
    next call waits for it, so state mutated by the compute (a KV cache) is never touched by
    two calls at once nor left half-updated.
    """

    def __init__(self) -> None:
        self._last: asyncio.Future[Any] | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in a thread after every earlier call finished; return its result."""
        previous = self._last
        if previous is not None and not previous.done():
            await asyncio.wait([previous])
        future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        future.add_done_callback(consume_exception)
        self._last = future
        return await asyncio.shield(future)

    async def drain(self) -> None:
        """Wait until the last started compute has finished (its result is not needed)."""
        if self._last is not None and not self._last.done():
            await asyncio.wait([self._last])


def consume_exception(future: asyncio.Future[Any]) -> None:
    """A done callback that marks ``future``'s exception retrieved (its caller may be gone)."""
    if not future.cancelled():
        future.exception()


__all__ = [
    "DTYPES",
    "SerialOffload",
    "check_body",
    "check_device",
    "check_int",
    "check_model_name",
    "check_str_or_none",
    "consume_exception",
    "load_on_device",
]

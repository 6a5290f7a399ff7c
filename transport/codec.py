"""Message <-> zmq frames codec.

Frame 0 is a msgpack map with named keys (``{"v": 1, "kind": ..., ...fields}``); every
tensor inside a ``body`` becomes a msgpack ext ``EXT_TENSOR`` referring to one raw-bytes
frame (index >= 1), and every ``ActorAddress`` an ext ``EXT_ACTOR_REF``. ``decode``
checks every size, length, depth, type and tensor geometry before returning a message,
and never unpickles anything. The field rules live in ``treeserve.transport.schema``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgpack
import zmq

from treeserve.transport.errors import DecodeError, EncodeError, TransportError
from treeserve.transport.messages import ActorAddress, Message, kind_of
from treeserve.transport.schema import build_message, header_fields
from treeserve.transport.tensors import is_tensor, tensor_from_frame, tensor_to_frame
from treeserve.transport.wire import (
    DEFAULT_LIMITS,
    EXT_ACTOR_REF,
    EXT_TENSOR,
    PROTOCOL_VERSION,
    ErrorCode,
    Kind,
    WireLimits,
)
from treeserve.transport.wire_types import wire_repr, wire_type

__all__ = ["DecodeError", "EncodeError", "TransportError", "decode", "encode"]

# An ext payload (tensor or actor ref) is a tiny map; anything bigger is hostile.
_MAX_EXT_PAYLOAD_BYTES = 4096
_MAX_TENSOR_DIMS = 32

FrameLike = bytes | memoryview | zmq.Frame


# --------------------------------------------------------------------------- encode


def encode(msg: Message, limits: WireLimits = DEFAULT_LIMITS) -> list[bytes | memoryview]:
    """Encode ``msg`` into zmq frames: frame 0 is the msgpack header map, then one raw
    frame per tensor found in the body, in serialization order. Tensors of at least
    ``limits.zero_copy_threshold`` bytes are returned as memoryviews of the tensor's own
    (contiguous) buffer, so the caller must not mutate them until zmq has sent them.
    Raises ``EncodeError`` for values that cannot be sent (unsupported types, non-str
    map keys, non-CPU tensors) or a message a peer with the same ``limits`` would reject."""
    header = header_fields(msg)  # raises EncodeError on mistyped fields
    kind = kind_of(msg)
    full: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": kind.value, **header}
    _check_encode_shape(full, limits)
    frames: list[bytes | memoryview] = [b""]
    sink = _EncodeSink(frames, limits)
    try:
        packed = msgpack.packb(full, default=sink.default, use_bin_type=True, datetime=False)
    except EncodeError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise EncodeError(f"cannot encode {kind.value} message: {exc}") from exc
    frames[0] = packed
    _check_encode_sizes(frames, limits)
    return frames


class _EncodeSink:
    """msgpack ``default`` hook that turns tensors / addresses into ext references."""

    def __init__(self, frames: list[bytes | memoryview], limits: WireLimits) -> None:
        self._frames = frames
        self._limits = limits

    def default(self, obj: object) -> Any:
        if isinstance(obj, ActorAddress):
            payload = msgpack.packb({"endpoint": obj.endpoint, "name": obj.name})
            return msgpack.ExtType(EXT_ACTOR_REF, payload)
        if is_tensor(obj):
            dtype, shape, frame = tensor_to_frame(obj, self._limits.zero_copy_threshold)
            index = len(self._frames)
            self._frames.append(frame)
            payload = msgpack.packb({"dtype": dtype, "shape": shape, "frame": index})
            return msgpack.ExtType(EXT_TENSOR, payload)
        scalar = _numpy_scalar(obj)
        if scalar is not None:
            return scalar
        raise EncodeError(
            f"cannot put a {type(obj).__module__}.{type(obj).__qualname__} on the wire "
            "(allowed: None, bool, int, float, str, bytes, list, tuple, dict with str keys, "
            "numpy arrays, torch CPU tensors, ActorAddress)"
        )


def _numpy_scalar(obj: object) -> Any:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a hard dependency
        return None
    if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
        return obj.item()
    return None


def _check_encode_shape(header: dict[str, Any], limits: WireLimits) -> None:
    """Depth, length and map-key checks a peer would apply, done before packing. It runs for
    every message sent, so the common values (exact ``str``, ``int``, ``float``, short strings)
    take a fast path; subclasses get the same checks through ``isinstance``."""
    max_depth, max_items = limits.max_depth, limits.max_container_len
    short = limits.max_str_len // 4  # a str's wire length is at most 4 bytes per character
    stack: list[tuple[Any, int]] = [(header, 1)]
    while stack:
        obj, depth = stack.pop()
        if depth > max_depth:
            raise EncodeError(f"message nesting depth exceeds max_depth={limits.max_depth}")
        if len(obj) > max_items:
            raise EncodeError(
                f"a {type(obj).__name__} has {len(obj)} items > "
                f"max_container_len={limits.max_container_len}"
            )
        if isinstance(obj, dict):
            for key in obj:
                if type(key) is not str and not isinstance(key, str | bytes):
                    raise EncodeError(f"map keys must be str or bytes, got {type(key).__name__}")
                if len(key) > short:
                    _check_str_len(key, limits)
            values: Any = obj.values()
        else:
            values = obj
        for value in values:
            kind = type(value)
            if kind is int or kind is float or kind is bool or value is None:
                continue
            if kind is str or kind is bytes or isinstance(value, str | bytes):
                if len(value) > short:
                    _check_str_len(value, limits)
            elif isinstance(value, dict | list | tuple):
                stack.append((value, depth + 1))


def _check_str_len(value: str | bytes, limits: WireLimits) -> None:
    # Called for values longer than max_str_len // 4 (shorter ones fit at 4 bytes a character):
    # a str's wire length is its UTF-8 size.
    size = len(value.encode()) if isinstance(value, str) else len(value)
    if size > limits.max_str_len:
        raise EncodeError(f"a str/bin of {size} bytes exceeds max_str_len={limits.max_str_len}")


def _check_encode_sizes(frames: list[bytes | memoryview], limits: WireLimits) -> None:
    if len(frames) > limits.max_frames:
        raise EncodeError(f"message needs {len(frames)} frames > max_frames={limits.max_frames}")
    if len(frames[0]) > limits.max_header_bytes:
        raise EncodeError(
            f"header is {len(frames[0])} bytes > max_header_bytes={limits.max_header_bytes}"
        )
    total = sum(_nbytes(f) for f in frames)
    if total > limits.max_message_bytes:
        raise EncodeError(
            f"message is {total} bytes > max_message_bytes={limits.max_message_bytes}"
        )


# --------------------------------------------------------------------------- decode


class _RawExt:
    """An ext value seen while unpacking; resolved only after the header validated."""

    __slots__ = ("code", "data")

    def __init__(self, code: int, data: bytes) -> None:
        self.code = code
        self.data = data


def _ext_hook(code: int, data: bytes) -> _RawExt:
    return _RawExt(code, data)


def decode(
    frames: Sequence[FrameLike],
    limits: WireLimits = DEFAULT_LIMITS,
    *,
    tensor_type: Literal["numpy", "torch"] = "numpy",
) -> Message:
    """Validate ``frames`` (as received from a DEALER, i.e. without the ROUTER identity
    envelope) and decode them into a message. Checks, in order: frame count, total and
    header size, msgpack structure with declared-length limits, nesting depth, version,
    kind, required fields and their types, then every tensor reference (known dtype,
    non-negative shape, frame index in range and used once, byte length matches) and
    that no frame is left unused. Raises ``DecodeError`` with ``msg_id`` set whenever
    the header's ``id`` was readable. Tensors come back as read-only numpy arrays
    sharing the frame memory, or torch tensors (``tensor_type="torch"``); with numpy,
    bfloat16 decodes to an exactly equal float32 array."""
    if tensor_type not in ("numpy", "torch"):
        raise ValueError(f"tensor_type must be 'numpy' or 'torch', got {tensor_type!r}")
    views = [_as_view(f) for f in frames]
    if not views:
        raise DecodeError(ErrorCode.BAD_MESSAGE, "message has no frames")
    if len(views) > limits.max_frames:
        raise DecodeError(
            ErrorCode.TOO_LARGE, f"{len(views)} frames > max_frames={limits.max_frames}"
        )
    total = sum(v.nbytes for v in views)
    if total > limits.max_message_bytes:
        raise DecodeError(
            ErrorCode.TOO_LARGE,
            f"message is {total} bytes > max_message_bytes={limits.max_message_bytes}",
        )
    head = views[0]
    if head.nbytes > limits.max_header_bytes:
        raise DecodeError(
            ErrorCode.TOO_LARGE,
            f"header is {head.nbytes} bytes > max_header_bytes={limits.max_header_bytes}",
        )
    header = _unpack_header(head, limits)
    msg_id = _readable_id(header)
    kind = header.get("kind")
    try:
        _check_version_and_kind(header, msg_id)
        sink = _DecodeSink(views, limits, tensor_type, msg_id)
        _resolve(header, limits, sink, msg_id)
        sink.check_all_used()
        return build_message(header, msg_id)
    except DecodeError as exc:  # say which kind of message it was, when that was readable
        raise DecodeError(exc.code, exc.message, exc.msg_id, kind if isinstance(kind, str) else None) from None


def _as_view(frame: FrameLike) -> memoryview:
    if isinstance(frame, zmq.Frame):
        view = frame.buffer
    else:
        view = memoryview(frame)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _nbytes(frame: bytes | memoryview) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def _unpack_header(head: memoryview, limits: WireLimits) -> dict[str, Any]:
    size = head.nbytes
    # Each declared element needs at least one byte (two for a map entry), so a length
    # above the buffer size is a lie; cap by it so msgpack never preallocates a bomb.
    try:
        header = msgpack.unpackb(
            head,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_ext_hook,
            max_str_len=min(limits.max_str_len, size),
            max_bin_len=min(limits.max_str_len, size),
            max_ext_len=min(_MAX_EXT_PAYLOAD_BYTES, size),
            max_array_len=min(limits.max_container_len, size),
            max_map_len=min(limits.max_container_len, size // 2),
        )
    except msgpack.exceptions.StackError as exc:
        raise DecodeError(ErrorCode.BAD_MESSAGE, "header nesting too deep") from exc
    except (ValueError, TypeError, RecursionError, MemoryError) as exc:
        code, text = _msgpack_problem(exc)
        raise DecodeError(code, f"malformed msgpack header: {text}") from exc
    if not isinstance(header, dict):
        raise DecodeError(ErrorCode.BAD_MESSAGE, f"header must be a msgpack map, got {wire_type(header)}")
    return header


def _msgpack_problem(exc: Exception) -> tuple[ErrorCode, str]:
    """The code and a language-neutral text for msgpack's own exception ``exc`` (its texts
    speak of Python: ``unpack(b)``, ``strict_map_key``, codec names)."""
    text = str(exc)
    if "exceeds max_" in text:  # a declared length above a limit: "5000 exceeds max_str_len(4096)"
        return ErrorCode.TOO_LARGE, text
    if isinstance(exc, msgpack.exceptions.ExtraData):
        return ErrorCode.BAD_MESSAGE, "bytes follow the map in frame 0"
    if isinstance(exc, msgpack.exceptions.FormatError):
        return ErrorCode.BAD_MESSAGE, "not msgpack (a reserved byte, 0xc1)"
    if isinstance(exc, UnicodeDecodeError):
        return ErrorCode.BAD_MESSAGE, "a str is not valid UTF-8"
    if "strict_map_key" in text:
        return ErrorCode.BAD_MESSAGE, "a map key is not a str or bin"
    if "incomplete input" in text:
        return ErrorCode.BAD_MESSAGE, "truncated (a declared length runs past the frame)"
    return ErrorCode.BAD_MESSAGE, "not a valid msgpack value"


def _readable_id(header: dict[str, Any]) -> int | None:
    value = header.get("id")
    if type(value) is int and 0 <= value < 2**64:
        return value
    return None


_KIND_VALUES = frozenset(kind.value for kind in Kind)


def _check_version_and_kind(header: dict[str, Any], msg_id: int | None) -> None:
    if "v" not in header:
        raise DecodeError(ErrorCode.BAD_MESSAGE, "header has no 'v' (version)", msg_id)
    version = header["v"]
    if type(version) is not int:
        raise DecodeError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"header 'v' (protocol version) must be an int, got {wire_type(version)} (this peer speaks "
            f"{PROTOCOL_VERSION})",
            msg_id,
        )
    if version != PROTOCOL_VERSION:
        raise DecodeError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version} is not supported (this peer speaks {PROTOCOL_VERSION})",
            msg_id,
        )
    if "kind" not in header:
        raise DecodeError(ErrorCode.BAD_MESSAGE, "header has no 'kind'", msg_id)
    kind = header["kind"]
    if not isinstance(kind, str):
        raise DecodeError(ErrorCode.BAD_MESSAGE, f"header 'kind' must be a str, got {wire_type(kind)}", msg_id)
    if kind not in _KIND_VALUES:
        raise DecodeError(ErrorCode.UNKNOWN_KIND, f"unknown message kind {wire_repr(kind)}", msg_id)


class _DecodeSink:
    """Turns ext references into tensors / addresses, tracking which frames were used."""

    def __init__(
        self,
        views: list[memoryview],
        limits: WireLimits,
        tensor_type: Literal["numpy", "torch"],
        msg_id: int | None,
    ) -> None:
        self._views = views
        self._limits = limits
        self._tensor_type = tensor_type
        self._msg_id = msg_id
        self._used = [False] * len(views)
        self._used[0] = True

    def resolve(self, ext: _RawExt) -> Any:
        if ext.code == EXT_TENSOR:
            return self._tensor(ext.data)
        if ext.code == EXT_ACTOR_REF:
            return self._actor_ref(ext.data)
        raise DecodeError(
            ErrorCode.BAD_MESSAGE, f"unknown msgpack ext type {ext.code}", self._msg_id
        )

    def _payload(self, data: bytes, what: str, code: ErrorCode) -> dict[str, Any]:
        try:
            payload = msgpack.unpackb(
                data,
                raw=False,
                strict_map_key=True,
                max_str_len=len(data),
                max_bin_len=0,
                max_ext_len=0,
                max_array_len=min(len(data), _MAX_TENSOR_DIMS),
                max_map_len=8,
            )
        except (ValueError, TypeError) as exc:
            _, text = _msgpack_problem(exc)
            raise DecodeError(code, f"malformed {what} ext payload: {text}", self._msg_id) from exc
        if not isinstance(payload, dict):
            raise DecodeError(code, f"{what} ext payload must be a map, got {wire_type(payload)}", self._msg_id)
        return payload

    def _tensor(self, data: bytes) -> Any:
        payload = self._payload(data, "tensor", ErrorCode.BAD_TENSOR)
        dtype, shape, index = payload.get("dtype"), payload.get("shape"), payload.get("frame")
        if not isinstance(dtype, str):
            raise self._bad(f"tensor 'dtype' must be a str, got {wire_type(dtype)}")
        if not isinstance(shape, list) or not all(
            type(d) is int and d >= 0 for d in shape
        ):
            raise self._bad(f"tensor 'shape' must be an array of non-negative ints, got {wire_repr(shape)}")
        if type(index) is not int:
            raise self._bad(f"tensor 'frame' must be an int, got {wire_type(index)}")
        if not 1 <= index < len(self._views):
            raise self._bad(f"tensor 'frame' {index} is not in [1, {len(self._views)})")
        if self._used[index]:
            raise self._bad(f"tensor frame {index} is referenced twice")
        self._used[index] = True
        return tensor_from_frame(
            dtype,
            shape,
            self._views[index],
            tensor_type=self._tensor_type,
            copy_below=self._limits.zero_copy_threshold,
            on_error=self._bad,
        )

    def _actor_ref(self, data: bytes) -> ActorAddress:
        payload = self._payload(data, "actor ref", ErrorCode.BAD_MESSAGE)
        endpoint, name = payload.get("endpoint"), payload.get("name")
        if not isinstance(endpoint, str) or not isinstance(name, str):
            raise DecodeError(
                ErrorCode.BAD_MESSAGE,
                f"actor ref needs str 'endpoint' and str 'name', got {wire_type(endpoint)} and {wire_type(name)}",
                self._msg_id,
            )
        return ActorAddress(endpoint=endpoint, name=name)

    def _bad(self, text: str) -> DecodeError:
        return DecodeError(ErrorCode.BAD_TENSOR, text, self._msg_id)

    def check_all_used(self) -> None:
        unused = [i for i, used in enumerate(self._used) if not used]
        if unused:
            raise DecodeError(
                ErrorCode.BAD_MESSAGE,
                f"frames {unused} are not referenced by any tensor",
                self._msg_id,
            )


def _resolve(
    header: dict[str, Any], limits: WireLimits, sink: _DecodeSink, msg_id: int | None
) -> None:
    """Check nesting depth and replace ext markers in place (containers are fresh). msgpack
    builds exact ``dict``, ``list`` and :class:`_RawExt` objects, so their types are compared
    directly: this runs for every message received."""
    max_depth = limits.max_depth
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(header, 1)]
    while stack:
        container, depth = stack.pop()
        if depth > max_depth:
            raise DecodeError(
                ErrorCode.BAD_MESSAGE,
                f"header nesting depth exceeds max_depth={limits.max_depth}",
                msg_id,
            )
        entries: Any = container.items() if type(container) is dict else enumerate(container)
        for key, value in entries:
            kind = type(value)
            if kind is _RawExt:
                container[key] = sink.resolve(value)
            elif kind is dict or kind is list:
                stack.append((value, depth + 1))

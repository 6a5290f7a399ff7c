"""Header field rules per message kind, shared by encode and decode.

Each kind has a fixed set of named fields; a field is required (key must be present)
or optional (absent, or nil, means its default). Unknown keys are ignored so that a minor
revision within the same major version can add optional fields.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from treeserve.transport.errors import DecodeError, EncodeError
from treeserve.transport.messages import (
    Cancel,
    Error,
    Heartbeat,
    Message,
    Reply,
    Request,
    StreamEnd,
    StreamItem,
    kind_of,
)
from treeserve.transport.wire import ErrorCode, Kind
from treeserve.transport.wire_types import wire_type

__all__ = ["FIELDS", "FieldSpec", "build_message", "header_fields"]

_U64 = 2**64


def _is_u64(value: object) -> bool:
    return type(value) is int and 0 <= value < _U64


def _is_u64_or_none(value: object) -> bool:
    return value is None or _is_u64(value)


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _is_bool(value: object) -> bool:
    return type(value) is bool


def _is_any(value: object) -> bool:
    return True


def _is_map_or_none(value: object) -> bool:
    return value is None or isinstance(value, dict)


def _is_time(value: object) -> bool:
    return (type(value) is float and math.isfinite(value)) or type(value) is int


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One header field: its key, what the wire type must satisfy (``kind`` is the
    human-readable type), and whether the key is required or defaults when absent."""

    name: str
    check: Callable[[object], bool]
    type_name: str
    is_required: bool
    default: Any = None


def _req(name: str, check: Callable[[object], bool], type_name: str) -> FieldSpec:
    return FieldSpec(name, check, type_name, True)


def _opt(name: str, check: Callable[[object], bool], type_name: str, default: Any) -> FieldSpec:
    return FieldSpec(name, check, type_name, False, default)


_ID = _req("id", _is_u64, "uint64")
_BODY = _opt("body", _is_any, "any", None)

FIELDS: dict[Kind, tuple[FieldSpec, ...]] = {
    Kind.REQUEST: (
        _ID,
        _req("target", _is_str, "str"),
        _req("method", _is_str, "str"),
        _BODY,
        _opt("timeout_ms", _is_u64_or_none, "uint64 | nil", None),
        _opt("stream", _is_bool, "bool", False),
    ),
    Kind.REPLY: (_ID, _BODY),
    Kind.STREAM_ITEM: (_ID, _req("seq", _is_u64, "uint64"), _BODY),
    Kind.STREAM_END: (_ID, _req("seq", _is_u64, "uint64"), _BODY),
    Kind.ERROR: (
        _req("id", _is_u64_or_none, "uint64 | nil"),
        _req("code", _is_str, "str"),
        _req("message", _is_str, "str"),
        _opt("retryable", _is_bool, "bool", False),
        _opt("details", _is_map_or_none, "map | nil", None),
    ),
    Kind.CANCEL: (_ID,),
    Kind.HEARTBEAT: (
        _req("seq", _is_u64, "uint64"),
        _req("sent_at", _is_time, "float64"),
        _opt("node", _is_str, "str", ""),
    ),
}
"""Header fields of every kind, in wire order (after ``v`` and ``kind``)."""


def header_fields(msg: Message) -> dict[str, Any]:
    """Return the header fields of ``msg`` (without ``v``/``kind``), every field written
    explicitly; raises ``EncodeError`` when a field has the wrong type."""
    kind = kind_of(msg)
    fields: dict[str, Any] = {}
    for spec in FIELDS[kind]:
        value = getattr(msg, spec.name)
        if kind is Kind.ERROR and spec.name == "code":
            if not isinstance(value, ErrorCode):
                raise EncodeError(f"Error.code must be an ErrorCode, got {value!r}")
            value = value.value
        if not spec.check(value):
            raise EncodeError(
                f"{type(msg).__name__}.{spec.name} must be {spec.type_name}, got {value!r}"
            )
        fields[spec.name] = value
    return fields


_KIND_BY_VALUE = {kind.value: kind for kind in Kind}


def build_message(header: dict[str, Any], msg_id: int | None) -> Message:
    """Build the typed message from a decoded header whose version and kind were already
    checked; raises ``DecodeError(BAD_MESSAGE)`` for a missing or mistyped field (its text
    names wire types). An optional field that is absent or nil takes its default. An
    unknown error code (from a newer peer) decodes as ``INTERNAL`` with the original
    string kept in ``details["unknown_code"]``."""
    kind = _KIND_BY_VALUE[header["kind"]]
    values: dict[str, Any] = {}
    for spec in FIELDS[kind]:
        if spec.name not in header:
            if spec.is_required:
                raise DecodeError(
                    ErrorCode.BAD_MESSAGE, f"{kind.value} header lacks '{spec.name}'", msg_id
                )
            values[spec.name] = spec.default
            continue
        value = header[spec.name]
        if value is None and not spec.is_required:
            values[spec.name] = spec.default
            continue
        if not spec.check(value):
            raise DecodeError(
                ErrorCode.BAD_MESSAGE,
                f"{kind.value} field '{spec.name}' must be {spec.type_name.replace(' | ', ' or ')}, "
                f"got {wire_type(value)}",
                msg_id,
            )
        values[spec.name] = value
    if kind is Kind.REQUEST:
        return Request(**values)
    if kind is Kind.REPLY:
        return Reply(**values)
    if kind is Kind.STREAM_ITEM:
        return StreamItem(**values)
    if kind is Kind.STREAM_END:
        return StreamEnd(**values)
    if kind is Kind.CANCEL:
        return Cancel(**values)
    if kind is Kind.HEARTBEAT:
        values["sent_at"] = float(values["sent_at"])
        return Heartbeat(**values)
    return _build_error(values)


def _build_error(values: dict[str, Any]) -> Error:
    raw_code: str = values["code"]
    try:
        code = ErrorCode(raw_code)
    except ValueError:
        code = ErrorCode.INTERNAL
        values["details"] = {**(values["details"] or {}), "unknown_code": raw_code}
    values["code"] = code
    return Error(**values)

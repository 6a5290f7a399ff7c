"""Error texts name wire types (``transport/PROTOCOL.md`` 2: str, int, float, bool, nil, map, array,
bin, ext), never Python's; nil for an optional header field is its default; a decode error says
which kind of message it was about, so a receiver can leave answers unanswered (section 6)."""

from __future__ import annotations

import re
from typing import Any

import msgpack
import numpy as np
import pytest

from treeserve.transport.codec import DecodeError, decode
from treeserve.transport.messages import ActorAddress, Error, Heartbeat, Reply, Request
from treeserve.transport.wire import ErrorCode
from treeserve.transport.wire_types import wire_repr, wire_type

PYTHON_NAMES = re.compile(r"NoneType|\bTrue\b|\bFalse\b|\bNone\b|b'|b\"|\bdict\b|\blist\b|\bbytes\b|\btuple\b")


@pytest.mark.parametrize(("value", "name", "shown"), [
    (None, "nil", "nil"),
    (True, "bool", "true"),
    (False, "bool", "false"),
    (3, "int", "3"),
    (1.5, "float", "1.5"),
    (float("inf"), "float", "inf"),
    ("hi", "str", "'hi'"),
    (b"\x00\x01", "bin", "bin (2 bytes)"),
    ([1, 2], "array", "array (2 items)"),
    ((1,), "array", "array (1 item)"),
    ({"a": 1}, "map", "map (1 entry)"),
    (np.zeros(3, np.float32), "tensor", "tensor"),
    (ActorAddress("tcp://x:1", "a"), "actor address", "actor address"),
])
def test_wire_names(value: Any, name: str, shown: str) -> None:
    assert wire_type(value) == name
    assert wire_repr(value) == shown


def test_long_strings_are_cut() -> None:
    shown = wire_repr("x" * 500)
    assert len(shown) < 80 and shown.endswith("...") and shown.startswith("'xxx")


def _decode_error(header: dict[str, Any]) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        decode([msgpack.packb(header, use_bin_type=True)])
    return info.value


@pytest.mark.parametrize("header", [
    {"v": True, "kind": "request"},
    {"v": None, "kind": "request"},
    {"v": 1, "kind": None},
    {"v": 1, "kind": "request", "id": None, "target": "t", "method": "m"},
    {"v": 1, "kind": "request", "id": 1, "target": b"t", "method": "m"},
    {"v": 1, "kind": "request", "id": 1, "target": "t", "method": "m", "stream": "yes"},
    {"v": 1, "kind": "heartbeat", "seq": 0, "sent_at": True},
    {"v": 1, "kind": "error", "id": 1, "code": "internal", "message": "m", "details": [1]},
    {"v": 1, "kind": "reply", "id": 1, "body": msgpack.ExtType(1, msgpack.packb({"dtype": None}))},
    {"v": 1, "kind": "reply", "id": 1, "body": msgpack.ExtType(2, msgpack.packb({"endpoint": 1, "name": None}))},
])
def test_decode_errors_name_wire_types(header: dict[str, Any]) -> None:
    err = _decode_error(header)
    assert not PYTHON_NAMES.search(err.message), err.message
    assert re.search(r"\b(nil|bool|str|bin|int|array|map)\b", err.message), err.message


def test_decode_errors_carry_the_kind_when_readable() -> None:
    assert _decode_error({"v": 1, "kind": "reply", "id": "x"}).kind == "reply"
    assert _decode_error({"v": 2, "kind": "error", "id": 3}).kind == "error"
    assert _decode_error({"v": 1, "kind": 7}).kind is None
    assert _decode_error({"v": 1, "kind": "nope", "id": 1}).kind == "nope"
    with pytest.raises(DecodeError) as info:
        decode([b"\xc1"])
    assert info.value.kind is None


def test_nil_optional_header_fields_decode_as_their_defaults() -> None:
    def dec(header: dict[str, Any]) -> Any:
        return decode([msgpack.packb({"v": 1, **header})])

    assert dec({"kind": "request", "id": 1, "target": "t", "method": "m", "body": None, "timeout_ms": None,
                "stream": None}) == Request(1, "t", "m", None, None, False)
    assert dec({"kind": "heartbeat", "seq": 0, "sent_at": 1.0, "node": None}) == Heartbeat(0, 1.0, "")
    assert dec({"kind": "error", "id": None, "code": "internal", "message": "m", "retryable": None,
                "details": None}) == Error(None, ErrorCode.INTERNAL, "m", False, None)
    assert dec({"kind": "reply", "id": 2, "body": None}) == Reply(2, None)
    with pytest.raises(DecodeError, match="'target' must be str, got nil"):
        dec({"kind": "request", "id": 1, "target": None, "method": "m"})

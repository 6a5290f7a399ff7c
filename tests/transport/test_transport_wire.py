"""Wire constants and WireLimits validation."""

from __future__ import annotations

import pytest

from treeserve.transport import RETRYABLE_CODES, ErrorCode, Kind, WireLimits


def test_enum_values_are_the_wire_strings() -> None:
    assert Kind.STREAM_ITEM == "stream_item"
    assert {k.value for k in Kind} == {
        "request", "reply", "stream_item", "stream_end", "error", "cancel", "heartbeat"
    }
    assert all(code.value == code.name.lower() for code in ErrorCode)
    assert RETRYABLE_CODES <= set(ErrorCode)
    assert ErrorCode.OVERLOADED in RETRYABLE_CODES
    assert ErrorCode.BAD_MESSAGE not in RETRYABLE_CODES


def test_default_limits() -> None:
    limits = WireLimits()
    assert limits.max_message_bytes == 256 * 1024 * 1024
    assert limits.zero_copy_threshold == 64 * 1024


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_message_bytes": 0},
        {"max_frames": 0},
        {"max_depth": -1},
        {"max_str_len": 1.5},
        {"max_container_len": True},
        {"sndhwm": -1},
        {"linger_ms": -5},
        {"max_header_bytes": 10, "max_message_bytes": 5},
    ],
)
def test_invalid_limits_raise_value_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="WireLimits"):
        WireLimits(**kwargs)  # type: ignore[arg-type]

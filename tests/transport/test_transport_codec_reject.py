"""Hostile and malformed input: decode must raise DecodeError with the right code."""

from __future__ import annotations

import random
import tracemalloc
from typing import Any

import msgpack
import numpy as np
import pytest

from treeserve.transport import (
    EXT_ACTOR_REF,
    EXT_TENSOR,
    DecodeError,
    ErrorCode,
    Reply,
    Request,
    StreamItem,
    WireLimits,
    decode,
    encode,
)
from treeserve.transport.messages import Message


def _pack(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _tensor_ext(dtype: Any, shape: Any, frame: Any) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_TENSOR, msgpack.packb({"dtype": dtype, "shape": shape, "frame": frame}))


def _reject(frames: list[bytes], code: ErrorCode, msg_id: int | None, **kw: Any) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        decode(frames, **kw)
    assert info.value.code is code, info.value
    assert info.value.msg_id == msg_id, info.value
    return info.value


REPLY = {"v": 1, "kind": "reply", "id": 77}


def test_random_bytes_never_escape_as_other_exceptions() -> None:
    rng = random.Random(1234)
    for _ in range(3000):
        frame = rng.randbytes(rng.randrange(0, 80))
        with pytest.raises(DecodeError):
            decode([frame])


def test_mutated_valid_messages_decode_or_raise_decode_error() -> None:
    rng = random.Random(99)
    seeds = [
        encode(Request(5, "t", "m", {"x": np.arange(6, dtype=np.int32), "y": [1, "a"]}, 10)),
        encode(Reply(6, {"a": np.ones((2, 2), dtype=np.float16)})),
        encode(StreamItem(7, 3, [True, None, 1.5])),
    ]
    outcomes = {"ok": 0, "rejected": 0}
    for _ in range(3000):
        frames = [bytearray(bytes(f)) for f in rng.choice(seeds)]
        target = rng.randrange(len(frames))
        if frames[target] and rng.random() < 0.8:
            for _ in range(rng.randint(1, 3)):
                frames[target][rng.randrange(len(frames[target]))] = rng.randrange(256)
        else:
            del frames[target][rng.randrange(len(frames[target]) + 1):]
        try:
            result = decode([bytes(f) for f in frames])
        except DecodeError:
            outcomes["rejected"] += 1
        else:
            assert isinstance(result, Message.__args__)  # type: ignore[attr-defined]
            outcomes["ok"] += 1
    assert outcomes["rejected"] > 100 and outcomes["ok"] > 100, outcomes


def test_no_frames() -> None:
    _reject([], ErrorCode.BAD_MESSAGE, None)


def test_truncated_header() -> None:
    frame = bytes(encode(Request(9, "target", "method", {"k": "v"}))[0])
    _reject([frame[:-3]], ErrorCode.BAD_MESSAGE, None)


def test_trailing_garbage_after_header() -> None:
    _reject([_pack(REPLY) + b"\x00"], ErrorCode.BAD_MESSAGE, None)


def test_header_not_a_map() -> None:
    _reject([msgpack.packb([1, "reply", 3])], ErrorCode.BAD_MESSAGE, None)


def test_invalid_utf8_string() -> None:
    _reject([b"\x81\xa1v\xa2\xff\xfe"], ErrorCode.BAD_MESSAGE, None)


def test_truncated_tensor_frame() -> None:
    frames = [bytes(f) for f in encode(Reply(11, np.arange(10, dtype=np.float32)))]
    _reject([frames[0], frames[1][:-1]], ErrorCode.BAD_TENSOR, 11)


def test_mismatched_tensor_shape() -> None:
    header = _pack({**REPLY, "body": _tensor_ext("float32", [3, 3], 1)})
    _reject([header, bytes(32)], ErrorCode.BAD_TENSOR, 77)


@pytest.mark.parametrize(
    ("ext", "why"),
    [
        (_tensor_ext("float32", [2], 2), "index past last frame"),
        (_tensor_ext("float32", [2], 0), "index of the header"),
        (_tensor_ext("float32", [2], -1), "negative index"),
        (_tensor_ext("float32", [2], "1"), "index not an int"),
        (_tensor_ext("float128", [1], 1), "unknown dtype"),
        (_tensor_ext("object", [1], 1), "object dtype"),
        (_tensor_ext("float32", [-2], 1), "negative dim"),
        (_tensor_ext("float32", [2.0], 1), "float dim"),
        (_tensor_ext("float32", 2, 1), "shape not an array"),
        (_tensor_ext(None, [2], 1), "dtype missing"),
        (msgpack.ExtType(EXT_TENSOR, b"\xc1"), "payload not msgpack"),
        (msgpack.ExtType(EXT_TENSOR, msgpack.packb([1, 2])), "payload not a map"),
    ],
)
def test_bad_tensor_header(ext: msgpack.ExtType, why: str) -> None:
    _reject([_pack({**REPLY, "body": ext}), bytes(8)], ErrorCode.BAD_TENSOR, 77)


def test_tensor_frame_referenced_twice() -> None:
    ext = _tensor_ext("float32", [2], 1)
    _reject([_pack({**REPLY, "body": [ext, ext]}), bytes(8)], ErrorCode.BAD_TENSOR, 77)


def test_unused_extra_frame() -> None:
    frames = [bytes(f) for f in encode(Reply(12, np.zeros(2)))]
    _reject(frames + [b"extra"], ErrorCode.BAD_MESSAGE, 12)
    _reject([bytes(encode(Reply(13, "no tensors"))[0]), b"x"], ErrorCode.BAD_MESSAGE, 13)


def test_bool_tensor_with_non_boolean_bytes() -> None:
    header = _pack({**REPLY, "body": _tensor_ext("bool", [3], 1)})
    _reject([header, b"\x00\x01\x02"], ErrorCode.BAD_TENSOR, 77)
    assert decode([header, b"\x00\x01\x01"]).body.tolist() == [False, True, True]  # type: ignore[union-attr]


def test_unknown_ext_type_and_bad_actor_ref() -> None:
    _reject([_pack({**REPLY, "body": msgpack.ExtType(9, b"")})], ErrorCode.BAD_MESSAGE, 77)
    ref = msgpack.ExtType(EXT_ACTOR_REF, msgpack.packb({"endpoint": "tcp://x:1"}))
    _reject([_pack({**REPLY, "body": ref})], ErrorCode.BAD_MESSAGE, 77)


def test_ext_as_map_key() -> None:
    frame = b"\x84\xa1v\x01\xa4kind\xa5reply\xa2id\x05\xa4body\x81" + b"\xd4\x02\x00" + b"\x01"
    _reject([frame], ErrorCode.BAD_MESSAGE, None)


def test_wrong_version() -> None:
    _reject([_pack({**REPLY, "v": 2})], ErrorCode.UNSUPPORTED_VERSION, 77)
    _reject([_pack({**REPLY, "v": "1"})], ErrorCode.UNSUPPORTED_VERSION, 77)
    header = dict(REPLY)
    del header["v"]
    _reject([_pack(header)], ErrorCode.BAD_MESSAGE, 77)


def test_unknown_or_missing_kind() -> None:
    _reject([_pack({**REPLY, "kind": "telepathy"})], ErrorCode.UNKNOWN_KIND, 77)
    _reject([_pack({"v": 1, "id": 3})], ErrorCode.BAD_MESSAGE, 3)
    _reject([_pack({"v": 1, "kind": 4, "id": 3})], ErrorCode.BAD_MESSAGE, 3)


def test_oversized_messages() -> None:
    limits = WireLimits(max_message_bytes=1000, max_header_bytes=100, max_frames=3)
    small = _pack(REPLY)
    _reject([small, bytes(600), bytes(600)], ErrorCode.TOO_LARGE, None, limits=limits)
    _reject([_pack({**REPLY, "body": "x" * 200})], ErrorCode.TOO_LARGE, None, limits=limits)
    _reject([small, b"", b"", b""], ErrorCode.TOO_LARGE, None, limits=limits)
    str_limit = WireLimits(max_str_len=10)
    _reject([_pack({**REPLY, "body": "y" * 11})], ErrorCode.TOO_LARGE, None, limits=str_limit)
    len_limit = WireLimits(max_container_len=10)
    _reject([_pack({**REPLY, "body": list(range(11))})], ErrorCode.TOO_LARGE, None, limits=len_limit)


def test_deep_nesting_beyond_msgpack_stack() -> None:
    _reject([b"\x91" * 100_000 + b"\xc0"], ErrorCode.BAD_MESSAGE, None)


def test_nesting_beyond_max_depth_keeps_the_id() -> None:
    limits = WireLimits()
    body: Any = "leaf"
    for _ in range(limits.max_depth - 1):  # header map is depth 1, so this is max_depth
        body = [body]
    assert decode([_pack({**REPLY, "body": body})]) == Reply(77, body)
    _reject([_pack({**REPLY, "body": [body]})], ErrorCode.BAD_MESSAGE, 77)
    _reject([_pack({**REPLY, "body": {"k": body}})], ErrorCode.BAD_MESSAGE, 77)


@pytest.mark.parametrize(
    ("bomb", "code"),
    [
        (b"\xdd\xff\xff\xff\xff", ErrorCode.TOO_LARGE),  # array32 of 4 Gi items
        (b"\xdf\xff\xff\xff\xff", ErrorCode.TOO_LARGE),  # map32
        # msgpack checks str/bin data is present before their length limits: truncated.
        (b"\xdb\xff\xff\xff\xff", ErrorCode.BAD_MESSAGE),  # str32
        (b"\xc6\xff\xff\xff\xff", ErrorCode.BAD_MESSAGE),  # bin32
        (b"\xc9\xff\xff\xff\xff\x01", ErrorCode.TOO_LARGE),  # ext32
        (b"\xdd\x00\x0d\xbb\xa0", ErrorCode.TOO_LARGE),  # 900_000 items: < max_container_len
        (b"\xdf\x00\x07\xa1\x20", ErrorCode.TOO_LARGE),  # 500_000 entries: < max_container_len
    ],
)
def test_declared_length_bombs_are_refused_before_allocation(bomb: bytes, code: ErrorCode) -> None:
    # As the whole header and nested as a body: both must fail without preallocating.
    nested = b"\x84\xa1v\x01\xa4kind\xa5reply\xa2id\x05\xa4body" + bomb
    tracemalloc.start()
    try:
        for frame in (bomb, nested):
            _reject([frame + b"\x00" * 8], code, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Guard only: msgpack 1.x happens not to preallocate declared arrays either. What
    # catches an uncapped decoder is the code: without the buffer-size cap the 900k
    # array is "incomplete input" (BAD_MESSAGE), not TOO_LARGE.
    assert peak < 512 * 1024, peak


@pytest.mark.parametrize(
    ("header", "msg_id"),
    [
        ({"v": 1, "kind": "request", "id": 4, "method": "m"}, 4),  # no target
        ({"v": 1, "kind": "request", "id": 4, "target": 1, "method": "m"}, 4),
        ({"v": 1, "kind": "request", "id": 4, "target": "t", "method": "m", "stream": 1}, 4),
        ({"v": 1, "kind": "request", "id": 4, "target": "t", "method": "m", "timeout_ms": -1}, 4),
        ({"v": 1, "kind": "request", "id": 4, "target": "t", "method": "m", "timeout_ms": 1.5}, 4),
        ({"v": 1, "kind": "request", "id": "4", "target": "t", "method": "m"}, None),
        ({"v": 1, "kind": "reply", "id": True}, None),
        ({"v": 1, "kind": "reply", "id": -1}, None),
        ({"v": 1, "kind": "reply", "id": 2.0}, None),
        ({"v": 1, "kind": "reply"}, None),
        ({"v": 1, "kind": "stream_item", "id": 4}, 4),
        ({"v": 1, "kind": "stream_end", "id": 4, "seq": -1}, 4),
        ({"v": 1, "kind": "error", "id": 4, "code": "internal"}, 4),
        ({"v": 1, "kind": "error", "code": "internal", "message": "m"}, None),
        ({"v": 1, "kind": "error", "id": 4, "code": 3, "message": "m"}, 4),
        ({"v": 1, "kind": "error", "id": 4, "code": "internal", "message": "m", "details": [1]}, 4),
        ({"v": 1, "kind": "cancel"}, None),
        ({"v": 1, "kind": "heartbeat", "seq": 1}, None),
        ({"v": 1, "kind": "heartbeat", "seq": 1, "sent_at": "now"}, None),
        ({"v": 1, "kind": "heartbeat", "seq": 1, "sent_at": 1.0, "node": 5}, None),
    ],
)
def test_missing_or_mistyped_fields(header: dict[str, Any], msg_id: int | None) -> None:
    _reject([_pack(header)], ErrorCode.BAD_MESSAGE, msg_id)


def test_decode_rejects_bad_tensor_type_argument() -> None:
    with pytest.raises(ValueError):
        decode([_pack(REPLY)], tensor_type="jax")  # type: ignore[arg-type]

"""Round-trip tests of treeserve.transport.codec: every kind, tensors, actor refs."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from treeserve.transport import (
    ActorAddress,
    Cancel,
    EncodeError,
    Error,
    ErrorCode,
    Heartbeat,
    Reply,
    Request,
    StreamEnd,
    StreamItem,
    WireLimits,
    decode,
    encode,
)
from treeserve.transport.codec import DecodeError


def _same(a: Any, b: Any) -> bool:
    """Deep, exact (bitwise for tensors, dtype/shape included) equality."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.contiguous().view(-1).view(torch.uint8).tolist()
            == b.contiguous().view(-1).view(torch.uint8).tolist()
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _roundtrip(msg: Any, **kw: Any) -> Any:
    frames = encode(msg)
    # What zmq delivers: plain bytes per frame.
    return decode([bytes(f) for f in frames], **kw)


BODY = {"s": "héllo", "i": -3, "big": 2**63, "f": 1.5, "n": None, "b": True, "raw": b"\x00\xff",
        "l": [1, [2, [3]]], "d": {"k": {"j": []}}}

MESSAGES = [
    Request(1, "verifier-0", "verify", BODY, timeout_ms=2500, stream=True),
    Request(2**64 - 1, "a", "b"),
    Reply(3, BODY),
    Reply(4),
    StreamItem(5, 0, "tok"),
    StreamEnd(5, 7, {"done": True}),
    Error(6, ErrorCode.OVERLOADED, "queue full", retryable=True, details={"queue": 12}),
    Error(None, ErrorCode.BAD_MESSAGE, "unreadable"),
    Cancel(8),
    Heartbeat(9, 1234.5, node="node-a"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_kind_roundtrips_exactly(msg: Any) -> None:
    out = _roundtrip(msg)
    assert type(out) is type(msg)
    for name in msg.__slots__:
        assert _same(getattr(msg, name), getattr(out, name)), name


def test_same_helper_detects_a_flipped_bit() -> None:
    # Guards the guard: a lossy codec must fail the round-trip comparisons above.
    a = np.arange(10, dtype=np.float32)
    b = a.copy()
    b.view(np.uint8)[5] ^= 1
    assert not _same(a, b)
    assert not _same(a, a.astype(np.float64))
    assert not _same({"x": 1}, {"x": 1.0})


def test_header_uses_named_keys_and_version() -> None:
    import msgpack

    header = msgpack.unpackb(encode(Cancel(42))[0])
    assert header == {"v": 1, "kind": "cancel", "id": 42}


NP_DTYPES = [np.float32, np.int64, np.bool_, np.float16, np.uint8, np.float64, np.int32]


@pytest.mark.parametrize("dtype", NP_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (2, 3), (5,)])
def test_numpy_tensors_roundtrip(dtype: Any, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    arr = np.asarray((rng.standard_normal(shape) * 10).astype(dtype))
    assert arr.shape == shape
    out = _roundtrip(Reply(1, {"t": arr, "nested": [arr, {"again": arr}]}))
    assert _same(out.body["t"], arr)
    assert _same(out.body["nested"][0], arr)
    assert _same(out.body["nested"][1]["again"], arr)
    assert not out.body["t"].flags.writeable


TORCH_DTYPES = [torch.float32, torch.int64, torch.bool, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (4, 0), (3, 5)])
def test_torch_tensors_roundtrip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=gen) * 10).to(dtype)
    out = _roundtrip(Reply(1, [t]), tensor_type="torch")
    assert _same(out.body[0], t)


@pytest.mark.parametrize(
    "values", [[1.0, -2.5, 3.140625, 1e30, float("inf"), -0.0], 7.5, []], ids=["1d", "0d", "empty"]
)
def test_torch_bfloat16_to_numpy_is_exact_float32(values: Any) -> None:
    t = torch.tensor(values, dtype=torch.bfloat16)
    out = _roundtrip(Reply(1, t))
    assert out.body.dtype == np.float32 and out.body.shape == tuple(t.shape)
    assert out.body.tobytes() == t.float().numpy().tobytes()


def test_numpy_decoded_as_torch_and_back() -> None:
    arr = np.arange(12, dtype=np.int64).reshape(3, 4)
    out = _roundtrip(Reply(1, arr), tensor_type="torch")
    assert isinstance(out.body, torch.Tensor)
    assert out.body.tolist() == arr.tolist()


def test_non_contiguous_inputs_are_sent_in_logical_order() -> None:
    arr = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2].T  # strided + transposed
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()[1:, ::2]
    assert not arr.flags.c_contiguous and not t.is_contiguous()
    out = _roundtrip(Request(1, "a", "b", {"np": arr, "pt": t}))
    assert out.body["np"].tolist() == arr.tolist()
    assert out.body["pt"].tolist() == t.tolist()


def test_big_endian_numpy_is_sent_little_endian() -> None:
    arr = np.arange(5, dtype=">i4")
    out = _roundtrip(Reply(1, arr))
    assert out.body.dtype == np.dtype("<i4") and out.body.tolist() == [0, 1, 2, 3, 4]


def test_large_tensor_is_zero_copy_and_small_is_copied() -> None:
    limits = WireLimits(zero_copy_threshold=1024)
    big = np.ones(1024, dtype=np.float32)  # 4 KiB >= threshold
    small = np.ones(8, dtype=np.float32)
    frames = encode(Reply(1, [big, small]), limits)
    assert isinstance(frames[1], memoryview)
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), big)
    assert isinstance(frames[2], bytes)

    t = torch.ones(2048, dtype=torch.bfloat16)
    tframe = encode(Reply(1, t), limits)[1]
    assert isinstance(tframe, memoryview)
    assert np.frombuffer(tframe, np.uint8).ctypes.data == t.data_ptr()


def test_large_torch_decode_shares_frame_memory() -> None:
    limits = WireLimits(zero_copy_threshold=1024)
    frames = [bytes(f) for f in encode(Reply(1, torch.ones(1024)), limits)]
    out = decode(frames, limits, tensor_type="torch")
    assert out.body.data_ptr() == np.frombuffer(frames[1], np.uint8).ctypes.data


def test_actor_address_nested_in_body() -> None:
    addr = ActorAddress("tcp://127.0.0.1:5555", "verifier-0")
    body = {"reply_to": addr, "peers": [addr, ActorAddress("ipc:///tmp/x", "s")], "t": np.zeros(2)}
    out = _roundtrip(Request(1, "a", "b", body))
    assert out.body["reply_to"] == addr
    assert out.body["peers"][1] == ActorAddress("ipc:///tmp/x", "s")
    assert hash(out.body["reply_to"]) == hash(addr)


def test_tuples_become_lists_and_numpy_scalars_become_python() -> None:
    out = _roundtrip(Reply(1, {"t": (1, 2), "s": np.float32(0.5), "i": np.int64(3)}))
    assert out.body == {"t": [1, 2], "s": 0.5, "i": 3}


def test_unknown_header_keys_are_ignored() -> None:
    import msgpack

    header = msgpack.unpackb(encode(Reply(5, "x"))[0])
    header["future_field"] = {"anything": [1, 2]}
    assert decode([msgpack.packb(header)]) == Reply(5, "x")


def test_unknown_error_code_decodes_as_internal() -> None:
    import msgpack

    raw = {"v": 1, "kind": "error", "id": 3, "code": "brand_new", "message": "m", "retryable": True}
    out = decode([msgpack.packb(raw)])
    assert isinstance(out, Error)
    assert out.code is ErrorCode.INTERNAL and out.retryable
    assert out.details == {"unknown_code": "brand_new"}


@pytest.mark.parametrize(
    "msg",
    [
        Reply(1, object()),
        Reply(1, {1: "int key"}),
        Reply(1, np.array(["a", "b"])),
        Reply(1, np.zeros(2, dtype=np.complex64)),
        Reply(1, torch.zeros(2, dtype=torch.complex64)),
        Reply(-1),
        Request(1, "a", "b", timeout_ms=-5),
        Heartbeat(1, float("nan")),
        Error(1, "overloaded", "code must be the enum"),  # type: ignore[arg-type]
    ],
)
def test_unsendable_values_raise_encode_error(msg: Any) -> None:
    with pytest.raises(EncodeError):
        encode(msg)


def test_encode_refuses_what_a_peer_would_reject() -> None:
    limits = WireLimits(max_depth=4, max_frames=2, max_message_bytes=10_000, max_header_bytes=1000)
    with pytest.raises(EncodeError, match="depth"):
        encode(Reply(1, [[[["deep"]]]]), limits)
    with pytest.raises(EncodeError, match="frames"):
        encode(Reply(1, [np.zeros(1), np.zeros(1)]), limits)
    with pytest.raises(EncodeError, match="max_message_bytes"):
        encode(Reply(1, np.zeros(2000)), limits)
    with pytest.raises(EncodeError, match="max_header_bytes"):
        encode(Reply(1, "x" * 2000), limits)
    encode(Reply(1, [[["ok"]]]), limits)  # depth 4: header, list, list, list
    small_str = WireLimits(max_str_len=8, max_container_len=4)  # a reply header has 4 keys
    encode(Reply(1, {"k": ["é" * 4, b"12345678"]}), small_str)  # 8 bytes each: fits
    too_big = (["é" * 5], {"k": b"123456789"}, {"long-key!": 1}, [1] * 5, {"a": {"b": (1,) * 5}})
    for body in too_big:
        with pytest.raises(EncodeError):
            encode(Reply(1, body), small_str)
        # ...and a receiver with the same limits rejects the same bytes.
        raw = msgpack.packb({"v": 1, "kind": "reply", "id": 1, "body": body})
        with pytest.raises(DecodeError):
            decode([raw], small_str)
    assert decode(encode(Reply(1, {"k": ["é" * 4]}), small_str), small_str) == Reply(1, {"k": ["é" * 4]})


def test_torch_is_not_imported_by_the_transport() -> None:
    import subprocess
    import sys

    code = (
        "import sys, numpy as np; import treeserve.transport as t;"
        "t.decode(t.encode(t.Reply(1, np.zeros(3))));"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_decode_error_carries_fields() -> None:
    err = DecodeError(ErrorCode.BAD_TENSOR, "x", 3)
    assert (err.code, err.message, err.msg_id) == (ErrorCode.BAD_TENSOR, "x", 3)


def test_misaligned_large_frame_decodes_correctly_to_torch() -> None:
    limits = WireLimits(zero_copy_threshold=1024)
    arr = np.arange(1024, dtype=np.float64)
    header, frame = (bytes(f) for f in encode(Reply(1, arr), limits))
    shifted = bytearray(len(frame) + 1)
    shifted[1:] = frame
    view = memoryview(bytes(shifted))[1:]  # data starts at an odd address
    out = decode([header, view], limits, tensor_type="torch")
    assert out.body.tolist() == arr.tolist()
    assert out.body.data_ptr() % 8 == 0


def test_encoding_a_non_message_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        encode("not a message")  # type: ignore[arg-type]

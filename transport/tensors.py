"""Tensor <-> raw frame conversion for the codec (numpy always; torch only if imported).

On the wire a tensor is a dtype name, a shape and one frame holding its elements in
C order, little-endian. torch is never imported here: a value can only be a torch
tensor if the application already imported torch, and decoding to torch imports it on
first use.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from treeserve.transport.errors import EncodeError, TransportError

__all__ = ["WIRE_DTYPES", "is_tensor", "tensor_from_frame", "tensor_to_frame"]

WIRE_DTYPES: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}
"""Wire dtype name -> item size in bytes. Names match numpy's and torch's spellings."""


def _torch() -> Any:
    """The torch module if the application imported it, else None (never imports it)."""
    return sys.modules.get("torch")


def is_tensor(obj: object) -> bool:
    """True for a numpy ndarray or a torch tensor (the latter only if torch is loaded)."""
    if isinstance(obj, np.ndarray):
        return True
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


def tensor_to_frame(
    obj: Any, zero_copy_threshold: int
) -> tuple[str, list[int], bytes | memoryview]:
    """Return ``(dtype name, shape, frame)`` for a numpy array or torch CPU tensor.
    Non-contiguous or big-endian input is copied to C order little-endian first; a frame
    of at least ``zero_copy_threshold`` bytes is a memoryview sharing the (contiguous)
    tensor's memory, a smaller one is a bytes copy. Raises ``EncodeError`` for dtypes
    not in ``WIRE_DTYPES`` and for tensors not on the CPU."""
    if isinstance(obj, np.ndarray):
        dtype_name, shape, flat = _numpy_flat_bytes(obj)
    else:
        dtype_name, shape, flat = _torch_flat_bytes(obj)
    if flat.nbytes >= zero_copy_threshold:
        return dtype_name, shape, flat.data  # memoryview of the same memory
    return dtype_name, shape, flat.tobytes()


def _numpy_flat_bytes(arr: np.ndarray[Any, Any]) -> tuple[str, list[int], np.ndarray[Any, Any]]:
    name = arr.dtype.name
    if name not in WIRE_DTYPES or arr.dtype.kind not in "biuf":
        raise EncodeError(
            f"numpy dtype {arr.dtype} cannot go on the wire; use one of {sorted(WIRE_DTYPES)}"
        )
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    shape = [int(d) for d in arr.shape]
    return name, shape, arr.reshape(-1).view(np.uint8)


def _torch_flat_bytes(t: Any) -> tuple[str, list[int], np.ndarray[Any, Any]]:
    torch = _torch()
    if t.device.type != "cpu":
        raise EncodeError(f"only CPU tensors go on the wire; move the {t.device} tensor first")
    if t.layout != torch.strided:
        raise EncodeError(f"only dense (strided) tensors go on the wire, got {t.layout}")
    name = str(t.dtype).removeprefix("torch.")
    if name not in WIRE_DTYPES:
        raise EncodeError(
            f"torch dtype {t.dtype} cannot go on the wire; use one of {sorted(WIRE_DTYPES)}"
        )
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    shape = [int(d) for d in t.shape]
    # (numel * itemsize,) byte view of the same storage; .numpy() shares memory.
    flat = t.reshape(-1).view(torch.uint8).numpy()
    return name, shape, flat


def tensor_from_frame(
    dtype: str,
    shape: list[int],
    view: memoryview,
    *,
    tensor_type: Literal["numpy", "torch"],
    copy_below: int,
    on_error: Callable[[str], Exception],
) -> Any:
    """Validate and build a tensor from a frame; errors are raised as ``on_error(text)``.

    numpy: a read-only array sharing the frame memory; bfloat16 becomes an exactly equal
    float32 array (a copy), since numpy has no bfloat16. torch: frames smaller than
    ``copy_below`` bytes (or misaligned) are copied into a fresh writable tensor; larger
    ones are zero-copy views of the frame memory and must be treated as read-only
    (``clone()`` before writing). A bool frame whose bytes are not all 0/1 is rejected."""
    itemsize = WIRE_DTYPES.get(dtype)
    if itemsize is None:
        raise on_error(f"unknown tensor dtype {dtype!r}")
    expected = math.prod(shape) * itemsize
    if expected != view.nbytes:
        raise on_error(
            f"tensor {dtype}{shape} needs {expected} bytes but its frame has {view.nbytes}"
        )
    if dtype == "bool" and view.nbytes and int(np.frombuffer(view, np.uint8).max()) > 1:
        raise on_error("bool tensor frame holds bytes other than 0 and 1")
    if tensor_type == "numpy":
        return _numpy_from_frame(dtype, shape, view)
    return _torch_from_frame(dtype, shape, view, copy_below)


def _numpy_from_frame(dtype: str, shape: list[int], view: memoryview) -> np.ndarray[Any, Any]:
    if dtype == "bfloat16":
        bits = np.frombuffer(view, dtype="<u2").astype("<u4") << 16
        out = bits.view("<f4").reshape(shape)
    else:
        out = np.frombuffer(view, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
    out.flags.writeable = False
    return out


def _torch_from_frame(dtype: str, shape: list[int], view: memoryview, copy_below: int) -> Any:
    import torch  # deferred: only callers asking for torch tensors pay for the import

    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI host
        raise TransportError("decoding to torch tensors needs a little-endian host")
    torch_dtype = getattr(torch, dtype)
    if view.nbytes == 0:
        return torch.empty(shape, dtype=torch_dtype)
    is_aligned = np.frombuffer(view, np.uint8).ctypes.data % WIRE_DTYPES[dtype] == 0
    if view.nbytes < copy_below or not is_aligned:
        return torch.frombuffer(bytearray(view), dtype=torch_dtype).reshape(shape)
    with warnings.catch_warnings():
        # The frame is read-only memory; callers are told to treat the tensor as such.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(view, dtype=torch_dtype).reshape(shape)

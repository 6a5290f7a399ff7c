"""The names of wire values in error texts: msgpack's types, never Python's.

A peer written in any language reads our errors, so a message says ``got nil`` or ``got bin``
(``PROTOCOL.md`` section 2), not ``got NoneType`` or ``b'prompt'``. Every error text that
describes a received value goes through :func:`wire_type` or :func:`wire_repr`.
"""

from __future__ import annotations

from treeserve.transport.messages import ActorAddress
from treeserve.transport.tensors import is_tensor

__all__ = ["wire_repr", "wire_type"]

_MAX_SHOWN_CHARS = 40


def wire_type(value: object) -> str:
    """The wire type of a decoded value: ``nil``, ``bool``, ``int``, ``float``, ``str``, ``bin``,
    ``array``, ``map``, ``tensor`` (ext 1) or ``actor address`` (ext 2); ``ext`` otherwise."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, bytes | bytearray | memoryview):
        return "bin"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "map"
    if isinstance(value, ActorAddress):
        return "actor address"
    if is_tensor(value):
        return "tensor"
    return "ext"


def _count(num: int, noun: str, plural: str) -> str:
    return f"{num} {noun if num == 1 else plural}"


def wire_repr(value: object) -> str:
    """A short, language-neutral rendering of a received value for an error text: scalars as
    written (``nil``, ``true``, ``3``, ``1.5``, ``nan``, ``'text'``, cut after 40 characters),
    containers and bins by type and size (``array (2 items)``, ``bin (6 bytes)``)."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)  # a float's str is "nan", "inf" or digits: no Python spelling
    if isinstance(value, str):
        if len(value) <= _MAX_SHOWN_CHARS:
            return repr(value)
        return repr(value[:_MAX_SHOWN_CHARS]) + "..."
    if isinstance(value, bytes | bytearray | memoryview):
        return f"bin ({_count(len(value), 'byte', 'bytes')})"
    if isinstance(value, list | tuple):
        return f"array ({_count(len(value), 'item', 'items')})"
    if isinstance(value, dict):
        return f"map ({_count(len(value), 'entry', 'entries')})"
    return wire_type(value)

"""PROTOCOL.md's worked examples must match what the encoder really produces."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

import treeserve.transport
from treeserve.transport import Reply, Request, decode, encode

DOC = Path(treeserve.transport.__file__).with_name("PROTOCOL.md").read_text(encoding="utf-8")


def _hex_blocks() -> list[bytes]:
    blocks = re.findall(r"```\n([0-9a-f \n]+)```", DOC)
    return [bytes.fromhex(block.replace("\n", " ")) for block in blocks]


def test_worked_request_example_matches_encoder() -> None:
    request = Request(1, "echo", "ping", {"x": 1}, timeout_ms=500, stream=False)
    frames = encode(request)
    example = _hex_blocks()[0]
    assert len(example) == 76
    assert frames == [example]
    assert decode([example]) == request


def test_worked_tensor_example_matches_encoder() -> None:
    frames = [bytes(f) for f in encode(Reply(1, np.array([1.0, 2.0], dtype=np.float32)))]
    header = _hex_blocks()[1]
    assert frames[0] == header
    assert frames[1] == bytes.fromhex("00 00 80 3f 00 00 00 40")


def test_doc_has_gateway_placeholder_and_every_error_code() -> None:
    assert "## 11. Gateway messages" in DOC
    for code in treeserve.transport.ErrorCode:
        assert f"| `{code.value}` |" in DOC, code
    for code in treeserve.transport.RETRYABLE_CODES:
        assert f"| `{code.value}` | **yes** |" in DOC, code

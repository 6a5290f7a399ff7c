"""The README's Python blocks run as pasted, each a script of its own, against a real server (the
tiny model, ZeroMQ and HTTP): only the addresses and the model's name are swapped for the test
server's. A block that fails (a top-level ``async with``, a wrong name) fails this test.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

import http_helpers as helpers  # registered by conftest.py
from treeserve.server import Server

pytestmark = [pytest.mark.timeout(240)]

README = Path(__file__).resolve().parents[2] / "README.md"
ZMQ_ADDRESS, HTTP_ADDRESS, MODEL_NAME = "tcp://127.0.0.1:5555", "http://127.0.0.1:8000", "smollm2-135m-instruct"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return helpers.write_chat_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(folder: Path) -> AsyncIterator[Any]:
    config = helpers.http_config(folder, bind="tcp://127.0.0.1:0", speculators=())
    async with Server(config) as running:
        yield running


def test_the_readme_has_its_python_blocks() -> None:
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 2 and any(ZMQ_ADDRESS in b for b in blocks) and any(HTTP_ADDRESS in b for b in blocks)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("index", range(len(python_blocks(README.read_text(encoding="utf-8")))))
async def test_a_readme_python_block_runs_as_a_script(server: Any, index: int, tmp_path: Path) -> None:
    block = python_blocks(README.read_text(encoding="utf-8"))[index]
    script = (block.replace(ZMQ_ADDRESS, server.endpoint).replace(HTTP_ADDRESS, server.http_url)
              .replace(MODEL_NAME, helpers.MODEL))
    path = tmp_path / f"readme_block_{index}.py"
    path.write_text(script, encoding="utf-8")
    done = await asyncio.to_thread(subprocess.run, [sys.executable, str(path)], capture_output=True, text=True,
                                   timeout=180)
    assert done.returncode == 0, f"README block {index} failed:\n{script}\n{done.stderr}"
    assert done.stdout.strip(), f"README block {index} printed nothing"

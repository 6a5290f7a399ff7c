"""The command line's start: ``import treeserve.cli`` is torch-free, and ``generate``/``serve``
prestart their one local verifier (:func:`treeserve.cli.prestart_verifier`) before importing
anything heavy, with the model flags they were given; other commands and layouts do not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from treeserve import cli
from treeserve.runtime import process


def test_importing_the_command_line_does_not_import_torch() -> None:
    code = "import sys, treeserve.cli; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.fixture
def prestarts(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    started: list[Any] = []
    monkeypatch.setattr(process, "prestart", started.append)
    return started


@pytest.mark.parametrize("argv", [
    ["generate", "Hi"],
    ["generate", "Hi", "--max-tokens", "5", "--speculate", "none"],
    ["serve", "--bind", "tcp://127.0.0.1:0"],
    ["serve", "--tp", "1", "--nodes", "0"],
])
def test_generate_and_serve_prestart_their_verifier(prestarts: list[Any], argv: list[str]) -> None:
    assert cli.prestart_verifier(argv)
    (warmup,) = prestarts
    assert warmup.actor == cli.VERIFIER_ACTOR and warmup.hook == cli.PRELOAD_HOOK
    assert warmup.hook_args == {"model": "smollm2-135m-instruct", "cache_dir": None, "weight_format": "auto"}


def test_the_warm_up_reads_the_model_flags(prestarts: list[Any], tmp_path: Any) -> None:
    assert cli.prestart_verifier(["generate", "--model", "m.gguf", "--cache-dir", str(tmp_path), "--dtype", "int8", "x"])
    assert prestarts[0].hook_args == {"model": "m.gguf", "cache_dir": str(tmp_path), "weight_format": "int8"}
    assert cli.prestart_verifier(["serve", "--device", "cuda:0"])
    assert prestarts[1].hook_args["weight_format"] is None  # a CUDA verifier formats on its device


@pytest.mark.parametrize("argv", [
    [],
    ["pull"],
    ["generate", "Hi", "--in-process"],
    ["generate", "--help"],
    ["serve", "--tp", "2"],
    ["serve", "--nodes", "1"],
    ["serve", "--model"],  # malformed: the full parser reports it
    ["train-predictor", "--help"],
])
def test_no_prestart_where_no_single_local_verifier_starts(prestarts: list[Any], argv: list[str]) -> None:
    assert not cli.prestart_verifier(argv)
    assert prestarts == []


def test_the_verifier_actor_and_hook_paths_exist() -> None:
    import importlib

    for path in (cli.VERIFIER_ACTOR, cli.PRELOAD_HOOK):
        module, _, name = path.partition(":")
        assert callable(getattr(importlib.import_module(module), name))


@pytest.mark.parametrize(("flags", "expected"), [
    ([], False),  # the default 128 tokens: eager finishes first
    (["--max-tokens", "511"], False),
    (["--max-tokens", "512"], True),
    (["--compile", "yes"], True),
    (["--compile", "no", "--max-tokens", "4096"], False),
])
def test_generate_compiles_its_decode_step_only_where_it_pays(flags: list[str], expected: bool) -> None:
    from treeserve.cli_generate import compile_decode

    args = cli.build_parser().parse_args(["generate", "Hi", *flags])
    assert compile_decode(args) is expected


def test_cache_dir_names_the_whole_cache_for_this_process_and_its_children(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    from treeserve.ops.kernels import cpp_build
    from treeserve.ops.loaders.registry import resolve_cache_dir

    monkeypatch.delenv("TREESERVE_CACHE", raising=False)
    cli.use_cache_dir(["serve", "--http", "127.0.0.1:0"])
    assert "TREESERVE_CACHE" not in os.environ  # no flag: the default cache
    cli.use_cache_dir(["pull", "--cache-dir", str(tmp_path / "c")])
    # The environment is what child processes inherit, and what the kernels' builds read.
    assert os.environ["TREESERVE_CACHE"] == str(tmp_path / "c")
    assert cpp_build.build_dir() == tmp_path / "c" / "kernels" and resolve_cache_dir() == tmp_path / "c"

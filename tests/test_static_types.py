"""``mypy --strict`` passes on ``treeserve.transport``, ``treeserve.runtime`` and ``treeserve.actors``.

``pyproject.toml`` maps top-level folders (``transport/``, ``runtime/``, ...) into the one
``treeserve`` namespace, and the editable install finds them through an import hook that mypy
does not run. So this test lays the installed tree out as symlinks in a temporary folder, from
the same mapping, and runs mypy there with the project's ``[tool.mypy]`` configuration. Cold,
mypy takes about 20 s on 2 cores (most of it reading torch's annotations).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECKED = ("treeserve.transport", "treeserve.runtime", "treeserve.actors")
HELPERS = "treeserve_testing"
"""The test helpers (``tests/treeserve_testing``, not installed) are checked too: they were part
of ``runtime/`` and ``actors/`` once."""


def package_folders() -> dict[str, Path]:
    """Package name -> folder, as ``pyproject.toml`` maps them."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return {name: REPO / folder for name, folder in config["tool"]["setuptools"]["package-dir"].items()}


def lay_out_packages(root: Path) -> Path:
    """Symlink each mapped folder to where its package name puts it under ``root``.

    A package whose subpackage lives elsewhere (``treeserve``, whose ``treeserve.runtime`` is
    ``runtime/``) becomes a real folder of links to its entries, so that nothing is ever
    written into the repository through a link.
    """
    folders = package_folders()

    def is_relocated(name: str) -> bool:
        parent, _, leaf = name.rpartition(".")
        return parent not in folders or (folders[parent] / leaf).resolve() != folders[name].resolve()

    for name in sorted(folders, key=lambda n: n.count(".")):
        target = root.joinpath(*name.split("."))
        if target.exists():  # reached through its parent's link: the folder is where it belongs
            assert target.resolve() == folders[name].resolve(), (name, target)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if any(n.rpartition(".")[0] == name and is_relocated(n) for n in folders):
            target.mkdir()
            for entry in folders[name].iterdir():
                if entry.name != "__pycache__":
                    (target / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
        else:
            target.symlink_to(folders[name], target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for the module's runs: the second one reads torch's annotations from it."""
    return tmp_path_factory.mktemp("mypy-cache")


def run_mypy(tree: Path, packages: tuple[str, ...], cache_dir: Path) -> subprocess.CompletedProcess[str]:
    """``mypy --strict -p PACKAGE ...`` from ``tree`` with the project's configuration."""
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "MYPY_CACHE_DIR")}
    args = [sys.executable, "-m", "mypy", "--strict", "--config-file", str(REPO / "pyproject.toml"),
            "--cache-dir", str(cache_dir), "--no-error-summary", "--hide-error-context"]
    for package in packages:
        args += ["-p", package]
    return subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=240, check=False)


def test_the_laid_out_tree_is_the_installed_one(tmp_path: Path) -> None:
    tree = lay_out_packages(tmp_path)
    for name, folder in package_folders().items():
        for path in folder.glob("*.py"):  # each module of the package is where its name puts it
            assert tree.joinpath(*name.split("."), path.name).resolve() == path.resolve(), (name, path)
    assert not (REPO / "treeserve" / "runtime").exists()  # nothing was written through a link


def test_mypy_strict_passes_on_transport_runtime_and_actors(tmp_path: Path, cache_dir: Path) -> None:
    tree = lay_out_packages(tmp_path)
    (tree / HELPERS).symlink_to(REPO / "tests" / HELPERS, target_is_directory=True)
    done = run_mypy(tree, (*CHECKED, HELPERS), cache_dir)
    assert done.returncode == 0, f"mypy --strict failed:\n{done.stdout}{done.stderr}"


def test_mypy_reports_a_type_error_in_a_checked_package(tmp_path: Path, cache_dir: Path) -> None:
    """The check can fail: a wrong annotation in a copy of one module is reported."""
    tree = lay_out_packages(tmp_path / "tree")
    runtime = tree / "treeserve" / "runtime"
    assert runtime.is_symlink()
    runtime.unlink()  # a private copy of runtime/, so the edit never reaches the repository
    copy = tmp_path / "runtime-copy"
    copy.mkdir()
    for path in package_folders()["treeserve.runtime"].glob("*.py"):
        (copy / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    with (copy / "restart.py").open("a", encoding="utf-8") as handle:
        handle.write("\n\ndef _wrong() -> int:\n    return 'not an int'\n")
    runtime.symlink_to(copy, target_is_directory=True)
    done = run_mypy(tree, ("treeserve.runtime",), cache_dir)
    assert done.returncode == 1, done.stdout + done.stderr
    assert 'restart.py:' in done.stdout and "Incompatible return value type" in done.stdout, done.stdout

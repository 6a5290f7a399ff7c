"""``cpp_build.build``: processes that need the same kernel at once (a first start's verifier and
speculator children) compile it once; the others wait for that file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from treeserve.ops.kernels import cpp_build

pytestmark = pytest.mark.skipif(cpp_build.compiler() is None, reason="no C++ compiler")

BUILD = """
import sys
from pathlib import Path
from treeserve.ops.kernels import cpp_build
assert cpp_build.build(Path(sys.argv[1]), []) is not None
"""


def test_processes_building_the_same_kernel_at_once_compile_it_once(tmp_path: Path) -> None:
    source = tmp_path / "src" / "tiny.cpp"
    source.parent.mkdir()
    source.write_text("extern \"C\" int tiny() { return 7; }\n", encoding="utf-8")
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "cxx"  # a compiler that logs each compile and takes its time
    wrapper.write_text(f"#!/bin/sh\ncase \"$*\" in *--version*) exec g++ \"$@\";; esac\n"
                       f"echo compile >> {log}\nsleep 1\nexec g++ \"$@\"\n", encoding="utf-8")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "CXX": str(wrapper), "TREESERVE_CACHE": str(tmp_path / "cache")}
    builders = [subprocess.Popen([sys.executable, "-c", BUILD, str(source)], env=env) for _ in range(3)]
    assert [b.wait(timeout=120) for b in builders] == [0, 0, 0]
    assert log.read_text(encoding="utf-8").split() == ["compile"]
    assert len(list((tmp_path / "cache" / "kernels").glob("tiny-*.so"))) == 1

"""A compiled decode step built in a process of its own (:mod:`~treeserve.ops.loaders.build_step`),
and loaded by a server without stopping its event loop.

Tracing and compiling a decode step takes minutes, and it holds the interpreter lock in
stretches: importing inductor (``marshal`` of its large modules), dynamo's symbolic shapes
(sympy), inductor's graph passes. In a thread of a verifier's child process, on a 2-core host
beside two CPU-bound processes, they stopped the child's event loop, which sends its heartbeats,
for 0.5-1.4 s at a time (the default model in bfloat16; a tiny model: up to 1.05 s), and past
the 1.5 s its supervisor allows three times in seven minutes: each restart began the compile
again (issue 43). So a server's background compile runs in another interpreter at a lower CPU
priority (:func:`build_out_of_process`), and the server only loads the saved file, after
importing the compiler before it reports ready (:func:`import_compiler`): loading a saved step
in a thread without those imports done stalled the loop for 0.74-0.85 s, with them under 0.08 s.

``treeserve pull`` builds the same files in the foreground, so that a first ``serve`` finds
them (:func:`~treeserve.ops.loaders.load.load_model` with a weight format).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["BUILD_NICENESS", "build_out_of_process", "import_compiler", "loads_a_compiled_step"]

BUILD_NICENESS = 10
"""How much lower the build's CPU priority is than its parent's: serving comes first."""


def import_compiler() -> None:
    """Import what loading (or compiling) a saved step needs, about 2 s of work that holds the
    interpreter lock: call it where nothing else needs the lock yet (a child before it reports
    ready), so a later load in a thread beside the event loop leaves that loop running."""
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401


def loads_a_compiled_step(weight_format: str, device: str) -> bool:
    """Whether a model served in ``weight_format`` (resolved: not ``auto``) on ``device`` loads
    or compiles a decode step: a CPU int or bfloat16 format, except q4_1 and gguf where the CPU
    has AVX2 (every forward in one C++ op, nothing compiled)."""
    from treeserve.ops.kernels.cpp_build import cpu_flags

    if device != "cpu" or weight_format == "float32":
        return False
    return not (weight_format in ("q4_1", "gguf") and "avx2" in cpu_flags())


def build_out_of_process(source: Path, weight_format: str, cache_dir: str | Path | None,
                         artifact: Path) -> Callable[[], None]:
    """A function that writes ``artifact`` (the decode step of the model at ``source`` in
    ``weight_format``) by running this module in a new process, and raises ``RuntimeError``
    with the end of its error output when that fails."""
    def build() -> None:
        cmd = [sys.executable, "-m", "treeserve.ops.loaders.build_step", str(source), weight_format, str(artifact)]
        if cache_dir is not None:
            cmd += ["--cache-dir", str(cache_dir)]
        with tempfile.TemporaryFile() as errors:
            # stdin stays open until the build ends: the build exits when it closes (this process died).
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errors)
            try:
                code = proc.wait()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                assert proc.stdin is not None
                proc.stdin.close()
            errors.seek(0)
            tail = errors.read().decode(errors="replace").strip()[-800:]
        if code != 0 or not artifact.exists():
            raise RuntimeError(f"building {artifact.name} exited with status {code}: {tail}")
    return build

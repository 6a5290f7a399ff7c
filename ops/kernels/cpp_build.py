"""Build treeserve's C++ CPU kernels once per machine, against the running torch.

Each kernel is one ``.cpp`` file, one translation unit (its parts are the headers beside it that it
includes), that registers its dispatcher ops with ``TORCH_LIBRARY``. It is compiled with the
system C++ compiler (``g++``, or ``$CXX``) into ``$TREESERVE_CACHE/kernels`` (default
``~/.cache/treeserve/kernels``), under a name keyed by the source and every header beside it, the
flags, the compiler and the torch version, so a later process loads it without compiling. A
machine without a compiler, or a CPU without the instructions a kernel needs, gets ``None`` and
the caller's torch fallback.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)

AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
"""The AVX-512 subsets every kernel here may use (Skylake-SP and later)."""
AVX2 = ("-mavx2", "-mfma", "-mf16c")
"""The build of a ``simd16.h`` kernel for a CPU without AVX-512 (two ymm halves a vector)."""


def build_dir() -> Path:
    """Where compiled kernels are kept (beside the rest of treeserve's cache)."""
    root = os.environ.get("TREESERVE_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "treeserve") / "kernels"


def compiler() -> str | None:
    """The C++ compiler to build with, or None when the machine has none."""
    return shutil.which(os.environ.get("CXX", "g++"))


ISA_ENV = "TREESERVE_ISA"
"""Caps the instruction sets the kernels may use, for one process: ``amx`` (everything),
``avx512`` (no AMX tiles) or ``avx2`` (no AVX-512 either), so that one host runs, tests and
times every kernel path below its own (``TREESERVE_ISA=avx2 treeserve generate ...``)."""

ISA_LEVELS = ("avx2", "avx512", "amx")


def isa_cap() -> str:
    """The cap :data:`ISA_ENV` sets (``amx``, no cap, when unset); ``ValueError`` on another name."""
    cap = os.environ.get(ISA_ENV, "amx").strip().lower() or "amx"
    if cap not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_LEVELS)}, got {cap!r}")
    return cap


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as ``/proc/cpuinfo`` lists them (empty where it cannot be read),
    less those :data:`ISA_ENV` hides: every kernel asks here before it builds or loads."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = frozenset(line.split(":", 1)[1].split())
            cap = isa_cap()
            if cap != "amx":
                flags = frozenset(f for f in flags if not f.startswith("amx"))
            if cap == "avx2":
                flags = frozenset(f for f in flags if not f.startswith("avx512"))
            return flags
    return frozenset()


def simd16_flags() -> tuple[str, ...] | None:
    """The build a ``simd16.h`` kernel takes on this CPU (:func:`cpu_flags`, so ``TREESERVE_ISA``
    applies): :data:`AVX512` where it has those four subsets, else :data:`AVX2` where it has
    AVX2, FMA and F16C, else None (no build)."""
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return AVX512
    return AVX2 if {"avx2", "fma", "f16c"} <= flags else None


def _torch_flags() -> list[str]:
    # What ``torch.utils.cpp_extension``'s include_paths() and library_paths() give on CPU,
    # without importing it: it imports setuptools (0.15 s of every start that loads a kernel).
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{path}" for path in (root / "include", root / "include" / "torch" / "csrc" / "api" / "include")]
    libs = [str(root / "lib")]
    return [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, *(f"-L{path}" for path in libs),
            *(f"-Wl,-rpath,{path}" for path in libs), "-lc10", "-ltorch_cpu"]


def build(source: Path, flags: Sequence[str]) -> Path | None:
    """The shared library of ``source`` built with ``flags`` (cached), or None when it cannot be
    built here (no compiler, or the compiler failed: logged with its message)."""
    cxx = compiler()
    if cxx is None:
        log.info("%s: no C++ compiler found; its torch fallback runs", source.name)
        return None
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
        all_flags = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", *flags, *_torch_flags()]
        headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what it may include
        key = hashlib.sha256(source.read_bytes() + headers + " ".join(all_flags).encode() + version.encode()
                             + torch.__version__.encode()).hexdigest()[:16]
        target = build_dir() / f"{source.stem}-{key}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # One builder per kernel across processes: a first start's verifier and speculator
        # children need the same kernels, and the second waits for the first's file instead of
        # compiling it again beside it.
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if target.exists():
                return target
            log.info("%s: compiling once for this machine (%s)", source.name, target)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                scratch = Path(tmp) / target.name
                subprocess.run([cxx, str(source), "-o", str(scratch), *all_flags], capture_output=True, text=True,
                               check=True)
                os.replace(scratch, target)  # atomic: a reader never sees half a file
        return target
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        log.warning("%s could not be built (%s); its torch fallback runs", source.name, detail)
        return None


def _register(path: Path, fakes: dict[str, Callable[..., object]]) -> None:
    torch.ops.load_library(str(path))  # registers the ops
    for op, shape in fakes.items():
        torch.library.register_fake(op)(shape)


_ops_lock = threading.RLock()  # a kernel's flags() may load the kernels it calls
_ops_loaded: dict[Path, bool] = {}


def load_ops(source: Path, flags: Callable[[], Sequence[str] | None],
             fakes: dict[str, Callable[..., object]] | None = None) -> bool:
    """Build and load a kernel once per process: ``source`` compiled with ``flags()`` (None: this
    CPU cannot run it; :func:`build`, cached), its ops loaded and their shape functions registered
    (``fakes``: op name -> function). True when its ops are loaded; False where ``flags()`` is
    None or the build failed (the caller's torch fallback runs). Later calls return the first
    call's answer without asking ``flags`` again."""
    with _ops_lock:
        if source not in _ops_loaded:
            chosen = flags()
            path = build(source, chosen) if chosen is not None else None
            if path is not None:
                _register(path, fakes or {})
            _ops_loaded[source] = path is not None
        return _ops_loaded[source]


VECTORS = 1
TILES = 2
VNNI = 4
"""The bits of what an AMX kernel's init reports (``treeserve_amx::init`` in ``amx_tiles.h``):
its vector paths may run; its AMX tile paths may run too; the CPU has AVX512-VNNI."""


_amx_lock = threading.Lock()
_amx_loaded: dict[Path, int] = {}


def load_amx_ops(source: Path, flags: Sequence[str], init_symbol: str, fakes: dict[str, Callable[..., object]],
                 needs: frozenset[str], fallback: str, *, tiles: bool = True) -> int:
    """Build and load an AMX kernel once per process (one ``.cpp`` with an ``int
    init_symbol(void)`` that checks the CPU and asks the OS for the tile state, see
    ``amx_tiles.h``), and register its ops' shape functions (``fakes``: op name -> function).

    Returns the init's mask: :data:`VECTORS` where the kernel runs on this CPU (which must
    offer ``needs``, as ``/proc/cpuinfo`` spells them), with :data:`TILES` where this process
    may also run AMX tiles (without them the op runs its vector paths at every shape); 0,
    logged with ``fallback`` (what runs instead), where this CPU, compiler or OS cannot run it.
    ``tiles=False``: a kernel without tile paths (nothing is logged about tiles). Later calls
    return the first call's answer."""
    with _amx_lock:
        if source not in _amx_loaded:
            _amx_loaded[source] = _load_amx_ops(source, flags, init_symbol, fakes, needs, fallback, tiles)
        return _amx_loaded[source]


def _load_amx_ops(source: Path, flags: Sequence[str], init_symbol: str, fakes: dict[str, Callable[..., object]],
                  needs: frozenset[str], fallback: str, tiles: bool) -> int:
    name = source.stem
    missing = needs - cpu_flags()
    if missing:
        log.info("%s: this CPU lacks %s; %s", name, ", ".join(sorted(missing)), fallback)
        return 0
    path = build(source, flags)
    if path is None:
        return 0
    try:
        library = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("%s: the kernel could not be loaded (%s); %s", name, exc, fallback)
        return 0
    init = getattr(library, init_symbol)
    init.restype = ctypes.c_int
    mask = int(init())
    if isa_cap() != "amx":  # the tiles hidden, as a VM without AMX would
        mask &= ~TILES
    if not mask & VECTORS:
        log.info("%s: the kernel's CPU check failed; %s", name, fallback)
        return 0
    if tiles and not mask & TILES:
        log.info("%s: no AMX tiles for this process (CPU, VM or OS); its vector path runs at every shape", name)
    _register(path, fakes)
    return mask

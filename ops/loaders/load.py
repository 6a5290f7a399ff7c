"""``load_model``: a model by registry name, ``.gguf`` path, converted folder or Hugging Face
folder, and ``prepare_for_serving``: its weight format and compiled decode step.

The first :func:`load_model` of a GGUF dequantizes it once and saves a *converted* folder
(float32 ``model.safetensors`` + ``treeserve-config.json`` +
``tokenizer.json``/``tokenizer_config.json``) so later starts only read safetensors. The int
formats' packed buffers and the compiled decode step are cached too (see
:func:`prepare_for_serving`). Registry names are pulled first (:mod:`treeserve.ops.loaders.registry`).
Progress goes to an optional callback; this module never prints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from treeserve.ops.block_types import StoredBlocks
from treeserve.ops.formats import WeightFormat, apply_format, prepared_buffers, resolve_format
from treeserve.ops.linears import PREPARED_KERNELS
from treeserve.ops.loaders.registry import (
    DEFAULT_MODEL,
    REGISTRY,
    ModelLoadError,
    Progress,
    ProgressCallback,
    pull,
    pulled_path,
    report_progress,
    resolve_cache_dir,
)
from treeserve.ops.model import Transformer
from treeserve.ops.model_config import ModelConfig
from treeserve.ops.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CONVERTED_FORMAT_VERSION = 2
CONFIG_FILE = "treeserve-config.json"
WEIGHTS_FILE = "model.safetensors"


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


def converted_dir_for(gguf_path: Path, cache_dir: str | Path | None = None) -> Path:
    """Where the converted cache of a GGUF lives (keyed by file name, size and mtime)."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return resolve_cache_dir(cache_dir) / "converted" / f"{gguf_path.stem}-{key}-v{CONVERTED_FORMAT_VERSION}"


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: ProgressCallback | None = None) -> None:
    """Dequantize ``gguf_path`` once and write a converted folder (written atomically)."""
    from safetensors.torch import save_file

    import gguf

    from treeserve.ops.loaders.gguf import GGUFFormatError, check_reader, parameter_types, read_gguf_reader
    from treeserve.ops.tokenizer import TokenizerError

    reader = gguf.GGUFReader(str(gguf_path))
    check_reader(reader)  # an unsupported architecture, block type or tokenizer: nothing written
    try:
        tokenizer = Tokenizer.from_gguf_reader(reader)
    except TokenizerError as exc:
        raise GGUFFormatError(str(exc)) from None
    report_progress(progress, "convert", f"reading {gguf_path.name} (one time)")
    model = read_gguf_reader(reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".convert-"))
    try:
        save_file(model.state_dict, str(tmp / WEIGHTS_FILE))
        types = parameter_types(reader, model.config, model.architecture)
        meta = {"format_version": CONVERTED_FORMAT_VERSION, "architecture": model.architecture,
                "source": str(gguf_path), "config": asdict(model.config), "tensor_types": types}
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
    background: bool = False,
) -> LoadedModel:
    """Load a model by registry name, ``.gguf`` path, converted folder or Hugging Face folder.

    Registry names are pulled first if needed. GGUF files are converted once into the cache
    dir and later loads read that converted copy. Weights end up in ``dtype``; with
    ``weight_format`` they are loaded in float32 and put into that format for serving
    (:func:`prepare_for_serving`, which also compiles the decode step unless ``compile_decode``
    is False; with ``background`` a first compile runs in a process of its own), and ``dtype``
    is ignored.
    """
    if weight_format is not None:
        dtype = torch.float32
    started = time.perf_counter()
    key = (str(name_or_path), None if cache_dir is None else str(cache_dir))
    if dtype == torch.float32 and key in _preloaded:
        loaded = _preloaded.pop(key)
        if weight_format is not None:
            prepare_for_serving(loaded.model, loaded.source, weight_format, cache_dir=cache_dir,
                                compile_decode=compile_decode, background=background, progress=progress)
        return loaded
    was_converted = False
    path = Path(name_or_path).expanduser()
    if isinstance(name_or_path, str) and name_or_path in REGISTRY:
        path = pull(name_or_path, cache_dir, progress=progress)
    if path.is_file() and path.suffix == ".gguf":
        folder = converted_dir_for(path, cache_dir)
        if not (folder / CONFIG_FILE).exists():
            convert_gguf(path, folder, progress=progress)
            was_converted = True
        report_progress(progress, "load", f"reading converted weights from {folder}")
        model, tokenizer = load_converted(folder, dtype)
    elif path.is_dir() and (path / CONFIG_FILE).exists():
        report_progress(progress, "load", f"reading converted weights from {path}")
        model, tokenizer = load_converted(path, dtype)
    elif path.is_dir() and (path / "config.json").exists():
        from treeserve.ops.loaders.hf import read_hf_folder

        report_progress(progress, "load", f"reading Hugging Face folder {path}")
        hf = read_hf_folder(path)
        model = Transformer.from_state_dict(hf.config, hf.state_dict, dtype=dtype)
        tokenizer = Tokenizer.from_folder(path)
    else:
        raise ModelLoadError(
            f"{name_or_path!s} is neither a known model ({', '.join(sorted(REGISTRY))}), a .gguf file, "
            "nor a folder with config.json"
        )
    if weight_format is not None:
        prepare_for_serving(model, path, weight_format, cache_dir=cache_dir, compile_decode=compile_decode,
                            background=background, progress=progress)
    seconds = time.perf_counter() - started
    report_progress(progress, "done", f"model ready in {seconds:.1f} s")
    return LoadedModel(model=model, tokenizer=tokenizer, config=model.config, source=path,
                       was_converted=was_converted, load_seconds=seconds)


_preloaded: dict[tuple[str, str | None], LoadedModel] = {}
"""float32 models read by :func:`preload`, by (name or path, cache dir), each for one later load."""
_preloaded_buffers: dict[Path, dict[str, torch.Tensor]] = {}
"""Saved int-format buffers read by :func:`preload`, by file, each for one later :func:`prepare_for_serving`."""


def preload(model: str, cache_dir: str | None = None, weight_format: str | None = None) -> bool:
    """Read ``model`` in float32 ahead of time, so that the next :func:`load_model` of the same
    name and cache dir in float32 (or in a ``weight_format``) takes it instead of reading it;
    with ``weight_format``, read the format's saved buffers for the whole model too (what
    :func:`prepare_for_serving` of an unsharded model reads).

    A prestarted verifier process runs this while its parent is still starting
    (:func:`treeserve.runtime.process.prestart`). It only reads a model that an earlier start
    pulled and converted: pulling and converting stay with the parent, so that two processes
    never write one cache. Returns whether it read the model.
    """
    path = Path(model).expanduser()
    if model in REGISTRY:
        pulled = pulled_path(model, cache_dir)
        if pulled is None:
            return False
        path = pulled
    folder = converted_dir_for(path, cache_dir) if path.is_file() and path.suffix == ".gguf" else path
    if not (folder / CONFIG_FILE).exists():
        return False
    started = time.perf_counter()
    net, tokenizer = load_converted(folder, torch.float32)
    saved = None
    if weight_format is not None:
        fmt = resolve_format(weight_format, net.config, net.device, stored_types_of(path, cache_dir))
        saved = _formatted_path(net, path, fmt, cache_dir) if fmt.is_int else None
    if saved is not None and saved.exists():
        buffers = _preloaded_buffers[saved] = read_buffers(saved)
        for tensor in buffers.values():
            touch_pages(tensor)
        # Formatting with saved buffers reads only the float32 values outside the linears.
        for module in net.modules():
            if not isinstance(module, torch.nn.Linear):
                for param in module.parameters(recurse=False):
                    touch_pages(param)
    else:
        for param in net.parameters():
            touch_pages(param)
    _preloaded[(model, cache_dir)] = LoadedModel(model=net, tokenizer=tokenizer, config=net.config, source=path,
                                                 was_converted=False, load_seconds=time.perf_counter() - started)
    return True


def read_buffers(path: Path) -> dict[str, torch.Tensor]:
    """A saved format's buffers (:func:`~treeserve.ops.formats.prepared_buffers`), mapped from
    the file (its pages are read on first touch)."""
    from safetensors.torch import load_file

    return load_file(str(path))


def touch_pages(tensor: torch.Tensor) -> None:
    """Read one element of every memory page of ``tensor``, so that a mapped file's pages are
    faulted in now instead of at first use (the default model's 540 MB of float32 took 1.7 s
    to touch on this project's loaded machine)."""
    flat = tensor.detach().reshape(-1)
    step = max(1, 4096 // flat.element_size())
    if flat.numel():
        flat[::step].sum()


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


def stored_types_of(source: Path, cache_dir: str | Path | None = None) -> dict[str, str]:
    """The GGUF block type of each weight by parameter name (empty when not from a GGUF), as
    recorded in its converted folder."""
    gguf_path = gguf_source_of(source)
    if gguf_path is None:
        return {}
    meta_path = converted_dir_for(gguf_path, cache_dir) / CONFIG_FILE
    if not meta_path.exists():
        return {}
    types: dict[str, str] = json.loads(meta_path.read_text(encoding="utf-8")).get("tensor_types", {})
    return types


def stored_blocks_of(source: Path) -> dict[str, StoredBlocks]:
    """The GGUF's own values of its integer-typed linear weights by parameter name
    (:func:`~treeserve.ops.loaders.gguf.read_stored_blocks`; empty when the weights are not from a
    GGUF). Decoded from the GGUF (about 5 s for the default model) and not kept: only a format's
    first :func:`prepare_for_serving` reads them, and it saves the format's buffers, which later
    starts read instead (a kept copy was 133 MB for the default model)."""
    gguf_path = gguf_source_of(source)
    if gguf_path is None:
        return {}
    from treeserve.ops.loaders.gguf import read_stored_blocks

    return read_stored_blocks(gguf_path)


def _formatted_path(model: Transformer, source: Path, fmt: WeightFormat, cache_dir: str | Path | None) -> Path:
    """Where the int kernels' buffers of ``model`` in ``fmt`` are saved: a file named by what
    they depend on (the weights' files, the model's shapes, shards included, torch, the code
    that packs them and the CPU kernels this machine runs), so a stale one is never read.

    Packing and quantizing take about 10 s for the default model in q4_1 on 2 cores; reading
    them back a fraction of a second.
    """
    from treeserve.ops import block_types, formats
    from treeserve.ops.kernels import codes8, q4_amx, q8_amx

    decoded = "stored-blocks"  # decoded blocks that older versions kept beside a converted GGUF: not the weights' files
    files = sorted(p for p in (source.iterdir() if source.is_dir() else [source])
                   if p.is_file() and not p.name.startswith(decoded))
    gguf = gguf_source_of(source)
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files + ([gguf] if gguf else [])]
    modules = (formats.__file__, q4_amx.__file__, q4_amx.SOURCE, q8_amx.__file__, q8_amx.SOURCE, codes8.__file__,
               block_types.__file__)
    code = b"".join(Path(m).read_bytes() for m in modules if m)
    key = "|".join([
        repr(stats), repr([(name, tuple(p.shape)) for name, p in model.named_parameters()]), fmt.value,
        torch.__version__, hashlib.sha256(code).hexdigest(),
        f"amx={fmt in (WeightFormat.Q4_1, WeightFormat.GGUF) and q4_amx.available()}",
        f"q8={fmt.is_int and q8_amx.available()}", f"c8={fmt is WeightFormat.GGUF and codes8.available()}",
        f"c8_avx2={fmt is WeightFormat.GGUF and codes8.avx2()}",  # which layout pack chose (five bits or not)
        ",".join(sorted(k.__name__ for k in PREPARED_KERNELS)),
    ])
    # Named by model, format and shapes (a tensor-parallel rank's slice has its own), then the key.
    shapes = hashlib.sha256(repr([tuple(p.shape) for p in model.parameters()]).encode()).hexdigest()[:8]
    name = f"{fmt.value}-{source.stem}-{shapes}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"
    return resolve_cache_dir(cache_dir) / "formatted" / name


def prepare_for_serving(
    model: Transformer,
    source: Path,
    weight_format: str | WeightFormat,
    *,
    cache_dir: str | Path | None = None,
    compile_decode: bool = True,
    background: bool = False,
    progress: ProgressCallback | None = None,
) -> Transformer:
    """Put a float32 ``model`` (sharded already, if tensor-parallel) into ``weight_format`` and,
    for the fast formats on CPU, attach the compiled one-token decode step. ``background``
    (a server's verifier): a step that must be compiled (minutes) compiles in a process of its
    own (:mod:`~treeserve.ops.loaders.prepare`; a tensor-parallel shard: on a thread) while the
    model serves eagerly, and a thread then loads it
    (:meth:`~treeserve.ops.decode_step.DecodeStep.prepare_in_background`);
    a saved one is still loaded before this returns (2-4 s). Loaded beside serving, it stalled
    the first steps by up to 1.2 s each for about 3 s (its imports and unpickling hold the
    interpreter lock), which cost a 128-token generation more than the wait it saved.

    The int formats' packed buffers are saved under ``<cache>/formatted`` on the first load and
    read back later (:func:`_formatted_path`). The decode step is compiled once per model,
    format and torch build and saved under
    ``<cache>/compiled`` (107-116 s on this project's 2 cores); later starts load it in seconds. If
    compiling fails (no C++ compiler, say), the model serves eagerly and a warning is logged.
    Where the model fits :meth:`~treeserve.ops.decode_step.DecodeStep.fuse` (q4_1 on a CPU with
    AVX2) every forward, prefills included, runs its blocks in one C++ op instead, whatever
    ``compile_decode`` says: nothing is compiled, and each row's logits are the same bits
    whatever shares its forward (so speculation, batching and compiling never change a greedy
    answer).
    float32 stays eager everywhere: it is the exact reference the losslessness tests compare.
    """
    from treeserve.ops.decode_step import DecodeStep, artifact_name

    fmt = resolve_format(weight_format, model.config, model.device, stored_types_of(source, cache_dir))
    saved = _formatted_path(model, source, fmt, cache_dir) if fmt.is_int else None
    if saved is not None and (saved in _preloaded_buffers or saved.exists()):
        prepared = _preloaded_buffers.pop(saved, None)
        apply_format(model, fmt, prepared=read_buffers(saved) if prepared is None else prepared)
    else:
        blocks = stored_blocks_of(source) if fmt in (WeightFormat.Q4_1, WeightFormat.GGUF) else {}
        apply_format(model, fmt, stored=blocks)
        if saved is not None and model.device.type == "cpu":
            from safetensors.torch import save_file

            saved.parent.mkdir(parents=True, exist_ok=True)
            partial = saved.with_suffix(f".partial-{os.getpid()}")
            save_file({name: t.contiguous() for name, t in prepared_buffers(model).items()}, str(partial))
            os.replace(partial, saved)
            # Older saves of this model and format (other code or weights) are never read again.
            for stale in saved.parent.glob(f"{saved.name.rsplit('-', 1)[0]}-*.safetensors"):
                if stale != saved:
                    stale.unlink(missing_ok=True)
    if fmt is WeightFormat.FLOAT32 or model.device.type != "cpu":
        return model
    fused = DecodeStep(model)
    if fused.fuse():  # the q4_1 format on a CPU with AVX2: one C++ op for every forward, nothing to compile
        model.decode_step = fused
        return model
    if not compile_decode:
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
    build = None
    if background and step.artifact is not None and not _has_hooks(model):  # a shard (hooks): not what a new process loads
        from treeserve.ops.loaders.prepare import build_out_of_process

        build = build_out_of_process(source, fmt.value, cache_dir, step.artifact)
    if step.attach(background=background, build=build):
        model.decode_step = step
    return model


def _has_hooks(model: torch.nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())

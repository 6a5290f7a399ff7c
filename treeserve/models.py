"""Model registry, ``pull``, the converted weight cache and ``load_model``: the façade's names.

The code lives below the actors, in :mod:`treeserve.ops.loaders.registry` (the registry and
``pull``) and :mod:`treeserve.ops.loaders.load` (``load_model``, the caches and
``prepare_for_serving``), so that an actor loads a model without importing the façade. This
module keeps the names the command line, the benches and the tests use.
"""

from __future__ import annotations

from treeserve.ops.loaders.load import (
    CONFIG_FILE,
    CONVERTED_FORMAT_VERSION,
    WEIGHTS_FILE,
    LoadedModel,
    _formatted_path,  # tests check the formatted-buffer cache key through it
    convert_gguf,
    converted_dir_for,
    gguf_source_of,
    load_converted,
    load_model,
    prepare_for_serving,
    stored_blocks_of,
)
from treeserve.ops.loaders.registry import (
    CACHE_ENV_VAR,
    DEFAULT_MODEL,
    REGISTRY,
    ModelLoadError,
    ModelSpec,
    Progress,
    ProgressCallback,
    get_spec,
    pull,
    pull_spec,
    resolve_cache_dir,
    sha256_of,
)

__all__ = [
    "CACHE_ENV_VAR",
    "CONFIG_FILE",
    "CONVERTED_FORMAT_VERSION",
    "DEFAULT_MODEL",
    "REGISTRY",
    "WEIGHTS_FILE",
    "LoadedModel",
    "ModelLoadError",
    "ModelSpec",
    "Progress",
    "ProgressCallback",
    "convert_gguf",
    "converted_dir_for",
    "get_spec",
    "gguf_source_of",
    "load_converted",
    "load_model",
    "prepare_for_serving",
    "pull",
    "pull_spec",
    "stored_blocks_of",
    "resolve_cache_dir",
    "sha256_of",
]

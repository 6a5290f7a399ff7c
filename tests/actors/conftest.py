"""Makes the helper modules beside the tests here importable by name: ``tiny_model_files`` and
``http_helpers`` (which imports the first).

The suite runs with ``--import-mode=importlib``, so sibling helper modules are not on
``sys.path``; registering them once here replaces a loader copied into every test file.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

for _name in ("tiny_model_files", "http_helpers"):  # in dependency order
    _spec = importlib.util.spec_from_file_location(_name, Path(__file__).with_name(f"{_name}.py"))
    assert _spec is not None and _spec.loader is not None
    if _name not in sys.modules:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules[_name] = _module
        _spec.loader.exec_module(_module)

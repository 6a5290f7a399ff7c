"""Makes ``tests/actors/tiny_model_files.py`` importable as ``tiny_model_files`` for the tests here.

The suite runs with ``--import-mode=importlib``, so sibling helper modules are not on
``sys.path``; registering it once here replaces a loader copied into every test file.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("tiny_model_files", Path(__file__).with_name("tiny_model_files.py"))
assert _spec is not None and _spec.loader is not None
if "tiny_model_files" not in sys.modules:
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["tiny_model_files"] = _module
    _spec.loader.exec_module(_module)

"""Puts ``tests/`` on the import path, here and in every process the tests start (through
``PYTHONPATH``), so that the test helpers, :mod:`treeserve_testing`, import by name: child
processes and other nodes re-create actors from their ``module:Class`` path. The helpers are
not part of the installed package (the wheel holds no test code)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
if TESTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)

"""Test helpers, kept in one place: nothing here serves requests, and they are not part of the
installed package (``pyproject.toml`` lists no such package; ``tests/test_layering.py`` checks
that no production module imports them).

``tests/conftest.py`` puts ``tests/`` on the import path of the tests and, through
``PYTHONPATH``, of the processes they start: child processes and other nodes re-create actors
from their ``module:Class`` path. The benches that use them (``bench/runtime.py``,
``bench/gpu_check.py``) add ``tests/`` themselves (each at its import).

* :mod:`treeserve_testing.runtime_actors`: small actors for the runtime's tests and benchmark
  (echo, probe, workers).
* :mod:`treeserve_testing.cluster_actors`: a gloo rank actor for the cluster tests.
* :mod:`treeserve_testing.gateway_fakes`: a scripted scheduler, a byte tokenizer and a gateway
  wired to them, for gateway and client tests without a model.
* :mod:`treeserve_testing.tree_attention_shim`: the CUDA tree kernel's source run on the CPU.
* :mod:`treeserve_testing.scripts`: loading ``bench/*.py`` scripts as modules.
"""

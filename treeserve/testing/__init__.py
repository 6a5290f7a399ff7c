"""Test helpers, kept in one place: nothing here serves requests, and no production module
imports this package (``tests/test_layering.py`` checks it).

They live inside the installed package rather than under ``tests/`` because child processes
and other nodes re-create actors from their ``module:Class`` path, and the benches and the
Node.js client check use them too:

* :mod:`treeserve.testing.runtime_actors`: small actors for the runtime's tests and benchmark
  (echo, probe, workers).
* :mod:`treeserve.testing.cluster_actors`: a gloo rank actor for the cluster tests.
* :mod:`treeserve.testing.gateway_fakes`: a scripted scheduler, a byte tokenizer and a gateway
  wired to them, for gateway and client tests without a model.
"""

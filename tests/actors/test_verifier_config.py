"""VerifierConfig validation: clear ValueErrors for every bad constructor dict."""

from __future__ import annotations

import pytest

from treeserve.actors.verifier_config import VerifierConfig

GOOD = {"model": "m", "cache_dir": None, "dtype": "float32", "tp_rank": 0, "tp_size": 1, "dist_init": None,
        "device": "cpu", "num_rows": 4, "row_capacity": 128}


def test_good_config_and_defaults() -> None:
    cfg = VerifierConfig.from_wire(GOOD)
    assert cfg.num_rows == 4 and cfg.row_capacity == 128
    assert VerifierConfig.from_wire({"model": "m"}).row_capacity is None
    tp = VerifierConfig.from_wire({**GOOD, "tp_rank": 1, "tp_size": 2, "dist_init": "tcp://127.0.0.1:29500"})
    assert tp.tp_size == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": ""}, "model"),
        ({"dtype": "int4"}, "dtype"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_rank": 1}, "tp_rank"),
        ({"tp_size": 2, "dist_init": None}, "dist_init"),
        ({"device": "tpu"}, "device"),
        ({"num_rows": 0}, "num_rows"),
        ({"num_rows": True}, "num_rows"),
        ({"row_capacity": 1}, "row_capacity"),
        ({"dist_timeout_s": 0}, "dist_timeout_s"),
        ({"num_threads": 0}, "num_threads"),
        ({"compile_decode": "no"}, "compile_decode"),
        ({"compile_in_background": 1}, "compile_in_background"),
        ({"rows": 3}, "unknown"),
    ],
)
def test_bad_config_raises_value_error(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VerifierConfig.from_wire({**GOOD, **change})
    with pytest.raises(ValueError, match="dict"):
        VerifierConfig.from_wire(["model"])

"""``VerifierConfig``: the validated constructor config of one
:class:`~treeserve.actors.verifier.VerifierShard`, built without I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from treeserve.actors.model_host import DTYPES, check_device, check_int, check_model_name, check_str_or_none
from treeserve.actors.scheduler.types import SchedulerConfig


@dataclass(frozen=True)
class VerifierConfig:
    """Validated config of one :class:`~treeserve.actors.verifier.VerifierShard` (see ``from_wire``
    for the dict form).

    ``row_capacity`` None means the model's ``max_seq_len``. ``dist_timeout_s`` bounds every
    collective (a rank whose peer died fails instead of hanging forever). ``num_threads`` sets
    torch's intra-op threads for the whole process (None: torch's default, one per core), for
    several CPU shards sharing one machine; only meant for ``process="child"`` actors.
    ``compile_in_background``: a decode step that must be compiled first (minutes) compiles
    while the shard serves eagerly (a long-lived server); otherwise before it serves (a
    short-lived process would be gone before a background compile is saved).
    ``compile_decode`` False: no compiled decode step at all; every step runs eagerly (the same
    kernels, op by op). Loading a saved step takes seconds, so a process that generates a few
    hundred tokens and exits is done sooner without it (``treeserve generate``). On a CUDA
    device (one shard, ``tp_size`` 1) the same switch captures every step's CUDA graphs at
    start-up instead (:mod:`~treeserve.ops.graph_step`; seconds).
    ``reuse_prefixes``: a released row keeps its K/V, and a prompt admitted to it computes only
    what it does not share with them; only where the forward is row-invariant (the int formats'
    fused op), so that it never changes an answer (:mod:`~treeserve.actors.verifier_rows`).
    """

    model: str
    cache_dir: str | None = None
    dtype: str = "float32"
    tp_rank: int = 0
    tp_size: int = 1
    dist_init: str | None = None
    device: str = "cpu"
    num_rows: int = SchedulerConfig.num_rows  # the one default: the scheduler's rows are the shards' rows
    row_capacity: int | None = None
    dist_timeout_s: float = 120.0
    num_threads: int | None = None
    compile_in_background: bool = False
    compile_decode: bool = True
    reuse_prefixes: bool = True

    def __post_init__(self) -> None:
        check_model_name(self.model)
        check_str_or_none(self.cache_dir, "cache_dir")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        check_int(self.tp_size, "tp_size", minimum=1)
        check_int(self.tp_rank, "tp_rank")
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank must be < tp_size ({self.tp_size}), got {self.tp_rank}")
        if self.tp_size > 1 and not (isinstance(self.dist_init, str) and self.dist_init.startswith(("tcp://", "file://"))):
            raise ValueError(f"tp_size > 1 needs dist_init like 'tcp://127.0.0.1:PORT', got {self.dist_init!r}")
        check_device(self.device)
        check_int(self.num_rows, "num_rows", minimum=1)
        if self.row_capacity is not None:
            check_int(self.row_capacity, "row_capacity", minimum=2)
        if isinstance(self.dist_timeout_s, bool) or not isinstance(self.dist_timeout_s, (int, float)) \
                or not self.dist_timeout_s > 0:
            raise ValueError(f"dist_timeout_s must be a positive number, got {self.dist_timeout_s!r}")
        if self.num_threads is not None:
            check_int(self.num_threads, "num_threads", minimum=1)
        for name in ("compile_in_background", "compile_decode", "reuse_prefixes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")

    def to_wire(self) -> dict[str, Any]:
        """The constructor dict :meth:`from_wire` takes back (a shard's child-process argument)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, config: Any) -> VerifierConfig:
        """Build from the constructor dict; unknown keys are rejected with the known ones listed."""
        if not isinstance(config, Mapping):
            raise ValueError(f"VerifierShard config must be a dict, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in config if k not in known)
        if unknown:
            raise ValueError(f"unknown VerifierShard config keys {unknown}; known keys: {sorted(known)}")
        return cls(**config)


__all__ = ["VerifierConfig"]
